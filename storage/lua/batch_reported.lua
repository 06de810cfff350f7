-- batch_reported: the result lines of finished jobs are stored as one part (fenced by the feeder
-- lease): the jobs leave the open set and the part is listed. The results file is now their
-- durable record, so each finished job's record, events and webhook attempts expire after the
-- short `retention` instead of the store's, and its retired entry (the index entries to prune)
-- falls due then too: Redis holds a batch's window, not every line it ever ran.
-- Returns 1 if applied, 0 if the lease moved on (nothing written).
-- KEYS[1] = batch record (hash)
-- KEYS[2] = feeder lease (string `<token>|<owner>`)
-- KEYS[3] = open items (zset: job id -> line)
-- KEYS[4] = result parts (list of object keys)
-- KEYS[5] = retired index entries (zset: JSON [id, owner, batch, state] -> record expiry, s)
-- KEYS[6..] = per job reported, in ARGV's order: its record, events and webhook attempts
-- ARGV[1] = lease token
-- ARGV[2] = owner
-- ARGV[3] = result part (object key)
-- ARGV[4] = seconds a reported job's keys are kept
-- ARGV[5..] = the jobs reported in it
local batch_key, lease_key, open_key, parts_key, retired_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5]
local job_keys = {unpack(KEYS, 6)}
local token, owner, part, retention = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local job_ids = {unpack(ARGV, 5)}

if redis.call('GET', lease_key) ~= token .. '|' .. owner then return 0 end
for i = 1, #job_ids, 1000 do
  redis.call('ZREM', open_key, unpack(job_ids, i, math.min(i + 999, #job_ids)))
end
redis.call('RPUSH', parts_key, part)
redis.call('HINCRBY', batch_key, 'reported', #job_ids)
local due = math.floor(tonumber((clock()))) + retention
for i, job_id in ipairs(job_ids) do
  local record = job_keys[3 * i - 2]
  local v = redis.call('HMGET', record, 'state', 'owner', 'batch_id')
  if v[1] and TERMINAL[v[1]] then
    for k = 3 * i - 2, 3 * i do redis.call('EXPIRE', job_keys[k], retention) end
    redis.call('ZADD', retired_key, 'XX', due, cjson.encode({job_id, v[2] or '', v[3] or '', v[1]}))
  end
end
return 1
