-- progress: record the running job's progress (fenced) and append a `progress` event.
-- Returns the event's seq. Errors: NOTFOUND, ILLEGAL (not running), STALE (fence).
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = progress (JSON)
-- ARGV[4] = events kept per job
local job_key, events_key = KEYS[1], KEYS[2]
local job_id, token, progress, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]

local job = load_job(job_key, job_id)
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress') end
check_fence(job, 'token', token)
if job.state ~= S.running then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress') end
redis.call('HSET', job_key, 'progress', progress)
return append_event(job_key, events_key, maxlen, 'progress', (clock()), progress)
