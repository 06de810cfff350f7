-- create: write one job as queued (its first event, indexes, counters), unless it exists: same
-- id, or an idempotency key bound to the same fingerprint. Returns {1 created or 0 existing,
-- the record as a flat HGETALL}, or {'FULL', queued jobs in all} with nothing written while the
-- jobs queued in all reach `max depth`. Errors: CONFLICT (key bound to another fingerprint),
-- NOBATCH, QUOTA (the owner has `max queued` queued jobs already; an existing job is still
-- returned). Given its Celery message, a created job's message is pushed onto its queue in the
-- same step and the job is marked published (no window in which the record has no message).
-- include: _create
-- KEYS[1] = index of every job (zset)
-- KEYS[2] = index of queued jobs (zset)
-- KEYS[3] = unpublished jobs (zset)
-- KEYS[4] = queue depth (counter)
-- KEYS[5] = creation sequence (counter)
-- KEYS[6] = queued jobs per owner (hash)
-- KEYS[7] = job record (hash)
-- KEYS[8] = job events (stream)
-- KEYS[9] = idempotency entry (hash; '' without a key)
-- KEYS[10] = batch record (hash; '' without a batch)
-- KEYS[11] = batch index (zset; '' without a batch)
-- KEYS[12] = owner index (zset; '' without an owner)
-- KEYS[13] = queue index (zset; '' without a queue)
-- KEYS[14] = the Celery queue (list) the message goes to ('' without a message)
-- ARGV[1] = job id
-- ARGV[2] = request (JSON)
-- ARGV[3] = lane
-- ARGV[4] = owner ('' for none)
-- ARGV[5] = batch id ('' for none)
-- ARGV[6] = metadata (JSON)
-- ARGV[7] = idempotency key ('' for none)
-- ARGV[8] = request fingerprint ('' without an idempotency key)
-- ARGV[9] = queue: `<lane>.<pipeline>` ('' for none: no queue index entry)
-- ARGV[10] = job record prefix
-- ARGV[11] = events kept per job
-- ARGV[12] = max queued: most queued jobs the owner may have ('' for no cap)
-- ARGV[13] = max depth: most queued jobs in all ('' for no cap)
-- ARGV[14] = the job's Celery message as kombu's Redis transport pushes it ('' for none)
-- ARGV[15] = the job's W3C trace context (JSON; '{}' for none)
local job = {ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9],
  ARGV[15]}
local c = {all = KEYS[1], queued = KEYS[2], unpublished = KEYS[3], depth = KEYS[4],
  seq = KEYS[5], owner_queued = KEYS[6], job_prefix = ARGV[10], maxlen = ARGV[11],
  max_queued = ARGV[12]}
local jk = {record = KEYS[7], events = KEYS[8], idem = KEYS[9], batch = KEYS[10],
  batch_index = KEYS[11], owner_index = KEYS[12], queue_index = KEYS[13]}
local celery_queue, max_depth, message = KEYS[14], ARGV[13], ARGV[14]

if max_depth ~= '' then
  local depth = tonumber(redis.call('GET', c.depth) or '0')
  if depth >= tonumber(max_depth) then return {'FULL', depth} end
end

local status, record = create_job(c, jk, job, (clock()), redis.call('INCR', c.seq))
if status == 'CONFLICT' then raise('CONFLICT', job[7]) end
if status == 'NOBATCH' then raise('NOBATCH', job[5]) end
if status == 'QUOTA' then raise('QUOTA', job[4] .. ' queued ' .. c.max_queued) end
flush_later(c)
if status == 1 and message ~= '' then
  redis.call('LPUSH', celery_queue, message)
  redis.call('HSET', record, 'published', '1')
  redis.call('ZREM', c.unpublished, job[1])
end
return {status, redis.call('HGETALL', record)}
