"""Lua sources for job creation, single and bulk; same calling convention as storage/lua.py."""

from __future__ import annotations

_CREATE_LIB = r"""
-- Index entries and counters of the jobs created in one run are collected and written with one
-- command per key at the end (bulk creation spends most of its time on per-command overhead).
local later = {zsets = {}, depth = 0, batches = {}}

local function zadd_later(key, score, member)
  local args = later.zsets[key]
  if not args then args = {}; later.zsets[key] = args end
  args[#args + 1] = score
  args[#args + 1] = member
end

local function flush_later()
  for key, args in pairs(later.zsets) do redis.call('ZADD', key, unpack(args)) end
  if later.depth > 0 then redis.call('INCRBY', K_DEPTH, later.depth) end
  for batch, n in pairs(later.batches) do
    redis.call('HINCRBY', P_BATCH .. batch, 'n_queued', n)
  end
end

local batch_exists = {}

local function batch_missing(batch)
  if batch_exists[batch] == nil then
    batch_exists[batch] = redis.call('EXISTS', P_BATCH .. batch) == 1
  end
  return not batch_exists[batch]
end

-- j = {id, request, lane, owner, batch_id, metadata, idempotency key, fingerprint}.
-- Returns status, key of the record: 1 created, 0 existing (same id, or same key and
-- fingerprint), 'CONFLICT' or 'NOBATCH' with nothing written. Fields at their default
-- (empty, zero, null) are not written: readers supply the defaults.
local function create_job(kjob, kevents, j, time, cseq)
  local id, owner, batch, idem = j[1], j[4], j[5], j[7]
  if idem ~= '' then
    local prev = redis.call('HMGET', P_IDEM .. idem, 'job_id', 'fingerprint')
    if prev[1] and redis.call('EXISTS', P_JOB .. prev[1]) == 1 then
      if prev[2] ~= j[8] then return 'CONFLICT', nil end
      return 0, P_JOB .. prev[1]
    end
  end
  if redis.call('EXISTS', kjob) == 1 then return 0, kjob end
  if batch ~= '' and batch_missing(batch) then return 'NOBATCH', nil end
  local fields = {'id', id, 'state', 'queued', 'request', j[2], 'lane', j[3],
    'created_at', time, 'created_seq', cseq}
  if owner ~= '' then fields[#fields + 1] = 'owner'; fields[#fields + 1] = owner end
  if batch ~= '' then fields[#fields + 1] = 'batch_id'; fields[#fields + 1] = batch end
  if j[6] ~= '{}' then fields[#fields + 1] = 'metadata'; fields[#fields + 1] = j[6] end
  if idem ~= '' then
    fields[#fields + 1] = 'idempotency_key'; fields[#fields + 1] = idem
    redis.call('HSET', P_IDEM .. idem, 'job_id', id, 'fingerprint', j[8])
  end
  redis.call('HSET', kjob, unpack(fields))
  append_event_at(kjob, kevents, 'queued', time, '{"reason":"created"}')
  zadd_later(K_ALL, cseq, id)
  zadd_later(P_STATE .. 'queued', cseq, id)
  zadd_later(K_UNPUBLISHED, time, id)
  if owner ~= '' then zadd_later(P_OWNER .. owner, cseq, id) end
  if batch ~= '' then
    zadd_later(P_BATCH_IDX .. batch, cseq, id)
    later.batches[batch] = (later.batches[batch] or 0) + 1
  end
  later.depth = later.depth + 1
  return 1, kjob
end
"""

CREATE = (
    _CREATE_LIB
    + r"""
-- ARGV[A..A+7]: the fields of j (see create_job). Returns {created 0/1, record hash}.
local j = {}
for i = 0, 7 do j[i + 1] = ARGV[A + i] end
local status, kjob = create_job(K_JOB, K_EVENTS, j, (clock()), redis.call('INCR', K_SEQ))
if status == 'CONFLICT' then raise('CONFLICT', j[7]) end
if status == 'NOBATCH' then raise('NOBATCH', j[5]) end
flush_later()
return {status, redis.call('HGETALL', kjob)}
"""
)

CREATE_MANY = (
    _CREATE_LIB
    + r"""
-- ARGV[A]: unused (no single job); ARGV[A+1]: events key suffix; ARGV[A+2]: JSON list of j.
-- Returns one status per job, in order; a refused job does not stop the others.
-- One clock reading and one block of creation sequence numbers (gaps are harmless) per run.
local jobs = cjson.decode(ARGV[A + 2])
local out, time = {}, (clock())
local first_seq = redis.call('INCRBY', K_SEQ, #jobs) - #jobs + 1
for i, j in ipairs(jobs) do
  local kjob = P_JOB .. j[1]
  out[i] = (create_job(kjob, kjob .. ARGV[A + 1], j, time, first_seq + i - 1))
end
flush_later()
return out
"""
)
