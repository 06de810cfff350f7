-- acquire_start: take a queued job's lease for an owner and move the job to running, in one call
-- (what acquire followed by transition queued -> running does in two, one round trip less on
-- every delivery). Refused, with nothing written: LEASEHELD while another owner holds a live
-- lease (checked first, as acquire does), ILLEGAL unless the job is in a source state or when its
-- batch has been asked to stop, QUOTA
-- while the job's owner has `running cap` running jobs already. The new token fences off any
-- token issued before, as acquire's does. Returns {token, the record as a flat HGETALL}.
-- Errors: NOTFOUND, LEASEHELD, ILLEGAL, QUOTA.
-- include: _machine
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- KEYS[3] = job lease (string `<token>|<owner>`)
-- KEYS[4] = job cancel flag (string)
-- KEYS[5] = job webhook attempts (list)
-- KEYS[6] = running jobs (zset)
-- KEYS[7] = unpublished jobs (zset)
-- KEYS[8] = queue depth (counter)
-- KEYS[9] = retired index entries (zset)
-- KEYS[10] = creation sequence (counter)
-- KEYS[11] = queued jobs per owner (hash)
-- KEYS[12] = running jobs per owner (hash)
-- KEYS[13] = finished counts (hash: monotonic counters of terminal transitions)
-- ARGV[1] = job id
-- ARGV[2] = owner of the lease
-- ARGV[3] = lease ttl (ms)
-- ARGV[4] = sources: accepted states, space separated and padded (' queued ')
-- ARGV[5] = event payload of `running` (JSON)
-- ARGV[6] = running cap: most running jobs the job's owner may have ('' for no cap)
-- ARGV[7] = state index prefix
-- ARGV[8] = batch prefix
-- ARGV[9] = batch index prefix
-- ARGV[10] = idempotency entry prefix
-- ARGV[11] = queue index prefix
-- ARGV[12] = completion window prefix
-- ARGV[13] = events kept per job
-- ARGV[14] = retention seconds
-- ARGV[15] = completion window (s)
local job_id, owner, ttl_ms, sources = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local payload, running_cap = ARGV[5], ARGV[6]
local m = {job = KEYS[1], events = KEYS[2], lease = KEYS[3], cancel = KEYS[4], hooks = KEYS[5],
  running = KEYS[6], unpublished = KEYS[7], depth = KEYS[8], retired = KEYS[9], seq = KEYS[10],
  owner_queued = KEYS[11], owner_running = KEYS[12], finished = KEYS[13],
  state_index_prefix = ARGV[7], batch_prefix = ARGV[8], batch_index_prefix = ARGV[9],
  idem_prefix = ARGV[10], queue_index_prefix = ARGV[11], completions_prefix = ARGV[12],
  maxlen = ARGV[13], retention = ARGV[14], window = ARGV[15]}

local job = load_job(m.job, job_id)
check_lease_free(job, m.lease, owner)
if TERMINAL[job.state] or not string.find(sources, ' ' .. job.state .. ' ', 1, true) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' running')
end
-- a job of a batch asked to stop (canceled, or expired) never starts: the stop is set in one
-- step (batch_stop) and read here in one, so nothing of the batch starts once its cancel answered;
-- the batch's feeder ends the job
if batch_stopped(job, m.batch_prefix) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' running')
end
if running_cap ~= '' and job.job_owner ~= ''
    and owner_count(m.owner_running, job.job_owner) >= tonumber(running_cap) then
  raise('QUOTA', job.job_owner .. ' running ' .. running_cap)
end
local token = redis.call('HINCRBY', m.job, 'fence', 1)
redis.call('HSET', m.job, 'lease_token', token, 'lease_owner', owner)
-- the lease first: entering running reads its TTL for the running set's deadline
redis.call('SET', m.lease, token .. '|' .. owner, 'PX', ttl_ms)
job.token, job.owner = tostring(token), owner  -- as the record now says (the event names the owner)
transition(m, job, S.running, payload, {})
return {token, redis.call('HGETALL', m.job)}
