-- audit_claim: claim the queues due for an audit of their queued jobs (tasks/control/audit.py):
-- those no node claimed within the interval, and those no node claimed since the latest node
-- lapse was claimed (held_claim records it: the dead node may have lost a message it had popped).
-- A claimed queue's time is set to now, so of the nodes serving a queue one audits it per
-- interval, and once after each lapse.
-- Returns {latest lapse deadline (ms, 0 if none), claimed queues...}.
-- KEYS[1] = last audit claim per queue (hash: queue -> Redis time, ms)
-- KEYS[2] = last lapse (hash: claimed_ms, deadline_ms)
-- ARGV[1] = interval (ms)
-- ARGV[2..] = queues
local audits_key, lapse_key = KEYS[1], KEYS[2]
local interval_ms = tonumber(ARGV[1])
local queues = {unpack(ARGV, 2)}

local _, now_ms = clock()
local lapse = redis.call('HMGET', lapse_key, 'claimed_ms', 'deadline_ms')
local lapse_claimed = tonumber(lapse[1] or '0') or 0
local out = {tonumber(lapse[2] or '0') or 0}
for _, queue in ipairs(queues) do
  local last = tonumber(redis.call('HGET', audits_key, queue) or '0') or 0
  if now_ms - last >= interval_ms or last < lapse_claimed then
    redis.call('HSET', audits_key, queue, now_ms)
    out[#out + 1] = queue
  end
end
return out
