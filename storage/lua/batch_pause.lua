-- batch_pause: pause or resume feeding a batch. Pause: running -> paused (its queued and running
-- jobs go on; nothing new is fed). Resume: paused -> running. Asking for the status the batch is
-- in already changes nothing; any other status (finalizing, finished) is refused as it is.
-- Returns {outcome, record as a flat HGETALL}: outcome 'ok', or the status that refused; {} if
-- there is no batch.
-- KEYS[1] = batch record (hash)
-- ARGV[1] = action: pause or resume
local batch_key = KEYS[1]
local action = ARGV[1]

local status = redis.call('HGET', batch_key, 'status')
if not status then return {} end
local from, to = B.running, B.paused
if action == 'resume' then from, to = B.paused, B.running end
if status == to then return {'ok', redis.call('HGETALL', batch_key)} end
if status ~= from then return {status, redis.call('HGETALL', batch_key)} end
redis.call('HSET', batch_key, 'status', to)
return {'ok', redis.call('HGETALL', batch_key)}
