-- progress: record the progress of a job whose lease the caller holds (fenced) and append a
-- `progress` event. A running job's stages are its work; a queued (held) job's only stage is
-- `waiting_in_node` (hold.lua), and a `waiting_in_node` that reaches a job started meanwhile is
-- stale: nothing is written. Returns the event's seq, or 0 when nothing was written.
-- Errors: NOTFOUND, ILLEGAL (finished, or queued with another stage), STALE (fence).
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = progress (JSON)
-- ARGV[4] = events kept per job
-- ARGV[5] = '1' when the progress is the waiting stage (storage/leases.py WAITING_IN_NODE)
local job_key, events_key = KEYS[1], KEYS[2]
local job_id, token, progress, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local waiting = ARGV[5] == '1'

local job = load_job(job_key, job_id)
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress') end
check_fence(job, 'token', token)
if job.state == S.running and waiting then return 0 end
if job.state ~= S.running and not (job.state == S.queued and waiting) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress')
end
redis.call('HSET', job_key, 'progress', progress)
-- the furthest denoising step this attempt reported, and when: its step accounting if its node
-- dies (_machine.lua `account_attempt`)
local reported = cjson.decode(progress)
if job.state == S.running and reported.stage == 'denoising' and tonumber(reported.step) then
  redis.call('HSET', job_key, 'denoised', reported.step, 'denoised_at', (clock()))
end
return append_event(job_key, events_key, maxlen, 'progress', (clock()), progress)
