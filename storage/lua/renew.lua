-- renew: re-arm the lease if the token is still the job's current one.
-- Returns 1 if renewed; 2 if the job has ended (a terminal state: its finishing transition dropped
-- the lease, e.g. the holder's own success a moment before this renewal); 0 if the token is stale
-- (or the job is gone).
-- KEYS[1] = job record (hash)
-- KEYS[2] = job lease (string `<token>|<owner>`)
-- KEYS[3] = running jobs (zset)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = lease ttl (ms)
local job_key, lease_key, running_key = KEYS[1], KEYS[2], KEYS[3]
local job_id, token, ttl_ms = ARGV[1], ARGV[2], ARGV[3]

local v = redis.call('HMGET', job_key, 'lease_token', 'lease_owner', 'state')
if not v[1] or v[1] == '0' or v[1] ~= token then
  if TERMINAL[v[3]] then return 2 end
  return 0
end
redis.call('SET', lease_key, v[1] .. '|' .. v[2], 'PX', ttl_ms)
if v[3] == S.running then
  local _, now_ms = clock()
  redis.call('ZADD', running_key, now_ms + ttl_ms, job_id)
end
return 1
