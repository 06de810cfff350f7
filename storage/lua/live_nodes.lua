-- live_nodes: the heartbeats still alive; lapsed entries leave the nodes set.
-- Returns the info (JSON) of each live node.
-- KEYS[1] = nodes (zset: node id -> heartbeat deadline, ms)
-- ARGV[1] = node heartbeat prefix: completed with the ids read from the set
local nodes_key = KEYS[1]
local node_prefix = ARGV[1]

local _, now_ms = clock()
redis.call('ZREMRANGEBYSCORE', nodes_key, '-inf', now_ms)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', nodes_key, 0, -1)) do
  local info = redis.call('GET', node_prefix .. id)
  if info then out[#out + 1] = info end
end
return out
