-- batch_stop: ask a batch to stop feeding and wind down: canceled (by its owner) or expired (its
-- completion window ran out). Only a batch still running or finalizing without an earlier stop is
-- changed; it is then finalizing until its feeder has ended the rest.
-- Returns the record as a flat HGETALL (empty if there is no batch).
-- KEYS[1] = batch record (hash)
-- ARGV[1] = reason: canceled or expired
local batch_key = KEYS[1]
local reason = ARGV[1]

local v = redis.call('HMGET', batch_key, 'status', 'stop')
if not v[1] then return {} end
if (v[1] == 'running' or v[1] == 'finalizing') and (v[2] or '') == '' then
  redis.call('HSET', batch_key, 'stop', reason, 'stopped_at', (clock()), 'status', 'finalizing')
end
return redis.call('HGETALL', batch_key)
