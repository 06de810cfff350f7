-- batch_finish: end a batch whose every item has its result line (fenced by the feeder lease):
-- its final status and summary part are written, it leaves the active batches, the lease is
-- dropped and the batch's keys expire after the retention.
-- Returns 1 if applied, 0 if the lease moved on or items are still open or unfed.
-- KEYS[1] = batch record (hash)
-- KEYS[2] = feeder lease (string `<token>|<owner>`)
-- KEYS[3] = open items (zset)
-- KEYS[4] = result parts (list of object keys)
-- KEYS[5] = active batches (zset)
-- KEYS[6] = finished counts (hash: monotonic counters of terminal transitions)
-- ARGV[1] = lease token
-- ARGV[2] = owner
-- ARGV[3] = batch id
-- ARGV[4] = final status: completed, canceled or expired
-- ARGV[5] = summary part (object key)
-- ARGV[6] = retention seconds
local batch_key, lease_key, open_key, parts_key, active_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4],
  KEYS[5]
local finished_key = KEYS[6]
local token, owner, batch_id, status, part, retention = ARGV[1], ARGV[2], ARGV[3], ARGV[4],
  ARGV[5], ARGV[6]

if redis.call('GET', lease_key) ~= token .. '|' .. owner then return 0 end
local v = redis.call('HMGET', batch_key, 'fed', 'items')
if redis.call('ZCARD', open_key) > 0 or tonumber(v[1]) < tonumber(v[2]) then return 0 end
redis.call('HSET', batch_key, 'status', status, 'finished_at', (clock()))
-- once per batch: the lease is dropped below, so a repeated finish returns 0 before this
redis.call('HINCRBY', finished_key, 'batch/' .. status, 1)
redis.call('RPUSH', parts_key, part)
redis.call('ZREM', active_key, batch_id)
redis.call('DEL', lease_key, open_key)
redis.call('EXPIRE', batch_key, retention)
redis.call('EXPIRE', parts_key, retention)
return 1
