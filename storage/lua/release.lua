-- release: give the lease up (nothing with a stale token). A running job released without a
-- transition gets deadline 0 in the running set, so the reaper takes it at once; a queued job a
-- node held no longer waits there (its `waiting_in_node` progress goes).
-- Returns 1 if released, else 0.
-- KEYS[1] = job record (hash)
-- KEYS[2] = job lease (string)
-- KEYS[3] = running jobs (zset)
-- ARGV[1] = job id
-- ARGV[2] = lease token
local job_key, lease_key, running_key = KEYS[1], KEYS[2], KEYS[3]
local job_id, token = ARGV[1], ARGV[2]

local v = redis.call('HMGET', job_key, 'lease_token', 'state')
if not v[1] or v[1] == '0' or v[1] ~= token then return 0 end
redis.call('HSET', job_key, 'lease_token', '0')
redis.call('DEL', lease_key)
if v[2] == S.running then redis.call('ZADD', running_key, 0, job_id) end
if v[2] == S.queued then redis.call('HSET', job_key, 'progress', 'null') end
return 1
