-- lease_deadlines_passed: running jobs whose lease deadline has passed by the Redis clock (reap
-- candidates; the caller checks their lease keys). Returns up to `limit` job ids.
-- KEYS[1] = running jobs (zset: job id -> lease deadline, ms)
-- ARGV[1] = limit
local running_key = KEYS[1]
local limit = ARGV[1]

local _, now_ms = clock()
return redis.call('ZRANGEBYSCORE', running_key, '-inf', now_ms, 'LIMIT', 0, limit)
