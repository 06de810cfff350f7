-- batch_submit: create a fed batch's record (status running, cursor at the start, a zero counter
-- per job state, `total` = its valid items) and list it among the active batches, in the index of
-- every batch and in its owner's; an existing record is left as it is. A retry (a parent record
-- given) is appended to its parent's `retries` in the same step.
-- Returns the record as a flat HGETALL.
-- KEYS[1] = batch record (hash)
-- KEYS[2] = active batches (zset)
-- KEYS[3] = index of every batch (zset)
-- KEYS[4] = owner's batch index (zset; '' without an owner)
-- KEYS[5] = batch sequence (counter)
-- KEYS[6] = result parts (list of object keys)
-- KEYS[7] = the parent batch's record ('' unless this batch retries another)
-- ARGV[1] = batch id
-- ARGV[2] = the record's own fields: a JSON object of strings (items, lines, input_key, ...)
-- ARGV[3] = completion window (s): the batch expires this long after its creation
-- ARGV[4] = result part of the invalid lines, listed first ('' when none)
-- ARGV[5..] = the job state names: one counter `n_<state>` each
local batch_key, active_key, all_key, owner_key, seq_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5]
local parts_key, parent_key = KEYS[6], KEYS[7]
local batch_id, fields, window_s, invalid_part = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local states = {unpack(ARGV, 5)}

if redis.call('EXISTS', batch_key) == 1 then return redis.call('HGETALL', batch_key) end
local time = (clock())
local seq = redis.call('INCR', seq_key)
local deadline = string.format('%.6f', tonumber(time) + tonumber(window_s))
redis.call('HSET', batch_key, 'created_at', time, 'seq', seq, 'status', 'running', 'fed', 0,
  'offset', 0, 'deadline', deadline, 'window_s', window_s, 'fence', 0)
for name, value in pairs(cjson.decode(fields)) do redis.call('HSET', batch_key, name, value) end
for _, state in ipairs(states) do redis.call('HSET', batch_key, 'n_' .. state, 0) end
redis.call('ZADD', active_key, seq, batch_id)
redis.call('ZADD', all_key, seq, batch_id)
if owner_key ~= '' then redis.call('ZADD', owner_key, seq, batch_id) end
if invalid_part ~= '' then redis.call('RPUSH', parts_key, invalid_part) end
if parent_key ~= '' and redis.call('EXISTS', parent_key) == 1 then
  local retries = redis.call('HGET', parent_key, 'retries') or ''
  if retries ~= '' then retries = retries .. ',' end
  redis.call('HSET', parent_key, 'retries', retries .. batch_id)
end
return redis.call('HGETALL', batch_key)
