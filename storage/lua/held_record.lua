-- held_record: a node's list of the job messages it holds (received, not yet finished), with
-- the deadline of its heartbeat; an empty list removes the node's entry.
-- Returns 1.
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms job_id job_id ...")
-- ARGV[1] = node id
-- ARGV[2] = ttl (ms)
-- ARGV[3..] = job ids
local held_key = KEYS[1]
local node_id, ttl_ms = ARGV[1], ARGV[2]
local job_ids = {unpack(ARGV, 3)}

if #job_ids == 0 then
  redis.call('HDEL', held_key, node_id)
  return 1
end
local _, now_ms = clock()
redis.call('HSET', held_key, node_id, (now_ms + tonumber(ttl_ms)) .. ' ' .. table.concat(job_ids, ' '))
return 1
