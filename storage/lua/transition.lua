-- transition: move a job along one edge of the state machine (kiln/common/states.py), fenced by
-- its lease. A pending cancel (pause) turns a retry or a hand-back into `canceled` (`paused`)
-- when honor_cancel is '1' (the job would only be stopped again). Returns the record after the change as a flat HGETALL.
-- Errors: NOTFOUND, ILLEGAL (terminal, or not in a source state, or a move into running of a job
-- whose batch was asked to stop), STALE (fence), QUOTA (a move into running while the job's owner
-- has `running cap` running jobs already).
-- A move into failed also records the job in the dead-letter set (_dead_letters.lua), in this step.
-- include: _machine
-- include: _dead_letters
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- KEYS[3] = job lease (string)
-- KEYS[4] = job stop request (string: a cancel, a pause or a preemption)
-- KEYS[5] = job webhook attempts (list)
-- KEYS[6] = running jobs (zset)
-- KEYS[7] = unpublished jobs (zset)
-- KEYS[8] = queue depth (counter)
-- KEYS[9] = retired index entries (zset)
-- KEYS[10] = creation sequence (counter)
-- KEYS[11] = queued jobs per owner (hash)
-- KEYS[12] = running jobs per owner (hash)
-- KEYS[13] = finished counts (hash: monotonic counters of terminal transitions)
-- KEYS[14] = dead-letter index (zset)
-- KEYS[15] = the job's dead-letter record (hash)
-- ARGV[1] = job id
-- ARGV[2] = sources: accepted states, space separated and padded (' queued running ')
-- ARGV[3] = target state
-- ARGV[4] = fence mode: token, not_running or none
-- ARGV[5] = lease token (for fence mode token)
-- ARGV[6] = event payload (JSON)
-- ARGV[7] = honor_cancel: '1' or '0'
-- ARGV[8] = running cap: most running jobs the job's owner may have ('' for no cap); checked
--   only by a move into running
-- ARGV[9] = state index prefix
-- ARGV[10] = batch prefix
-- ARGV[11] = batch index prefix
-- ARGV[12] = idempotency entry prefix
-- ARGV[13] = queue index prefix
-- ARGV[14] = completion window prefix
-- ARGV[15] = events kept per job
-- ARGV[16] = retention seconds
-- ARGV[17] = completion window (s)
-- ARGV[18] = usage bucket prefix
-- ARGV[19] = dead-letter record prefix (the cap drops records named by ids the index holds)
-- ARGV[20] = dead-letter owner index prefix (completed with the owner a record names)
-- ARGV[21] = dead-letter retention seconds
-- ARGV[22] = most dead letters kept
-- ARGV[23..] = record fields written with the change: field, value, field, value, ...
local job_id, sources, target, fence, token = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local payload, honor_cancel, running_cap = ARGV[6], ARGV[7], ARGV[8]
local m = {job = KEYS[1], events = KEYS[2], lease = KEYS[3], cancel = KEYS[4], hooks = KEYS[5],
  running = KEYS[6], unpublished = KEYS[7], depth = KEYS[8], retired = KEYS[9], seq = KEYS[10],
  owner_queued = KEYS[11], owner_running = KEYS[12], finished = KEYS[13],
  state_index_prefix = ARGV[9], batch_prefix = ARGV[10], batch_index_prefix = ARGV[11],
  idem_prefix = ARGV[12], queue_index_prefix = ARGV[13], completions_prefix = ARGV[14],
  maxlen = ARGV[15], retention = ARGV[16], window = ARGV[17], usage_prefix = ARGV[18]}
local d = {index = KEYS[14], record = KEYS[15], record_prefix = ARGV[19], owner_prefix = ARGV[20],
  retention = ARGV[21], cap = ARGV[22]}
local fields = {unpack(ARGV, 23)}

local job = load_job(m.job, job_id)
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. target) end
check_fence(job, fence, token)
if not string.find(sources, ' ' .. job.state .. ' ', 1, true) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. target)
end
-- a job of a batch asked to stop never starts, held or not (hold.lua, and here)
if target == S.running and batch_stopped(job, m.batch_prefix) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. target)
end
if target == S.running and running_cap ~= '' and job.job_owner ~= ''
    and owner_count(m.owner_running, job.job_owner) >= tonumber(running_cap) then
  raise('QUOTA', job.job_owner .. ' running ' .. running_cap)
end
if honor_cancel == '1' then
  local requested, requested_payload = requested_end(m)
  if requested then
    -- the requested end writes none of the caller's fields but its attempt's steps, which
    -- account the attempt it closes however it ends
    target, payload, fields = requested, requested_payload, attempt_steps_only(fields)
  end
end
local time = transition(m, job, target, payload, fields)
if target == S.failed then bury(d, m.job, m.seq, job, time) end
return redis.call('HGETALL', m.job)
