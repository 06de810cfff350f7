-- held_claim: take the held lists of nodes whose heartbeat deadline passed (they died holding
-- messages that only the visibility timeout would bring back). Each list is returned once: the
-- entries are removed here, so two sweepers never both get one. The lapsed entries are found in
-- the deadline index: every node's sweeper calls this, and reading every node's entry on each
-- call would cost the cluster the square of its node count.
-- Returns {live, lapsed...}: `live` lists the job ids that live nodes hold (left empty when no
-- node lapsed: only a lapse needs it); each lapsed entry follows as
-- {node id, written_ms, deadline_ms, job ids...}: it died between its last write and deadline
-- (an unreadable entry is dropped as lapsed, with 0 for both times).
-- A claimed lapse is recorded in the last-lapse hash (when it was claimed, and the latest deadline
-- of a lapsed node): audit_claim makes every queue's audit due after it, since a node killed
-- with a message popped but not yet recorded by kombu lost it (tasks/control/audit.py).
-- include: _held
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms/written_ms/incarnation job_id ...")
-- KEYS[2] = last lapse (hash: claimed_ms, deadline_ms)
-- KEYS[3] = held deadlines (zset: each entry of KEYS[1] -> its deadline, ms; held_record)
local held_key, lapse_key, deadlines_key = KEYS[1], KEYS[2], KEYS[3]

local _, now_ms = clock()
-- entries the index lacks (written before it existed, or by hand) are indexed once, in full
if redis.call('HLEN', held_key) > redis.call('ZCARD', deadlines_key) then
  local flat = redis.call('HGETALL', held_key)
  for i = 1, #flat, 2 do
    redis.call('ZADD', deadlines_key, held_entry(flat[i + 1]).deadline or 0, flat[i])
  end
end
local out = {{}}
for _, node_id in ipairs(redis.call('ZRANGEBYSCORE', deadlines_key, '-inf', now_ms)) do
  redis.call('ZREM', deadlines_key, node_id)
  local value = redis.call('HGET', held_key, node_id)
  if value then
    local entry = held_entry(value)
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
  -- only a lapse reads every live entry (what live nodes hold)
  for _, value in ipairs(redis.call('HVALS', held_key)) do
    for _, job_id in ipairs(held_entry(value).jobs) do out[1][#out[1] + 1] = job_id end
  end
end
return out
