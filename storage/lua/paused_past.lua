-- paused_past: ids of paused jobs paused for longer than the retention given (by the Redis
-- clock), at most `limit`: the ones the reaper expires (tasks/control/reaper.py).
-- KEYS[1] = the paused state's index (zset of job ids)
-- ARGV[1] = job record key prefix (the ids come from the index)
-- ARGV[2] = paused retention (s)
-- ARGV[3] = most ids returned
local index, job_prefix = KEYS[1], ARGV[1]
local retention, limit = tonumber(ARGV[2]), tonumber(ARGV[3])

local now = tonumber(redis.call('TIME')[1])
local due = {}
for _, id in ipairs(redis.call('ZRANGE', index, 0, -1)) do
  local at = tonumber(redis.call('HGET', job_prefix .. id, 'paused_at') or '0') or 0
  if now - at > retention then
    due[#due + 1] = id
    if #due >= limit then break end
  end
end
return due
