-- preempted: running -> queued for a job its node suspended at a step boundary for a priority
-- preemption (fenced by its lease). It goes back to the head of its lane: its queue index entry
-- scored before every other, and its message, when given, pushed at the end of the queue's list
-- that the next fetch pops first (kombu pushes on the other end: tasks/queue/kombu_redis.py), so
-- marked published. Its attempt is not counted (attempts - 1: its next start counts the same
-- number again); `preemptions` + 1 and `preempted_at` record it (the guard reads them), and a
-- `preempted` event follows the `queued` one. Its stop request ends with the run (_machine.lua
-- enter_queued); a cancel or a pause that replaced the preemption meanwhile ends it as that stop
-- says instead, as a retry would. Returns the record as a flat HGETALL.
-- Errors: NOTFOUND, ILLEGAL (not running), STALE (fence).
-- include: _machine
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- KEYS[3] = job lease (string)
-- KEYS[4] = job stop request (string: a cancel, a pause or this preemption)
-- KEYS[5] = job webhook attempts (list)
-- KEYS[6] = running jobs (zset)
-- KEYS[7] = unpublished jobs (zset)
-- KEYS[8] = queue depth (counter)
-- KEYS[9] = retired index entries (zset)
-- KEYS[10] = creation sequence (counter)
-- KEYS[11] = queued jobs per owner (hash)
-- KEYS[12] = running jobs per owner (hash)
-- KEYS[13] = finished counts (hash: monotonic counters of terminal transitions)
-- KEYS[14] = the job's queue message list ('' when no message is given: the caller publishes)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = the `queued` event's payload (JSON)
-- ARGV[4] = the `preempted` event's payload (JSON; `preemptions` is filled in here)
-- ARGV[5] = the job's message ('' for none)
-- ARGV[6] = state index prefix
-- ARGV[7] = batch prefix
-- ARGV[8] = batch index prefix
-- ARGV[9] = idempotency entry prefix
-- ARGV[10] = queue index prefix
-- ARGV[11] = completion window prefix
-- ARGV[12] = events kept per job
-- ARGV[13] = retention seconds
-- ARGV[14] = completion window (s)
-- ARGV[15] = usage bucket prefix
-- ARGV[16..] = record fields written with the change (the attempt's steps): field, value, ...
local job_id, token, queued_payload, preempted_payload = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local message = ARGV[5]
local m = {job = KEYS[1], events = KEYS[2], lease = KEYS[3], cancel = KEYS[4], hooks = KEYS[5],
  running = KEYS[6], unpublished = KEYS[7], depth = KEYS[8], retired = KEYS[9], seq = KEYS[10],
  owner_queued = KEYS[11], owner_running = KEYS[12], finished = KEYS[13],
  state_index_prefix = ARGV[6], batch_prefix = ARGV[7], batch_index_prefix = ARGV[8],
  idem_prefix = ARGV[9], queue_index_prefix = ARGV[10], completions_prefix = ARGV[11],
  maxlen = ARGV[12], retention = ARGV[13], window = ARGV[14], usage_prefix = ARGV[15]}
local list_key = KEYS[14]
local fields = {unpack(ARGV, 16)}

local job = load_job(m.job, job_id)
check_fence(job, 'token', token)
if job.state ~= S.running then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' queued') end
local stopped, stop_payload = requested_end(m)
if stopped then
  transition(m, job, stopped, stop_payload, fields)
  return redis.call('HGETALL', m.job)
end
local time = transition(m, job, S.queued, queued_payload, fields)
redis.call('HINCRBY', m.job, 'attempts', -1)
local preemptions = redis.call('HINCRBY', m.job, 'preemptions', 1)
redis.call('HSET', m.job, 'preempted_at', time)
if job.queue ~= '' then
  -- the head of the lane: before the first entry that is not this job's own
  local index = m.queue_index_prefix .. job.queue
  local head = redis.call('ZRANGE', index, 0, 1, 'WITHSCORES')
  local first = head[1] == job.id and head[4] or head[2]
  if first then redis.call('ZADD', index, tonumber(first) - 1, job.id) end
end
if message ~= '' then
  redis.call('RPUSH', list_key, message)
  redis.call('HSET', m.job, 'published', '1')
  redis.call('ZREM', m.unpublished, job.id)
end
local event = cjson.decode(preempted_payload)
event.preemptions = preemptions
append_event(m.job, m.events, m.maxlen, 'preempted', time, cjson.encode(event))
return redis.call('HGETALL', m.job)
