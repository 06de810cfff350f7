-- prune_indexes: remove the index entries of finished jobs whose record has expired. Each entry
-- of the retired set names a job's id, owner, batch and final state, from which the indexes it
-- sits in are found: their keys are completed here from the prefixes. Returns how many entries
-- were looked at (up to `limit`).
-- KEYS[1] = retired index entries (zset: JSON [id, owner, batch, state] -> record expiry, s)
-- KEYS[2] = index of every job (zset)
-- ARGV[1] = limit
-- ARGV[2] = job record prefix
-- ARGV[3] = state index prefix
-- ARGV[4] = owner index prefix
-- ARGV[5] = batch index prefix
local retired_key, all_key = KEYS[1], KEYS[2]
local limit, job_prefix, state_index_prefix = ARGV[1], ARGV[2], ARGV[3]
local owner_index_prefix, batch_index_prefix = ARGV[4], ARGV[5]

local time = tonumber((clock()))
local items = redis.call('ZRANGEBYSCORE', retired_key, '-inf', time, 'LIMIT', 0, limit)
for _, item in ipairs(items) do
  local id, owner, batch, state = unpack(cjson.decode(item))
  -- a record still there was created again under the same id: its entries are live
  if redis.call('EXISTS', job_prefix .. id) == 0 then
    redis.call('ZREM', all_key, id)
    redis.call('ZREM', state_index_prefix .. state, id)
    if owner ~= '' then redis.call('ZREM', owner_index_prefix .. owner, id) end
    if batch ~= '' then redis.call('ZREM', batch_index_prefix .. batch, id) end
  end
  redis.call('ZREM', retired_key, item)
end
return #items
