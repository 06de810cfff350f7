-- dead_letter_claim: mark a dead letter as redriven to a new job, once. Returns 1 if claimed now;
-- 0 if there is no such dead letter (dropped, expired) or it was redriven already (its job named).
-- KEYS[1] = the dead-letter record (hash)
-- ARGV[1] = the new job's id
-- ARGV[2] = when (s, as records store times)
local record_key = KEYS[1]
local new_id, at = ARGV[1], ARGV[2]

if redis.call('EXISTS', record_key) == 0 then return 0 end
if redis.call('HEXISTS', record_key, 'redriven_to') == 1 then return 0 end
redis.call('HSET', record_key, 'redriven_to', new_id, 'redriven_at', at)
return 1
