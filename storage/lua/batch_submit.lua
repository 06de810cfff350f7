-- batch_submit: create a fed batch's record (status running, cursor at the start, a zero counter
-- per job state, `total` = its valid items) and list it among the active batches, in the index of
-- every batch and in its owner's; an existing record is left as it is. Its invalid lines (refused
-- at submit, each with its result line already) are counted as finished lines, `line/invalid`,
-- in the step that creates it. A retry (a parent record
-- given) is appended to its parent's `retries` in the same step, and is refused while a retry of
-- the same lines (one of its statuses) has not ended: the parent's `retry_<status>` field names
-- the retry that took those lines last. A retry's idempotency key is bound on the parent (field
-- `retry_key_<key>` = `<retry id>|<statuses>`): the same key finds that retry again.
-- Returns {'ok', the record as a flat HGETALL}, {'free'} when only checking and nothing refuses,
-- {'bound', retry id, its statuses} for a bound key, or {'retrying', retry id} (nothing written).
-- KEYS[1] = batch record (hash)
-- KEYS[2] = active batches (zset)
-- KEYS[3] = index of every batch (zset)
-- KEYS[4] = owner's batch index (zset; '' without an owner)
-- KEYS[5] = batch sequence (counter)
-- KEYS[6] = result parts (list of object keys)
-- KEYS[7] = the parent batch's record ('' unless this batch retries another)
-- KEYS[8] = finished counts (hash: monotonic counters of terminal transitions)
-- ARGV[1] = batch id
-- ARGV[2] = the record's own fields: a JSON object of strings (items, lines, input_key, ...)
-- ARGV[3] = completion window (s): the batch expires this long after its creation
-- ARGV[4] = result part of the invalid lines, listed first ('' when none)
-- ARGV[5] = a retry's statuses: the parent's lines it runs again, space separated ('' if none)
-- ARGV[6] = a retry's idempotency key ('' when none)
-- ARGV[7] = batch record prefix: the retries named on the parent are ids read here
-- ARGV[8] = '1' to check a retry only (nothing written), '' to create
-- ARGV[9..] = the job state names: one counter `n_<state>` each
local batch_key, active_key, all_key, owner_key, seq_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5]
local parts_key, parent_key, finished_key = KEYS[6], KEYS[7], KEYS[8]
local batch_id, fields, window_s, invalid_part = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local retried, idem, batch_prefix, check_only = ARGV[5], ARGV[6], ARGV[7], ARGV[8] == '1'
local states = {unpack(ARGV, 9)}

local FINAL = {completed = true, canceled = true, expired = true, failed = true}

-- a retry is refused while another one of the same lines has not ended (or its key is bound)
if parent_key ~= '' and retried ~= '' then
  if idem ~= '' then
    local bound = redis.call('HGET', parent_key, 'retry_key_' .. idem)
    if bound then
      local bar = string.find(bound, '|', 1, true)
      return {'bound', string.sub(bound, 1, bar - 1), string.sub(bound, bar + 1)}
    end
  end
  for status in string.gmatch(retried, '%S+') do
    local other = redis.call('HGET', parent_key, 'retry_' .. status)
    if other and other ~= batch_id then
      local other_status = redis.call('HGET', batch_prefix .. other, 'status')
      if other_status and not FINAL[other_status] then return {'retrying', other} end
    end
  end
  if check_only then return {'free'} end
end

if redis.call('EXISTS', batch_key) == 1 then return {'ok', redis.call('HGETALL', batch_key)} end
local time = (clock())
local seq = redis.call('INCR', seq_key)
local deadline = string.format('%.6f', tonumber(time) + tonumber(window_s))
redis.call('HSET', batch_key, 'created_at', time, 'seq', seq, 'status', B.running, 'fed', 0,
  'offset', 0, 'deadline', deadline, 'window_s', window_s, 'fence', 0)
local record = cjson.decode(fields)
for name, value in pairs(record) do redis.call('HSET', batch_key, name, value) end
local invalid = tonumber(record.invalid or '0')
if invalid > 0 then redis.call('HINCRBY', finished_key, 'line/invalid', invalid) end
for _, state in ipairs(states) do redis.call('HSET', batch_key, 'n_' .. state, 0) end
redis.call('ZADD', active_key, seq, batch_id)
redis.call('ZADD', all_key, seq, batch_id)
if owner_key ~= '' then redis.call('ZADD', owner_key, seq, batch_id) end
if invalid_part ~= '' then redis.call('RPUSH', parts_key, invalid_part) end
if parent_key ~= '' and redis.call('EXISTS', parent_key) == 1 then
  local retries = redis.call('HGET', parent_key, 'retries') or ''
  if retries ~= '' then retries = retries .. ',' end
  redis.call('HSET', parent_key, 'retries', retries .. batch_id)
  for status in string.gmatch(retried, '%S+') do
    redis.call('HSET', parent_key, 'retry_' .. status, batch_id)
  end
  if idem ~= '' then
    redis.call('HSET', parent_key, 'retry_key_' .. idem, batch_id .. '|' .. retried)
  end
end
return {'ok', redis.call('HGETALL', batch_key)}
