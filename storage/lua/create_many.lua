-- create_many: create each job of a list as create does, without a cap on an owner's queued
-- jobs (bulk creation is for trusted Python callers). A refused job does not stop the others.
-- Returns one status per job, in order: 1 created, 0 existing, 'CONFLICT' or 'NOBATCH'.
-- One clock reading and one block of creation sequence numbers (gaps are harmless) per run.
-- The jobs' own keys are completed here from the prefixes storage/keys.py passes, with the ids
-- each row names: passed as KEYS they are six per job (600 per run), and encoding and handling
-- them made bulk creation about 1.5 times slower (measured with 20k jobs).
-- include: _create
-- KEYS[1] = index of every job (zset)
-- KEYS[2] = index of queued jobs (zset)
-- KEYS[3] = unpublished jobs (zset)
-- KEYS[4] = queue depth (counter)
-- KEYS[5] = creation sequence (counter)
-- KEYS[6] = queued jobs per owner (hash)
-- ARGV[1] = jobs: JSON list of [id, request, lane, owner, batch id, metadata, idempotency key,
--   fingerprint, queue, trace], each as create's ARGV[1..9] and ARGV[15]
-- ARGV[2] = job record prefix (+ job id)
-- ARGV[3] = events suffix (job record key + suffix: the job's events)
-- ARGV[4] = idempotency entry prefix (+ idempotency key)
-- ARGV[5] = batch record prefix (+ batch id)
-- ARGV[6] = batch index prefix (+ batch id)
-- ARGV[7] = owner index prefix (+ owner)
-- ARGV[8] = queue index prefix (+ queue)
-- ARGV[9] = events kept per job
local jobs = cjson.decode(ARGV[1])
local c = {all = KEYS[1], queued = KEYS[2], unpublished = KEYS[3], depth = KEYS[4],
  seq = KEYS[5], owner_queued = KEYS[6], job_prefix = ARGV[2], maxlen = ARGV[9], max_queued = ''}
local events_suffix, idem_prefix, batch_prefix = ARGV[3], ARGV[4], ARGV[5]
local batch_index_prefix, owner_index_prefix, queue_index_prefix = ARGV[6], ARGV[7], ARGV[8]

local function completed(prefix, id)
  if id == '' then return '' end
  return prefix .. id
end

-- `jk` of a row: '' where the row has no idempotency key, batch or owner
local function keys_of(j)
  local record = c.job_prefix .. j[1]
  return {record = record, events = record .. events_suffix, idem = completed(idem_prefix, j[7]),
    batch = completed(batch_prefix, j[5]), batch_index = completed(batch_index_prefix, j[5]),
    owner_index = completed(owner_index_prefix, j[4]),
    queue_index = completed(queue_index_prefix, j[9])}
end

local out, time = {}, (clock())
local first_seq = redis.call('INCRBY', c.seq, #jobs) - #jobs + 1
for i, j in ipairs(jobs) do
  out[i] = (create_job(c, keys_of(j), j, time, first_seq + i - 1))
end
flush_later(c)
return out
