-- create_batch: create the batch record with a zero counter per state, unless it exists.
-- Returns the record as a flat HGETALL (the existing one unchanged).
-- KEYS[1] = batch record (hash)
-- ARGV[1] = total
-- ARGV[2] = metadata (JSON)
-- ARGV[3..] = the state names: one counter `n_<state>` each
local batch_key = KEYS[1]
local total, metadata = ARGV[1], ARGV[2]
local states = {unpack(ARGV, 3)}

if redis.call('EXISTS', batch_key) == 0 then
  redis.call('HSET', batch_key, 'total', total, 'created_at', (clock()), 'metadata', metadata)
  for _, state in ipairs(states) do redis.call('HSET', batch_key, 'n_' .. state, 0) end
end
return redis.call('HGETALL', batch_key)
