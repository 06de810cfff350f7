-- batch_stop: ask a batch to stop feeding and wind down: canceled (by its owner) or expired (its
-- completion window ran out). A batch running, paused or finalizing without an earlier stop is
-- then finalizing until its feeder has ended the rest; asking again for the same stop changes
-- nothing. Anything else (a finished batch, or one already stopping for the other reason) is
-- refused and left as it is.
-- Returns {outcome, record as a flat HGETALL}: outcome 'ok', or what refused it: the status, or
-- `canceling` / `expiring` for a batch already stopping for the other reason; {} if there is no
-- batch.
-- KEYS[1] = batch record (hash)
-- ARGV[1] = reason: canceled or expired
local batch_key = KEYS[1]
local reason = ARGV[1]

local v = redis.call('HMGET', batch_key, 'status', 'stop')
if not v[1] then return {} end
local status, stop = v[1], v[2] or ''
local live = status == 'running' or status == 'paused' or status == 'finalizing'
if stop == reason then return {'ok', redis.call('HGETALL', batch_key)} end
if not live then return {status, redis.call('HGETALL', batch_key)} end
if stop == 'expired' then return {'expiring', redis.call('HGETALL', batch_key)} end
if stop ~= '' then return {'canceling', redis.call('HGETALL', batch_key)} end
redis.call('HSET', batch_key, 'stop', reason, 'stopped_at', (clock()), 'status', 'finalizing')
return {'ok', redis.call('HGETALL', batch_key)}
