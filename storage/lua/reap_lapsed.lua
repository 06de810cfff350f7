-- reap_lapsed: the reaper's pass in one step. Every running job whose lease deadline has passed by
-- the Redis clock and whose lease is gone goes back to queued (to canceled or paused when a cancel
-- or a pause is pending), as reap.lua moves one job; a job found no longer running leaves the
-- running set. Returns the ids of the jobs it moved (each marked unpublished: the caller
-- publishes them again), looking at `limit` jobs at most.
-- include: _machine
-- KEYS[1] = running jobs (zset: job id -> lease deadline, ms)
-- KEYS[2] = unpublished jobs (zset)
-- KEYS[3] = queue depth (counter)
-- KEYS[4] = retired index entries (zset)
-- KEYS[5] = creation sequence (counter)
-- KEYS[6] = queued jobs per owner (hash)
-- KEYS[7] = running jobs per owner (hash)
-- KEYS[8] = finished counts (hash: monotonic counters of terminal transitions)
-- ARGV[1] = limit
-- ARGV[2] = job record prefix (+ job id)
-- ARGV[3] = events suffix (job record key + it)
-- ARGV[4] = lease suffix
-- ARGV[5] = stop request suffix
-- ARGV[6] = webhook attempts suffix
-- ARGV[7] = state index prefix
-- ARGV[8] = batch prefix
-- ARGV[9] = batch index prefix
-- ARGV[10] = idempotency entry prefix
-- ARGV[11] = queue index prefix
-- ARGV[12] = completion window prefix
-- ARGV[13] = events kept per job
-- ARGV[14] = retention seconds
-- ARGV[15] = completion window (s)
-- ARGV[16] = usage bucket prefix
local limit, job_prefix = ARGV[1], ARGV[2]
local events_suffix, lease_suffix, stop_suffix, hooks_suffix = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local namespace = {running = KEYS[1], unpublished = KEYS[2], depth = KEYS[3], retired = KEYS[4],
  seq = KEYS[5], owner_queued = KEYS[6], owner_running = KEYS[7], finished = KEYS[8],
  state_index_prefix = ARGV[7], batch_prefix = ARGV[8], batch_index_prefix = ARGV[9],
  idem_prefix = ARGV[10], queue_index_prefix = ARGV[11], completions_prefix = ARGV[12],
  maxlen = ARGV[13], retention = ARGV[14], window = ARGV[15], usage_prefix = ARGV[16]}

local _, now_ms = clock()
local due = redis.call('ZRANGEBYSCORE', namespace.running, '-inf', now_ms, 'LIMIT', 0, limit)
local reaped = {}
for _, job_id in ipairs(due) do
  local job_key = job_prefix .. job_id
  local m = {job = job_key, events = job_key .. events_suffix, lease = job_key .. lease_suffix,
    cancel = job_key .. stop_suffix, hooks = job_key .. hooks_suffix}
  for name, value in pairs(namespace) do m[name] = value end
  if reap_job(m, job_id) == 1 then reaped[#reaped + 1] = job_id end
end
return reaped
