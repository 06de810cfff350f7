-- webhook_attempt: append one delivery attempt to the job's log, keep the newest `cap`; the log
-- lives as long as the record. Returns 1. Errors: NOTFOUND.
-- KEYS[1] = job record (hash)
-- KEYS[2] = job webhook attempts (list)
-- ARGV[1] = job id
-- ARGV[2] = attempt (JSON)
-- ARGV[3] = cap: attempts kept
local job_key, hooks_key = KEYS[1], KEYS[2]
local job_id, attempt, cap = ARGV[1], ARGV[2], ARGV[3]

load_job(job_key, job_id)
redis.call('RPUSH', hooks_key, attempt)
redis.call('LTRIM', hooks_key, -tonumber(cap), -1)
local ttl = redis.call('PTTL', job_key)
if ttl > 0 then redis.call('PEXPIRE', hooks_key, ttl) end
return 1
