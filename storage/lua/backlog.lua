-- backlog: what autoscaling and admission read of some queues, at one instant: how many jobs each
-- holds, whether it is paused, its runs that ended within the window, and its running jobs.
-- Returns {now (ms), then per queue, in the order of ARGV[3..]: {queued jobs, 1 if paused else 0,
-- runs finished within the window, those of them whose start is known, their total run time
-- (ms), earliest start (ms) of the finished runs (0 if none), running jobs, then the distinct
-- node ids holding those running jobs' leases}}. A lease owner is `<node id>/<delivery>` (one
-- per delivery, storage/leases.py `delivery_owner`): a node holding eight leases is one node.
-- KEYS[1] = running jobs (zset: job id -> lease deadline, ms)
-- KEYS[2] = paused queues (hash: queue -> pause record)
-- KEYS[3..] = per queue, its index (zset) then its completion window (zset: '<job id>@<start
--   ms>' -> finish ms), in pairs, in the order of ARGV[3..]
-- ARGV[1] = job record prefix: completed with the running ids read from KEYS[1], which no caller
--   knows before the script runs
-- ARGV[2] = window (s): runs that finished longer ago do not count
-- ARGV[3..] = the queue names
local running_key, paused_key = KEYS[1], KEYS[2]
local queue_keys = {unpack(KEYS, 3)}
local job_prefix, window_s = ARGV[1], ARGV[2]
local queues = {unpack(ARGV, 3)}

local _, now_ms = clock()
local since = now_ms - tonumber(window_s) * 1000
local out, position = {now_ms}, {}
for i, queue in ipairs(queues) do
  local index_key, completions_key = queue_keys[2 * i - 1], queue_keys[2 * i]
  local finished, timed, run_ms, earliest = 0, 0, 0, 0
  local flat = redis.call('ZRANGEBYSCORE', completions_key, since, '+inf', 'WITHSCORES')
  for j = 1, #flat, 2 do
    finished = finished + 1
    local started = tonumber(string.match(flat[j], '@(%d+)$')) or 0
    if started > 0 then
      timed = timed + 1
      run_ms = run_ms + math.max(tonumber(flat[j + 1]) - started, 0)
      if earliest == 0 or started < earliest then earliest = started end
    end
  end
  local paused = redis.call('HEXISTS', paused_key, queue)
  out[i + 1] = {redis.call('ZCARD', index_key), paused, finished, timed, run_ms, earliest, 0}
  position[queue] = i + 1
end
local holders = {}
for _, id in ipairs(redis.call('ZRANGE', running_key, 0, -1)) do
  local fields = redis.call('HMGET', job_prefix .. id, 'queue', 'lease_owner')
  local at = fields[1] and position[fields[1]]
  if at then
    local entry = out[at]
    entry[7] = entry[7] + 1
    local owner = fields[2]
    if owner and owner ~= '' then
      owner = string.match(owner, '^(.*)/[^/]*$') or owner
      holders[at] = holders[at] or {}
      if not holders[at][owner] then
        holders[at][owner] = true
        entry[#entry + 1] = owner
      end
    end
  end
end
return out
