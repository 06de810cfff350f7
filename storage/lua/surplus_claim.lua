-- surplus_claim: an idle node asks whether it is surplus, and if so marks itself draining, in one
-- step: of several idle nodes asking at once, only as many as are surplus are told so.
-- Surplus: for every pipeline it serves, the live nodes serving that pipeline that are not
-- draining (no drain request, no `draining` in their heartbeat) outnumber the desired count.
-- Returns 1 after writing its drain request (ARGV[3]), else 0 (nothing written).
-- KEYS[1] = nodes (zset: node id -> heartbeat deadline, ms)
-- KEYS[2] = drain requests (hash: node id -> request JSON)
-- ARGV[1] = node heartbeat prefix: completed with the ids read from KEYS[1]
-- ARGV[2] = the asking node's id
-- ARGV[3] = its drain request (JSON), written when it is surplus
-- ARGV[4..] = pipeline name then desired nodes, in pairs: the pipelines the asking node serves
local nodes_key, drains_key = KEYS[1], KEYS[2]
local node_prefix, asker, request = ARGV[1], ARGV[2], ARGV[3]
local pairs_flat = {unpack(ARGV, 4)}

if redis.call('HEXISTS', drains_key, asker) == 1 then return 0 end
local desired, staying = {}, {}
for i = 1, #pairs_flat, 2 do
  desired[pairs_flat[i]] = tonumber(pairs_flat[i + 1])
  staying[pairs_flat[i]] = 0
end
local _, now_ms = clock()
local counted_asker = false
for _, id in ipairs(redis.call('ZRANGEBYSCORE', nodes_key, now_ms, '+inf')) do
  local info = redis.call('GET', node_prefix .. id)
  if info and redis.call('HEXISTS', drains_key, id) == 0 then
    local node = cjson.decode(info)
    if node.draining ~= true then
      for _, pipeline in ipairs(node.pipelines or {}) do
        if staying[pipeline] then staying[pipeline] = staying[pipeline] + 1 end
      end
      if id == asker then counted_asker = true end
    end
  end
end
for pipeline, wanted in pairs(desired) do
  -- a node whose heartbeat is not (or no longer) listed still serves: it counts itself
  local live = staying[pipeline] + (counted_asker and 0 or 1)
  if live <= wanted then return 0 end
end
redis.call('HSET', drains_key, asker, request)
return 1
