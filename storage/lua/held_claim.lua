-- held_claim: take the held lists of nodes whose heartbeat deadline passed (they died holding
-- messages that only the visibility timeout would bring back). Each list is returned once: the
-- entries are removed here, so two sweepers never both get one.
-- Returns {live, lapsed...}: `live` lists the job ids that live nodes hold (left empty when no
-- node lapsed: only a lapse needs it); each lapsed entry follows as
-- {node id, written_ms, deadline_ms, job ids...}: it died between its last write and deadline
-- (an unreadable entry is dropped as lapsed, with 0 for both times).
-- A claimed lapse is recorded in the last-lapse hash (when it was claimed, and the latest deadline
-- of a lapsed node): audit_claim makes every queue's audit due after it, since a node killed
-- with a message popped but not yet recorded by kombu lost it (tasks/node/audit.py).
-- include: _held
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms/written_ms/incarnation job_id ...")
-- KEYS[2] = last lapse (hash: claimed_ms, deadline_ms)
local held_key, lapse_key = KEYS[1], KEYS[2]

local _, now_ms = clock()
local flat = redis.call('HGETALL', held_key)
local out = {{}}
local live = {}
for i = 1, #flat, 2 do
  local node_id, entry = flat[i], held_entry(flat[i + 1])
  if entry.deadline ~= nil and entry.deadline > now_ms then
    live[#live + 1] = entry
  else
    local lapsed = {node_id, tostring(entry.written), tostring(entry.deadline or 0)}
    for _, job_id in ipairs(entry.jobs) do lapsed[#lapsed + 1] = job_id end
    out[#out + 1] = lapsed
    redis.call('HDEL', held_key, node_id)
  end
end
if #out > 1 then
  local deadline = tonumber(redis.call('HGET', lapse_key, 'deadline_ms') or '0') or 0
  for i = 2, #out do deadline = math.max(deadline, tonumber(out[i][3]) or 0) end
  redis.call('HSET', lapse_key, 'claimed_ms', now_ms, 'deadline_ms', deadline)
  for _, entry in ipairs(live) do
    for _, job_id in ipairs(entry.jobs) do out[1][#out[1] + 1] = job_id end
  end
end
return out
