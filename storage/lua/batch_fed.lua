-- batch_fed: move a batch's cursor past lines the feeder has handled (fenced by its lease): the
-- jobs it created (or found) join the open set; lines ended without a job are counted under the
-- reason they ended, on the batch and in the finished counters (`line/<reason>`, as a line whose
-- job ended is counted), and their result part is listed. Refused unless the cursor is still
-- where the feeder read it. Once the cursor reaches the last item a running batch is finalizing.
-- Feeding (mode `feed`) is also refused once the batch has been asked to stop (canceled or
-- expired) since the feeder read it: the jobs it made are then never published, and the wind-down
-- finds and ends them as lines fed before a crash (mode `end` is the wind-down's own write).
-- Returns 1 if applied, 0 if the lease or the cursor moved on, 2 if feeding was refused because
-- the batch is stopping (nothing written either way).
-- KEYS[1] = batch record (hash)
-- KEYS[2] = feeder lease (string `<token>|<owner>`)
-- KEYS[3] = open items (zset: job id -> line)
-- KEYS[4] = result parts (list of object keys)
-- KEYS[5] = finished counts (hash: monotonic counters of terminal transitions)
-- ARGV[1] = lease token
-- ARGV[2] = owner
-- ARGV[3] = cursor as read (items handled before)
-- ARGV[4] = new cursor
-- ARGV[5] = new byte offset of the next item in the input
-- ARGV[6] = lines ended without a job
-- ARGV[7] = the reason they ended (canceled or expired; '' when none)
-- ARGV[8] = result part of those lines ('' when none)
-- ARGV[9] = mode: feed (new jobs) or end (lines ended by a stop)
-- ARGV[10..] = open items: line, job id, line, job id, ...
local batch_key, lease_key, open_key, parts_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local finished_key = KEYS[5]
local token, owner, cursor, new_cursor, offset = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local ended, reason, part, mode = ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local open = {unpack(ARGV, 10)}

if redis.call('GET', lease_key) ~= token .. '|' .. owner then return 0 end
if redis.call('HGET', batch_key, 'fed') ~= cursor then return 0 end
if mode == 'feed' and (redis.call('HGET', batch_key, 'stop') or '') ~= '' then return 2 end
for i = 1, #open, 1000 do
  redis.call('ZADD', open_key, unpack(open, i, math.min(i + 999, #open)))
end
redis.call('HSET', batch_key, 'fed', new_cursor, 'offset', offset)
if #open > 0 and not redis.call('HGET', batch_key, 'started_at') then
  redis.call('HSET', batch_key, 'started_at', (clock()))
end
if tonumber(ended) > 0 then
  redis.call('HINCRBY', batch_key, 'u_' .. reason, ended)
  -- once: the cursor moved past these lines in this same step, so no write counts them again
  redis.call('HINCRBY', finished_key, 'line/' .. reason, ended)
end
if part ~= '' then
  redis.call('RPUSH', parts_key, part)
  redis.call('HINCRBY', batch_key, 'reported', ended)
end
local items = tonumber(redis.call('HGET', batch_key, 'items') or '0')
if tonumber(new_cursor) >= items and redis.call('HGET', batch_key, 'status') == B.running then
  redis.call('HSET', batch_key, 'status', B.finalizing)
end
return 1
