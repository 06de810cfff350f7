-- machine: the writes of one state change, included by transition, cancel and reap.
-- Every function takes `m`, the keys and settings of one job, which each of those scripts builds
-- from its KEYS and ARGV:
--   m.job, m.events, m.lease, m.cancel, m.hooks: the job's record, events, lease, stop request
--     (STOP_CANCEL, STOP_PAUSE or a preemption: what the running job's node stops it for) and
--     webhook attempts;
--   m.running, m.unpublished, m.depth, m.retired: the namespace's running set, unpublished set,
--     queue depth counter and retired set;
--   m.seq, m.owner_queued, m.owner_running: the creation sequence (a job entering `queued` draws
--     its queue index score from it) and the per-owner counts of queued and running jobs;
--   m.finished: the monotonic counters of terminal transitions (keys.finished_counts);
--   m.state_index_prefix, m.batch_prefix, m.batch_index_prefix, m.idem_prefix,
--     m.queue_index_prefix, m.completions_prefix, m.usage_prefix: prefixes from storage/keys.py,
--     completed here with the state, batch id, idempotency key, queue read from the record and
--     the hour of an attempt's end: the caller does not know them before the script runs, so it
--     cannot name the keys;
--   m.maxlen: events kept per job; m.retention: seconds a finished job's keys are kept;
--   m.window: seconds of finished runs a queue's completion window keeps.

-- finished runs kept per queue's completion window, at most (the rate needs no more)
local COMPLETIONS_KEPT = 1000

-- a running job's stop request (m.cancel), one per job, as its node reads it (storage/leases.py
-- `stops_requested`): a cancel ('1', as it always was), a pause, or a priority preemption
-- ('preempt' and the waiting job's id: preempt_request.lua writes it, preempted.lua ends the run
-- it stops). A cancel replaces a pause or a preemption, a pause replaces a preemption, never the
-- reverse; it lives as long as the run it asks to stop (a preemption's until its claim lapses)
local STOP_CANCEL, STOP_PAUSE = '1', 'pause'

-- what a pending stop request turns the end of a run into (a retry, a drain's hand-back, a
-- lapsed lease, a preemption's requeue): canceled or paused, with its event's payload; nil when
-- none is pending or the request is a preemption (the run went back to the queue anyway)
local function requested_end(m)
  local flag = redis.call('GET', m.cancel)
  if flag == STOP_CANCEL then return S.canceled, cjson.encode({reason = 'cancel_requested'}) end
  if flag == STOP_PAUSE then return S.paused, cjson.encode({reason = 'pause_requested'}) end
  return nil, nil
end

local function move_batch(m, job, target)
  if job.batch == '' then return end
  local b = m.batch_prefix .. job.batch
  redis.call('HINCRBY', b, 'n_' .. job.state, -1)
  redis.call('HINCRBY', b, 'n_' .. target, 1)
  if not TERMINAL[target] then return end
  local c = redis.call('HMGET', b, 'total', 'n_succeeded', 'n_failed', 'n_canceled', 'n_expired')
  local done = 0
  for i = 2, 5 do done = done + tonumber(c[i] or '0') end
  if done >= tonumber(c[1] or '0') then
    redis.call('EXPIRE', b, m.retention)
    redis.call('EXPIRE', m.batch_index_prefix .. job.batch, m.retention)
  end
end

-- the job's queue index: left when it leaves `queued`, entered (at the back) when it returns
local function move_queue_entry(m, job, target)
  if job.queue == '' then return end
  local index = m.queue_index_prefix .. job.queue
  if job.state == S.queued then redis.call('ZREM', index, job.id) end
  if target == S.queued then redis.call('ZADD', index, redis.call('INCR', m.seq), job.id) end
end

local function move_counters(m, job, target)
  redis.call('ZREM', m.state_index_prefix .. job.state, job.id)
  redis.call('ZADD', m.state_index_prefix .. target, job.cseq, job.id)
  if job.state == S.queued then
    redis.call('DECR', m.depth)
    owner_count_add(m.owner_queued, job.job_owner, -1)
  end
  if target == S.queued then
    redis.call('INCR', m.depth)
    owner_count_add(m.owner_queued, job.job_owner, 1)
  end
  if job.state == S.running then owner_count_add(m.owner_running, job.job_owner, -1) end
  if target == S.running then owner_count_add(m.owner_running, job.job_owner, 1) end
  move_queue_entry(m, job, target)
  move_batch(m, job, target)
end

-- a run ended for good: note it in its queue's completion window (the queue's recent rate)
local function record_completion(m, job, now_ms)
  if job.queue == '' then return end
  local key = m.completions_prefix .. job.queue
  local started = tonumber(redis.call('HGET', m.job, 'started_at') or '0') or 0
  local window_ms = tonumber(m.window) * 1000
  redis.call('ZADD', key, now_ms, job.id .. '@' .. math.floor(started * 1000))
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now_ms - window_ms)
  redis.call('ZREMRANGEBYRANK', key, 0, -(COMPLETIONS_KEPT + 1))
  redis.call('PEXPIRE', key, window_ms)
end

-- after this, only retention keeps the record: no lease, no flag, out of live indexes; its
-- index entries are listed in m.retired for removal once the record has expired
local function finish(m, job, time, now_ms, target)
  if job.state == S.running then record_completion(m, job, now_ms) end
  -- counted here, in the step that ends the job: a terminal state never changes again, so each
  -- job adds 1 once, and the counts outlive the records (metrics sum them after retention)
  redis.call('HINCRBY', m.finished, 'job/' .. job.queue .. '/' .. target, 1)
  if job.batch ~= '' then redis.call('HINCRBY', m.finished, 'line/' .. target, 1) end
  redis.call('HSET', m.job, 'finished_at', time, 'lease_token', '0')
  redis.call('DEL', m.lease, m.cancel)
  redis.call('ZREM', m.running, job.id)
  redis.call('ZREM', m.unpublished, job.id)
  redis.call('EXPIRE', m.job, m.retention)
  redis.call('EXPIRE', m.events, m.retention)
  redis.call('EXPIRE', m.hooks, m.retention)
  if job.idem ~= '' then redis.call('EXPIRE', m.idem_prefix .. job.idem, m.retention) end
  redis.call('ZADD', m.retired, math.floor(tonumber(time)) + tonumber(m.retention),
    cjson.encode({job.id, job.job_owner, job.batch, target}))
end

-- Step accounting (docs/contract.md §5b). Each attempt's log entry gets its steps as it closes
-- (`account_attempt`), and the record's `accounting` field their sums over the job's attempts:
-- this file is its one writer. A node that ends its attempt itself reports what it ran in the
-- record's `attempt_steps` field, written with its end (kiln/common/accounting.py AttemptSteps);
-- an attempt closed without it (a lapsed lease: its node died) is read from the record: its
-- progress (`denoised`, progress.lua) or its own newest checkpoint, whichever is larger.
local ACCOUNTED = {'steps_computed', 'steps_restored', 'steps_recomputed', 'seconds_lost'}

-- of a transition's flat field/value list, the node's `attempt_steps` pair only
local function attempt_steps_only(fields)
  for i = 1, #fields - 1, 2 do
    if fields[i] == 'attempt_steps' then return {fields[i], fields[i + 1]} end
  end
  return {}
end

-- a JSON field of the record; nil when absent or damaged (accounting never fails a job's end)
local function json_field(m, name)
  local ok, value = pcall(cjson.decode, redis.call('HGET', m.job, name) or 'null')
  if not ok or type(value) ~= 'table' then return nil end
  return value
end

-- the newest recorded checkpoint's step, among those written at or after `since` (a time)
local function newest_checkpoint(m, since)
  local newest = 0
  for _, c in ipairs(json_field(m, 'checkpoints') or {}) do
    local done = tonumber(c.steps_done) or 0
    if (tonumber(c.written_at) or 0) >= since and done > newest then newest = done end
  end
  return newest
end

local function account_attempt(m, job, log)
  local entry = log[#log]
  local since = tonumber(entry.started_at) or 0
  local reported = json_field(m, 'attempt_steps')
  redis.call('HDEL', m.job, 'attempt_steps')
  local denoised = tonumber(redis.call('HGET', m.job, 'denoised') or '0') or 0
  local reached = math.max(denoised, newest_checkpoint(m, since))
  local restored, step_s = tonumber(entry.steps_restored) or 0, 0
  if reported then
    restored = tonumber(reported.restored) or restored
    reached = math.max(reached, tonumber(reported.reached) or 0)
    step_s = tonumber(reported.step_s) or 0
  end
  reached = math.max(reached, restored)  -- a run holds the step it restored
  local at = tonumber(redis.call('HGET', m.job, 'denoised_at') or '')
  if step_s <= 0 and at and denoised > restored then step_s = (at - since) / (denoised - restored) end
  local frontier = 0  -- the furthest step any earlier attempt ran
  for i = 1, #log - 1 do frontier = math.max(frontier, tonumber(log[i].steps_reached) or 0) end
  local recomputed = math.max(0, math.min(reached, frontier) - restored)
  local figures = {steps_computed = reached - restored, steps_restored = restored,
    steps_recomputed = recomputed, seconds_lost = math.floor(recomputed * step_s * 1000 + 0.5) / 1000}
  entry.steps_reached, entry.step_s = reached, math.floor(step_s * 1e6 + 0.5) / 1e6
  local total = json_field(m, 'accounting') or {}
  for _, name in ipairs(ACCOUNTED) do
    entry[name] = figures[name]
    total[name] = (tonumber(total[name]) or 0) + figures[name]
    if figures[name] > 0 then  -- deployment-wide counters (storage/counters.py)
      redis.call('HINCRBYFLOAT', m.finished, 'steps/' .. job.queue .. '/' .. name, figures[name])
    end
  end
  total.seconds_lost = math.floor(total.seconds_lost * 1000 + 0.5) / 1000
  redis.call('HSET', m.job, 'accounting', cjson.encode(total))
end

-- The ledger (docs/contract.md §5c, kiln/common/ledger.py): the node's own figures for the
-- attempt ride in its reported steps (`attempt_steps`, key `usage`: its pipeline, GPU-seconds,
-- joules, seconds loading, computing, encoding, uploading); the attempt's log entry gets its
-- GPU-seconds and joules, and the record's `ledger` field their sums over the job's attempts with
-- the seconds per phase, queued_s included (from the job's creation, or the end of the attempt
-- before, to the attempt's start). This file is its one writer. The attempt's GPU-seconds, joules
-- and count are added to the hour's usage bucket (storage/usage.py: `<ns>:usage:<hour start>`,
-- fields `<owner key id or ->/<pipeline>/<figure>`, kept USAGE_RETENTION_S after its last write)
-- and its GPU-seconds to the deployment's counters (`gpu/<pipeline>/<owner>`). An attempt closed
-- without a report (its node died) adds its queued time only: what it used is unknown.
local LEDGER_PHASES = {'loading_s', 'computing_s', 'encoding_s', 'uploading_s'}
local USAGE_BUCKET_S, USAGE_RETENTION_S = 3600, 93 * 24 * 3600  -- kiln/common/ledger.py

local function rounded(x) return math.floor(x * 1e6 + 0.5) / 1e6 end

local function account_usage(m, job, log, time)
  local entry = log[#log]
  local reported = json_field(m, 'attempt_steps')
  local usage = reported and type(reported.usage) == 'table' and reported.usage or nil
  local ledger = json_field(m, 'ledger') or {}
  local since = tonumber(redis.call('HGET', m.job, 'created_at') or '0') or 0
  if #log > 1 then since = tonumber(log[#log - 1].ended_at) or since end
  local queued = math.max(0, (tonumber(entry.started_at) or since) - since)
  ledger.queued_s = rounded((tonumber(ledger.queued_s) or 0) + queued)
  for _, name in ipairs(LEDGER_PHASES) do
    local add = usage and math.max(0, tonumber(usage[name]) or 0) or 0
    ledger[name] = rounded((tonumber(ledger[name]) or 0) + add)
  end
  local gpu_s = usage and math.max(0, tonumber(usage.gpu_s) or 0) or 0
  local energy = usage and tonumber(usage.energy_j) or nil
  ledger.gpu_s = rounded((tonumber(ledger.gpu_s) or 0) + gpu_s)
  if energy ~= nil then ledger.energy_j = rounded((tonumber(ledger.energy_j) or 0) + energy) end
  if ledger.energy_j == nil then ledger.energy_j = cjson.null end
  entry.gpu_s, entry.energy_j = rounded(gpu_s), energy or cjson.null
  redis.call('HSET', m.job, 'ledger', cjson.encode(ledger))
  if usage == nil or type(usage.pipeline) ~= 'string' then return end
  local owner = job.job_owner ~= '' and job.job_owner or '-'
  local hour = math.floor(tonumber(time) / USAGE_BUCKET_S) * USAGE_BUCKET_S
  local bucket = m.usage_prefix .. string.format('%d', hour)
  local prefix = owner .. '/' .. usage.pipeline .. '/'
  redis.call('HINCRBYFLOAT', bucket, prefix .. 'gpu_s', gpu_s)
  redis.call('HINCRBY', bucket, prefix .. 'attempts', 1)
  if energy ~= nil then redis.call('HINCRBYFLOAT', bucket, prefix .. 'energy_j', energy) end
  redis.call('EXPIRE', bucket, USAGE_RETENTION_S)
  if gpu_s > 0 then
    redis.call('HINCRBYFLOAT', m.finished, 'gpu/' .. usage.pipeline .. '/' .. owner, gpu_s)
  end
end

-- a field of the record spliced into an event's payload (a JSON object as written)
local function splice_field(payload, name, value)
  local body = string.match(payload, '^%s*{(.*)}%s*$')
  if body == nil then return payload end
  if string.find(body, '%S') then body = body .. ',' end
  return '{' .. body .. string.sub(cjson.encode({[name] = value}), 2, -2) .. '}'
end

-- the event of a transition that closes an attempt or ends the job carries the job's accounting
-- and ledger so far (none for a job that never ran: its figures are zeros)
local function with_accounting(m, job, target, payload)
  if not (TERMINAL[target] or (job.state == S.running and target ~= S.running)) then
    return payload
  end
  local total = json_field(m, 'accounting')
  if total ~= nil then payload = splice_field(payload, 'accounting', total) end
  local ledger = json_field(m, 'ledger')
  if ledger ~= nil then payload = splice_field(payload, 'ledger', ledger) end
  return payload
end

-- the record's `attempt_log` (JSON list): one entry per run, opened as the job enters running
-- (its number, node, start) and closed as it leaves (end, the state it went to, the error or the
-- reason, and its steps: `account_attempt`); a dead letter copies it (_dead_letters.lua), so
-- every attempt of a failed job is kept. An attempt opens with `steps_restored` the newest
-- checkpoint recorded (what its node is offered and resumes from), which its node's own report
-- replaces as it ends; its progress so far (`denoised`) starts over.
local function open_attempt(m, attempts, time, event)
  local log = cjson.decode(redis.call('HGET', m.job, 'attempt_log') or '[]')
  log[#log + 1] = {attempt = attempts, node = event.node_id or '', started_at = time,
    steps_restored = newest_checkpoint(m, 0)}
  redis.call('HSET', m.job, 'attempt_log', cjson.encode(log))
  redis.call('HDEL', m.job, 'denoised', 'denoised_at', 'attempt_steps')
end

local function close_attempt(m, job, time, target, payload)
  local text = redis.call('HGET', m.job, 'attempt_log')
  if not text then return end  -- a run started before the log existed
  local log = cjson.decode(text)
  local last = log[#log]
  if last == nil or last.ended_at ~= nil then return end
  last.ended_at, last.outcome = time, target
  if target ~= S.succeeded then  -- a success's payload (its outputs) is not read for an error
    local event = cjson.decode(payload)
    last.error = event.error or (event.reason and {type = event.reason}) or nil
  end
  account_usage(m, job, log, time)  -- before account_attempt takes the reported steps away
  account_attempt(m, job, log)
  redis.call('HSET', m.job, 'attempt_log', cjson.encode(log))
end

local function enter_running(m, job, time, now_ms, payload)
  local attempts = redis.call('HINCRBY', m.job, 'attempts', 1)
  -- what the job did before its start (waiting in a node: hold.lua) is over
  redis.call('HSET', m.job, 'started_at', time, 'progress', 'null')
  local ttl = redis.call('PTTL', m.lease)
  redis.call('ZADD', m.running, now_ms + math.max(ttl, 0), job.id)
  redis.call('ZREM', m.unpublished, job.id)
  local event = cjson.decode(payload)
  open_attempt(m, attempts, time, event)
  event.attempts, event.owner = attempts, job.owner
  return cjson.encode(event)
end

-- back in the queue: unfenced, and the sweeper re-publishes it unless the caller confirms. Its
-- stop request ends with the run it asked to stop: a cancel or a pause took the run elsewhere
-- (requested_end), so what is left is a preemption, which must not stop the job's next run
local function enter_queued(m, job, time)
  redis.call('HSET', m.job, 'lease_token', '0', 'published', '0', 'progress', 'null')
  redis.call('DEL', m.lease, m.cancel)
  redis.call('ZREM', m.running, job.id)
  redis.call('ZADD', m.unpublished, time, job.id)
end

-- paused: no lease, no GPU, no place in line, no message to publish; its step checkpoints stay
-- (storage/checkpoints.py), and `paused_at` starts its KILN_PAUSED_RETENTION_S. A run a pause
-- stopped is not counted (attempts - 1: its next start counts the same number again; its entry
-- in the attempt log stays, its outcome `paused`), so pausing never uses up a job's attempts
local function enter_paused(m, job, time)
  if job.state == S.running then redis.call('HINCRBY', m.job, 'attempts', -1) end
  redis.call('HSET', m.job, 'lease_token', '0', 'published', '0', 'progress', 'null',
    'paused_at', time)
  redis.call('DEL', m.lease, m.cancel)
  redis.call('ZREM', m.running, job.id)
  redis.call('ZREM', m.unpublished, job.id)
end

-- the one place a state changes; `fields` is a flat list of field/value pairs; the event's type
-- is the target state unless `event_type` names another (a resume's `resumed`: queued again)
local function transition(m, job, target, payload, fields, event_type)
  local time, now_ms = clock()
  if #fields > 0 then redis.call('HSET', m.job, unpack(fields)) end
  redis.call('HSET', m.job, 'state', target)
  if job.state == S.running and target ~= S.running then
    close_attempt(m, job, time, target, payload)
  end
  payload = with_accounting(m, job, target, payload)
  if target == S.running then payload = enter_running(m, job, time, now_ms, payload)
  elseif target == S.queued then enter_queued(m, job, time)
  elseif target == S.paused then enter_paused(m, job, time)
  elseif TERMINAL[target] then finish(m, job, time, now_ms, target) end
  move_counters(m, job, target)
  append_event(m.job, m.events, m.maxlen, event_type or target, time, payload)
  return time
end

-- a running job whose lease is gone goes back to queued (to canceled or paused when a cancel or
-- a pause is pending); a job no longer running leaves the running set. 1 if it moved, else 0
-- (reap.lua for one job, reap_lapsed.lua for every lapsed one)
local function reap_job(m, job_id)
  if redis.call('HGET', m.job, 'state') ~= S.running then
    redis.call('ZREM', m.running, job_id)
    return 0
  end
  if redis.call('EXISTS', m.lease) == 1 then return 0 end
  local job = load_job(m.job, job_id)
  local requested, payload = requested_end(m)
  if requested then
    transition(m, job, requested, payload, {})
  else
    transition(m, job, S.queued, cjson.encode({reason = 'lease_expired'}), {})
  end
  return 1
end
