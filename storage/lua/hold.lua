-- hold: take a queued job's lease for one delivery on a node that will start it once its group
-- can (docs/contract.md §3, `waiting_in_node`). The job stays `queued` (in its queue index, so
-- its position, its ETA and the backlog still count it); the lease keeps any other delivery off
-- it, and only the holder's token can start it (transition queued -> running, fenced). Its
-- progress says where it waits, with a `progress` event. Refused, with nothing written: LEASEHELD
-- while another owner holds a live lease (checked first, as acquire does), ILLEGAL unless the
-- job is queued or when its batch has been asked to stop. The new token fences off any token
-- issued before. Returns {token, the record as a flat HGETALL}.
-- Errors: NOTFOUND, LEASEHELD, ILLEGAL.
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- KEYS[3] = job lease (string `<token>|<owner>`)
-- ARGV[1] = job id
-- ARGV[2] = owner of the lease
-- ARGV[3] = lease ttl (ms)
-- ARGV[4] = progress (JSON: stage waiting_in_node, the node, its position there)
-- ARGV[5] = batch prefix
-- ARGV[6] = events kept per job
local job_key, events_key, lease_key = KEYS[1], KEYS[2], KEYS[3]
local job_id, owner, ttl_ms, progress = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local batch_prefix, maxlen = ARGV[5], ARGV[6]

local job = load_job(job_key, job_id)
check_lease_free(job, lease_key, owner)
if job.state ~= S.queued then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' held') end
-- a job of a batch asked to stop is not taken (as it is not started: transition.lua)
if batch_stopped(job, batch_prefix) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' held')
end
local token = redis.call('HINCRBY', job_key, 'fence', 1)
redis.call('HSET', job_key, 'lease_token', token, 'lease_owner', owner, 'progress', progress)
redis.call('SET', lease_key, token .. '|' .. owner, 'PX', ttl_ms)
append_event(job_key, events_key, maxlen, 'progress', (clock()), progress)
return {token, redis.call('HGETALL', job_key)}
