-- publish_node: write a node's heartbeat with its TTL and its deadline in the nodes set.
-- Returns 1.
-- KEYS[1] = node heartbeat (string, JSON)
-- KEYS[2] = nodes (zset: node id -> heartbeat deadline, ms)
-- ARGV[1] = node id
-- ARGV[2] = info (JSON)
-- ARGV[3] = ttl (ms)
local node_key, nodes_key = KEYS[1], KEYS[2]
local node_id, info, ttl_ms = ARGV[1], ARGV[2], ARGV[3]

local _, now_ms = clock()
redis.call('SET', node_key, info, 'PX', ttl_ms)
redis.call('ZADD', nodes_key, now_ms + tonumber(ttl_ms), node_id)
return 1
