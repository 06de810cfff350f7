-- batch_lease: take or keep the feeder lease of a batch. The owner holding it keeps its token and
-- re-arms the TTL; a free lease goes to the caller with a token larger than any issued before
-- (it fences off the previous feeder); a lease held by another owner is refused.
-- Returns the token, 0 if another owner holds it, -1 if the batch is gone or already finished.
-- KEYS[1] = batch record (hash)
-- KEYS[2] = feeder lease (string `<token>|<owner>`)
-- ARGV[1] = owner
-- ARGV[2] = lease ttl (ms)
local batch_key, lease_key = KEYS[1], KEYS[2]
local owner, ttl_ms = ARGV[1], ARGV[2]

local FINAL = {completed = true, canceled = true, expired = true, failed = true}
local status = redis.call('HGET', batch_key, 'status')
if not status or FINAL[status] then return -1 end
local held = redis.call('GET', lease_key)
if held then
  local bar = string.find(held, '|', 1, true)
  if string.sub(held, bar + 1) ~= owner then return 0 end
  redis.call('PEXPIRE', lease_key, ttl_ms)
  return tonumber(string.sub(held, 1, bar - 1))
end
local token = redis.call('HINCRBY', batch_key, 'fence', 1)
redis.call('SET', lease_key, token .. '|' .. owner, 'PX', ttl_ms)
return token
