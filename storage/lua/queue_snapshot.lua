-- queue_snapshot: where a queued job stands in its queue, and how fast runs of its pipeline have
-- been finishing, read at one instant. Returns {rank: queued jobs ahead of it in its queue (-1 if
-- it is not queued there), size of the other queue, 1 if its queue is paused else 0, 1 if the
-- other queue is paused else 0, runs finished within the window in the queues of KEYS[4..],
-- earliest start (ms) of those runs (0 if none), now (ms)}.
-- KEYS[1] = paused queues (hash: queue -> pause record)
-- KEYS[2] = the job's queue index (zset)
-- KEYS[3] = the other queue's index, whose size is wanted (zset; '' for none)
-- KEYS[4..] = completion windows whose runs count (zset: '<job id>@<start ms>' -> finish ms)
-- ARGV[1] = job id
-- ARGV[2] = the job's queue
-- ARGV[3] = the other queue ('' for none)
-- ARGV[4] = window (s): runs that finished longer ago do not count
local paused_key, queue_key, other_key = KEYS[1], KEYS[2], KEYS[3]
local completion_keys = {unpack(KEYS, 4)}
local job_id, queue, other, window_s = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local _, now_ms = clock()
local rank = redis.call('ZRANK', queue_key, job_id) or -1
local other_size, other_paused = 0, 0
if other_key ~= '' then
  other_size = redis.call('ZCARD', other_key)
  other_paused = redis.call('HEXISTS', paused_key, other)
end
local paused = redis.call('HEXISTS', paused_key, queue)
local since = now_ms - tonumber(window_s) * 1000
local finished, earliest = 0, 0
for _, key in ipairs(completion_keys) do
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', key, since, '+inf')) do
    finished = finished + 1
    local started = tonumber(string.match(member, '@(%d+)$')) or 0
    if earliest == 0 or (started > 0 and started < earliest) then earliest = started end
  end
end
return {rank, other_size, paused, other_paused, finished, earliest, now_ms}
