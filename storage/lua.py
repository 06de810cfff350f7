"""Lua sources of the job store: every state change runs as one script, all or nothing.

Job scripts share one calling convention (see `StoreBase._call` in storage/base.py):
KEYS = job, events, lease, cancel, webhooks, running, unpublished, queue_depth, all_index,
creation_seq, retired; ARGV[1..8] = prefixes (job, state index, batch, batch index,
idempotency, owner index), event stream maxlen, retention seconds; the script's own arguments
start at ARGV[9]. Errors are raised as `KILN_<CODE> <details>` (before any write, so a refused
call changes nothing) and translated in storage/boundary.py.
"""

from __future__ import annotations

PRELUDE = r"""
local K_JOB, K_EVENTS, K_LEASE, K_CANCEL, K_HOOKS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local K_RUNNING, K_UNPUBLISHED, K_DEPTH, K_ALL, K_SEQ = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local K_RETIRED = KEYS[11]
local P_JOB, P_STATE, P_BATCH, P_BATCH_IDX = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local P_IDEM, P_OWNER, MAXLEN, RETENTION = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
local A = 9
local TERMINAL = {succeeded = true, failed = true, canceled = true, expired = true}

local function raise(code, detail) error({err = 'KILN_' .. code .. ' ' .. detail}) end

local function clock()
  local t = redis.call('TIME')
  return string.format('%d.%06d', t[1], t[2]), tonumber(t[1]) * 1000 + math.floor(t[2] / 1000)
end

-- the fields every state change needs, read once
local function load(id)
  local v = redis.call('HMGET', K_JOB, 'state', 'lease_token', 'batch_id', 'created_seq',
    'idempotency_key', 'lease_owner', 'owner')
  if not v[1] then raise('NOTFOUND', id) end
  return {id = id, state = v[1], token = v[2] or '0', batch = v[3] or '', cseq = v[4],
    idem = v[5] or '', owner = v[6] or '', job_owner = v[7] or ''}
end

local function append_event_at(kjob, kevents, etype, time, payload)
  local seq = redis.call('HINCRBY', kjob, 'seq', 1)
  redis.call('XADD', kevents, 'MAXLEN', MAXLEN, seq .. '-0',
    'type', etype, 'time', time, 'payload', payload)
  return seq
end

local function append_event(etype, time, payload)
  return append_event_at(K_JOB, K_EVENTS, etype, time, payload)
end

local function check_fence(job, mode, token)
  if mode == 'token' then
    if job.token == '0' or job.token ~= token then raise('STALE', job.id .. ' ' .. token) end
  elseif mode == 'not_running' and job.state == 'running' then
    raise('STALE', job.id .. ' none')
  end
end

local function move_batch(job, target)
  if job.batch == '' then return end
  local b = P_BATCH .. job.batch
  redis.call('HINCRBY', b, 'n_' .. job.state, -1)
  redis.call('HINCRBY', b, 'n_' .. target, 1)
  if not TERMINAL[target] then return end
  local c = redis.call('HMGET', b, 'total', 'n_succeeded', 'n_failed', 'n_canceled', 'n_expired')
  local done = 0
  for i = 2, 5 do done = done + tonumber(c[i] or '0') end
  if done >= tonumber(c[1] or '0') then
    redis.call('EXPIRE', b, RETENTION)
    redis.call('EXPIRE', P_BATCH_IDX .. job.batch, RETENTION)
  end
end

local function move_counters(job, target)
  redis.call('ZREM', P_STATE .. job.state, job.id)
  redis.call('ZADD', P_STATE .. target, job.cseq, job.id)
  if job.state == 'queued' then redis.call('DECR', K_DEPTH) end
  if target == 'queued' then redis.call('INCR', K_DEPTH) end
  move_batch(job, target)
end

-- after this, only retention keeps the record: no lease, no flag, out of live indexes; its
-- index entries are listed in K_RETIRED for removal once the record has expired
local function finish(job, time, target)
  redis.call('HSET', K_JOB, 'finished_at', time, 'lease_token', '0')
  redis.call('DEL', K_LEASE, K_CANCEL)
  redis.call('ZREM', K_RUNNING, job.id)
  redis.call('ZREM', K_UNPUBLISHED, job.id)
  redis.call('EXPIRE', K_JOB, RETENTION)
  redis.call('EXPIRE', K_EVENTS, RETENTION)
  redis.call('EXPIRE', K_HOOKS, RETENTION)
  if job.idem ~= '' then redis.call('EXPIRE', P_IDEM .. job.idem, RETENTION) end
  redis.call('ZADD', K_RETIRED, math.floor(tonumber(time)) + tonumber(RETENTION),
    cjson.encode({job.id, job.job_owner, job.batch, target}))
end

local function enter_running(job, time, now_ms, payload)
  local attempts = redis.call('HINCRBY', K_JOB, 'attempts', 1)
  redis.call('HSET', K_JOB, 'started_at', time)
  local ttl = redis.call('PTTL', K_LEASE)
  redis.call('ZADD', K_RUNNING, now_ms + math.max(ttl, 0), job.id)
  redis.call('ZREM', K_UNPUBLISHED, job.id)
  local event = cjson.decode(payload)
  event.attempts, event.owner = attempts, job.owner
  return cjson.encode(event)
end

-- back in the queue: unfenced, and the sweeper re-publishes it unless the caller confirms
local function enter_queued(job, time)
  redis.call('HSET', K_JOB, 'lease_token', '0', 'published', '0', 'progress', 'null')
  redis.call('DEL', K_LEASE)
  redis.call('ZREM', K_RUNNING, job.id)
  redis.call('ZADD', K_UNPUBLISHED, time, job.id)
end

-- the one place a state changes; `fields` is a flat list of field/value pairs
local function transition(job, target, payload, fields)
  local time, now_ms = clock()
  if #fields > 0 then redis.call('HSET', K_JOB, unpack(fields)) end
  redis.call('HSET', K_JOB, 'state', target)
  if target == 'running' then payload = enter_running(job, time, now_ms, payload)
  elseif target == 'queued' then enter_queued(job, time)
  elseif TERMINAL[target] then finish(job, time, target) end
  move_counters(job, target)
  append_event(target, time, payload)
end
"""

TRANSITION = r"""
-- ARGV[A..]: job_id, sources (' a b '), target, fence mode, token, payload, honor_cancel, fields
local job = load(ARGV[A])
local target, payload = ARGV[A + 2], ARGV[A + 5]
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. target) end
check_fence(job, ARGV[A + 3], ARGV[A + 4])
if not string.find(ARGV[A + 1], ' ' .. job.state .. ' ', 1, true) then
  raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. target)
end
local fields = {}
-- a pending cancel wins over a retry: the job would only be stopped again
if ARGV[A + 6] == '1' and redis.call('EXISTS', K_CANCEL) == 1 then
  target, payload = 'canceled', cjson.encode({reason = 'cancel_requested'})
else
  for i = A + 7, #ARGV do fields[#fields + 1] = ARGV[i] end
end
transition(job, target, payload, fields)
return redis.call('HGETALL', K_JOB)
"""

CANCEL = r"""
-- ARGV[A]: job_id. queued: canceled now; running: flag for the worker; terminal: nothing
local job = load(ARGV[A])
if job.state == 'queued' then
  transition(job, 'canceled', cjson.encode({reason = 'requested'}), {})
elseif job.state == 'running' then
  redis.call('SET', K_CANCEL, '1', 'EX', RETENTION)
end
return redis.call('HGETALL', K_JOB)
"""

REAP = r"""
-- ARGV[A]: job_id. running with no live lease -> queued (canceled if a cancel is pending)
local state = redis.call('HGET', K_JOB, 'state')
if state ~= 'running' then
  redis.call('ZREM', K_RUNNING, ARGV[A])
  return 0
end
if redis.call('EXISTS', K_LEASE) == 1 then return 0 end
local job = load(ARGV[A])
if redis.call('EXISTS', K_CANCEL) == 1 then
  transition(job, 'canceled', cjson.encode({reason = 'cancel_requested'}), {})
else
  transition(job, 'queued', cjson.encode({reason = 'lease_expired'}), {})
end
return 1
"""

PROGRESS = r"""
-- ARGV[A..]: job_id, token, progress json
local job = load(ARGV[A])
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress') end
check_fence(job, 'token', ARGV[A + 1])
if job.state ~= 'running' then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' progress') end
redis.call('HSET', K_JOB, 'progress', ARGV[A + 2])
return append_event('progress', (clock()), ARGV[A + 2])
"""
