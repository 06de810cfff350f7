-- create: writing new queued jobs, included by create and create_many.
-- `c` holds what every new job touches, built by those scripts from their KEYS and ARGV:
--   c.all, c.queued, c.unpublished, c.depth, c.seq, c.owner_queued: the index of every job, the
--     index of queued jobs, the unpublished set, the queue depth, the creation sequence and the
--     queued jobs per owner;
--   c.job_prefix: the record prefix from storage/keys.py, completed with the job id an
--     idempotency entry holds (read here, so the caller cannot name that record);
--   c.maxlen: events kept per job;
--   c.max_queued: most queued jobs an owner may have ('' for no cap).
-- `jk` holds one job's keys: record, events, idem (its idempotency entry), batch, batch_index,
-- owner_index and queue_index ('' where the job has no idempotency key, batch, owner or queue);
-- create is given them as KEYS, create_many completes them from prefixes (see there why).
-- Index entries and counters of the jobs created in one run are collected and written with one
-- command per key at the end (bulk creation spends most of its time on per-command overhead).
local later = {zsets = {}, depth = 0, batches = {}, owners = {}}
local CREATED = cjson.encode({reason = 'created'})

local function zadd_later(key, score, member)
  local args = later.zsets[key]
  if not args then args = {}; later.zsets[key] = args end
  args[#args + 1] = score
  args[#args + 1] = member
end

local function flush_later(c)
  for key, args in pairs(later.zsets) do redis.call('ZADD', key, unpack(args)) end
  if later.depth > 0 then redis.call('INCRBY', c.depth, later.depth) end
  for owner, n in pairs(later.owners) do owner_count_add(c.owner_queued, owner, n) end
  for batch_key, n in pairs(later.batches) do redis.call('HINCRBY', batch_key, 'n_queued', n) end
end

local batch_exists = {}

local function batch_missing(batch_key)
  if batch_exists[batch_key] == nil then
    batch_exists[batch_key] = redis.call('EXISTS', batch_key) == 1
  end
  return not batch_exists[batch_key]
end

-- the record a bound idempotency key leads to: its key, or nil if unbound (or the record expired)
local function bound_record(c, jk)
  local prev = redis.call('HMGET', jk.idem, 'job_id', 'fingerprint')
  if prev[1] and redis.call('EXISTS', c.job_prefix .. prev[1]) == 1 then
    return c.job_prefix .. prev[1], prev[2]
  end
  return nil, nil
end

local function record_fields(j, time, cseq)
  local fields = {'id', j[1], 'state', S.queued, 'request', j[2], 'lane', j[3],
    'created_at', time, 'created_seq', cseq}
  if j[4] ~= '' then fields[#fields + 1] = 'owner'; fields[#fields + 1] = j[4] end
  if j[5] ~= '' then fields[#fields + 1] = 'batch_id'; fields[#fields + 1] = j[5] end
  if j[6] ~= '{}' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = j[6] end
  if j[7] ~= '' then fields[#fields + 1] = 'idempotency_key'; fields[#fields + 1] = j[7] end
  if j[9] ~= '' then fields[#fields + 1] = 'queue'; fields[#fields + 1] = j[9] end
  if j[10] and j[10] ~= '{}' then fields[#fields + 1] = 'trace'; fields[#fields + 1] = j[10] end
  return fields
end

local function index_later(c, jk, j, time, cseq)
  local id = j[1]
  zadd_later(c.all, cseq, id)
  zadd_later(c.queued, cseq, id)
  zadd_later(c.unpublished, time, id)
  if j[4] ~= '' then
    zadd_later(jk.owner_index, cseq, id)
    later.owners[j[4]] = (later.owners[j[4]] or 0) + 1
  end
  if j[9] ~= '' then zadd_later(jk.queue_index, cseq, id) end
  if j[5] ~= '' then
    zadd_later(jk.batch_index, cseq, id)
    later.batches[jk.batch] = (later.batches[jk.batch] or 0) + 1
  end
  later.depth = later.depth + 1
end

-- whether the owner of a new job already has c.max_queued queued jobs (this run's included)
local function over_queued_cap(c, owner)
  if c.max_queued == '' or owner == '' then return false end
  local queued = owner_count(c.owner_queued, owner) + (later.owners[owner] or 0)
  return queued >= tonumber(c.max_queued)
end

-- j = {id, request, lane, owner, batch_id, metadata, idempotency key, fingerprint, queue, trace}.
-- Returns status, key of the record: 1 created, 0 existing (same id, or same key and
-- fingerprint), 'CONFLICT', 'NOBATCH' or 'QUOTA' (the owner is at c.max_queued) with nothing
-- written. Fields at their default (empty, zero, null) are not written: readers supply the
-- defaults.
local function create_job(c, jk, j, time, cseq)
  if j[7] ~= '' then
    local bound, fingerprint = bound_record(c, jk)
    if bound then
      if fingerprint ~= j[8] then return 'CONFLICT', nil end
      return 0, bound
    end
  end
  if redis.call('EXISTS', jk.record) == 1 then return 0, jk.record end
  if j[5] ~= '' and batch_missing(jk.batch) then return 'NOBATCH', nil end
  if over_queued_cap(c, j[4]) then return 'QUOTA', nil end
  if j[7] ~= '' then redis.call('HSET', jk.idem, 'job_id', j[1], 'fingerprint', j[8]) end
  redis.call('HSET', jk.record, unpack(record_fields(j, time, cseq)))
  append_event(jk.record, jk.events, c.maxlen, S.queued, time, CREATED)
  index_later(c, jk, j, time, cseq)
  return 1, jk.record
end
