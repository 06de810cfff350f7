-- reap: a running job whose lease is gone goes back to queued (to canceled or paused if a cancel
-- or a pause is pending); a job that is not running leaves the running set. Returns 1 if the job moved, else 0.
-- include: _machine
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
-- ARGV[1] = job id
-- ARGV[2] = state index prefix
-- ARGV[3] = batch prefix
-- ARGV[4] = batch index prefix
-- ARGV[5] = idempotency entry prefix
-- ARGV[6] = queue index prefix
-- ARGV[7] = completion window prefix
-- ARGV[8] = events kept per job
-- ARGV[9] = retention seconds
-- ARGV[10] = completion window (s)
-- ARGV[11] = usage bucket prefix
local job_id = ARGV[1]
local m = {job = KEYS[1], events = KEYS[2], lease = KEYS[3], cancel = KEYS[4], hooks = KEYS[5],
  running = KEYS[6], unpublished = KEYS[7], depth = KEYS[8], retired = KEYS[9], seq = KEYS[10],
  owner_queued = KEYS[11], owner_running = KEYS[12], finished = KEYS[13],
  state_index_prefix = ARGV[2], batch_prefix = ARGV[3], batch_index_prefix = ARGV[4],
  idem_prefix = ARGV[5], queue_index_prefix = ARGV[6], completions_prefix = ARGV[7],
  maxlen = ARGV[8], retention = ARGV[9], window = ARGV[10], usage_prefix = ARGV[11]}

return reap_job(m, job_id)
