-- audit_claim: claim the queues due for an audit of their queued jobs (tasks/node/audit.py):
-- those no node claimed within the interval. A claimed queue's time is set to now, so of the
-- nodes serving a queue one audits it per interval. Returns the claimed queues.
-- KEYS[1] = last audit claim per queue (hash: queue -> Redis time, ms)
-- ARGV[1] = interval (ms)
-- ARGV[2..] = queues
local audits_key = KEYS[1]
local interval_ms = tonumber(ARGV[1])
local queues = {unpack(ARGV, 2)}

local _, now_ms = clock()
local claimed = {}
for _, queue in ipairs(queues) do
  local last = tonumber(redis.call('HGET', audits_key, queue) or '0') or 0
  if now_ms - last >= interval_ms then
    redis.call('HSET', audits_key, queue, now_ms)
    claimed[#claimed + 1] = queue
  end
end
return claimed
