-- batch_stop: ask a batch to stop feeding and wind down: canceled (by its owner), expired (its
-- completion window ran out) or failed (its input could not be read). A batch running, paused or
-- finalizing without an earlier stop is then finalizing until its feeder has ended the rest;
-- asking again for the same stop changes nothing, and a cancel overrides a failure (the owner
-- wants the open jobs stopped). Anything else (a finished batch, or one already stopping for
-- another reason) is refused and left as it is. A reason given (`error`) is kept on a live batch
-- whichever stop stands: the batch's view shows why it could not go on.
-- Returns {outcome, record as a flat HGETALL}: outcome 'ok', or what refused it: the status, or
-- `canceling` / `expiring` / `failing` for a batch already stopping for another reason; {} if
-- there is no batch.
-- KEYS[1] = batch record (hash)
-- ARGV[1] = reason: canceled, expired or failed
-- ARGV[2] = why the batch cannot go on, for its view ('' for none)
local batch_key = KEYS[1]
local reason, error_text = ARGV[1], ARGV[2]

local STOPPING = {canceled = 'canceling', expired = 'expiring', failed = 'failing'}
local v = redis.call('HMGET', batch_key, 'status', 'stop')
if not v[1] then return {} end
local status, stop = v[1], v[2] or ''
local live = status == B.running or status == B.paused or status == B.finalizing
if live and error_text ~= '' then redis.call('HSET', batch_key, 'error', error_text) end
if stop == reason then return {'ok', redis.call('HGETALL', batch_key)} end
if not live then return {status, redis.call('HGETALL', batch_key)} end
local overrides = stop == B.failed and reason == B.canceled
if stop ~= '' and not overrides then
  return {STOPPING[stop] or stop, redis.call('HGETALL', batch_key)}
end
redis.call('HSET', batch_key, 'stop', reason, 'stopped_at', (clock()), 'status', B.finalizing)
return {'ok', redis.call('HGETALL', batch_key)}
