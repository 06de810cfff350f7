-- batch_reported: the result lines of finished jobs are stored as one part (fenced by the feeder
-- lease): the jobs leave the open set and the part is listed.
-- Returns 1 if applied, 0 if the lease moved on (nothing written).
-- KEYS[1] = batch record (hash)
-- KEYS[2] = feeder lease (string `<token>|<owner>`)
-- KEYS[3] = open items (zset: job id -> line)
-- KEYS[4] = result parts (list of object keys)
-- ARGV[1] = lease token
-- ARGV[2] = owner
-- ARGV[3] = result part (object key)
-- ARGV[4..] = the jobs reported in it
local batch_key, lease_key, open_key, parts_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token, owner, part = ARGV[1], ARGV[2], ARGV[3]
local job_ids = {unpack(ARGV, 4)}

if redis.call('GET', lease_key) ~= token .. '|' .. owner then return 0 end
for i = 1, #job_ids, 1000 do
  redis.call('ZREM', open_key, unpack(job_ids, i, math.min(i + 999, #job_ids)))
end
redis.call('RPUSH', parts_key, part)
redis.call('HINCRBY', batch_key, 'reported', #job_ids)
return 1
