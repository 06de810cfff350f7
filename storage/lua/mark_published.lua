-- mark_published: the job's Celery message was published; the sweeper skips it from now on.
-- Returns 1. Errors: NOTFOUND.
-- KEYS[1] = job record (hash)
-- KEYS[2] = unpublished jobs (zset)
-- ARGV[1] = job id
local job_key, unpublished_key = KEYS[1], KEYS[2]
local job_id = ARGV[1]

load_job(job_key, job_id)
redis.call('HSET', job_key, 'published', '1')
redis.call('ZREM', unpublished_key, job_id)
return 1
