-- prelude: prepended to every script by storage/scripts.py, before the script's includes.
-- Helpers used by several scripts; it reads no KEYS and no ARGV: a helper takes the keys it
-- touches as parameters. Before it, storage/scripts.py puts the state names, made from
-- kiln/common/states.py: `S.<job state>`, `B.<batch status>` (either raises for a name that is
-- none) and `TERMINAL[<job state>]`; no script writes a state's name itself.

-- errors reach Python as `KILN_<CODE> <detail>` (storage/boundary.py); every script raises
-- before its first write, so a refused call changes nothing (an error undoes no write: Redis
-- keeps what a script wrote before it failed)
local function raise(code, detail) error({err = 'KILN_' .. code .. ' ' .. detail}) end

-- a script's reply: storage/scripts.py runs each script's own text as
-- `reply_of(pcall(script_body))`.
-- Whatever the body raised leaves as an error reply, the one form every Redis version passes on
-- unchanged: 6.2 cannot return an error raised as a table ("attempt to concatenate local 'err'
-- (a table value)") and wraps a string in "Error running script ...". Under pcall, 6.2 hands a
-- raised table over as is and 7.x as its `err` string; an error of redis.call is a string that
-- starts with its code (WRONGTYPE, OOM), except where 6.2 refused the call itself: then it says
-- where first ('@user_script: 9: -OOM ...').
local function reply_of(ok, result)
  if ok then return result end
  local message = type(result) == 'table' and result.err or tostring(result)
  -- (%p for the colons: a colon in a string literal would read as a key name, see keys.py)
  message = string.match(message, '^@[%w_]+%p %d+%p %-(.*)$') or message
  -- a Lua runtime error ('user_script:3: attempt to ...') carries no code: Redis's generic one
  if not string.find(message, '^%u[%u_]* ') then message = 'ERR ' .. message end
  return redis.error_reply(message)
end

-- the Redis clock: seconds as '<s>.<us>' (as records and events store it), and milliseconds
local function clock()
  local t = redis.call('TIME')
  return string.format('%d.%06d', t[1], t[2]), tonumber(t[1]) * 1000 + math.floor(t[2] / 1000)
end

-- the fields of a job record that state changes need, read once; KILN_NOTFOUND without a record
local function load_job(job_key, id)
  local v = redis.call('HMGET', job_key, 'state', 'lease_token', 'batch_id', 'created_seq',
    'idempotency_key', 'lease_owner', 'owner', 'queue')
  if not v[1] then raise('NOTFOUND', id) end
  return {id = id, state = v[1], token = v[2] or '0', batch = v[3] or '', cseq = v[4],
    idem = v[5] or '', owner = v[6] or '', job_owner = v[7] or '', queue = v[8] or ''}
end

-- lease fencing: 'token' needs the job's current token, 'not_running' refuses a running job,
-- 'none' checks nothing
local function check_fence(job, mode, token)
  if mode == 'token' then
    if job.token == '0' or job.token ~= token then raise('STALE', job.id .. ' ' .. token) end
  elseif mode == 'not_running' and job.state == S.running then
    raise('STALE', job.id .. ' none')
  end
end

-- a lease is taken only where no other owner holds a live one (acquire, hold);
-- the same owner may take it again. Raises LEASEHELD naming the holder.
local function check_lease_free(job, lease_key, owner)
  local held = redis.call('GET', lease_key)
  if held then
    local holder = string.sub(held, string.find(held, '|', 1, true) + 1)
    if holder ~= owner then raise('LEASEHELD', job.id .. ' ' .. holder) end
  end
end

-- whether the job's batch has been asked to stop (a job of it is neither held nor started)
local function batch_stopped(job, batch_prefix)
  return job.batch ~= '' and (redis.call('HGET', batch_prefix .. job.batch, 'stop') or '') ~= ''
end

-- per-owner counters (a hash: owner -> count): jobs without an owner are not counted, and an
-- owner whose count reaches 0 leaves the hash (records written before the counters existed can
-- only take a count down to 0, never below)
local function owner_count_add(hash_key, owner, n)
  if owner == '' or n == 0 then return end
  if redis.call('HINCRBY', hash_key, owner, n) <= 0 then redis.call('HDEL', hash_key, owner) end
end

local function owner_count(hash_key, owner)
  return tonumber(redis.call('HGET', hash_key, owner) or '0')
end

-- append an event under the record's next seq (entry id `<seq>-0`, no gaps); returns the seq
local function append_event(job_key, events_key, maxlen, etype, time, payload)
  local seq = redis.call('HINCRBY', job_key, 'seq', 1)
  redis.call('XADD', events_key, 'MAXLEN', maxlen, seq .. '-0',
    'type', etype, 'time', time, 'payload', payload)
  return seq
end
