-- acquire: take the job's lease for an owner. The same owner may take it again (the new token
-- fences off its previous one); a live lease of another owner is refused.
-- Returns the new fencing token. Errors: NOTFOUND, LEASEHELD.
-- KEYS[1] = job record (hash)
-- KEYS[2] = job lease (string `<token>|<owner>`)
-- KEYS[3] = running jobs (zset)
-- ARGV[1] = job id
-- ARGV[2] = owner
-- ARGV[3] = lease ttl (ms)
local job_key, lease_key, running_key = KEYS[1], KEYS[2], KEYS[3]
local job_id, owner, ttl_ms = ARGV[1], ARGV[2], ARGV[3]

local job = load_job(job_key, job_id)
check_lease_free(job, lease_key, owner)
local token = redis.call('HINCRBY', job_key, 'fence', 1)
redis.call('HSET', job_key, 'lease_token', token, 'lease_owner', owner)
redis.call('SET', lease_key, token .. '|' .. owner, 'PX', ttl_ms)
if job.state == S.running then
  local _, now_ms = clock()
  redis.call('ZADD', running_key, now_ms + ttl_ms, job.id)
end
return token
