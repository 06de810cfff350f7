"""Lua sources that work on namespace-wide keys (reaper query, sweeper query, nodes, batches)."""

from __future__ import annotations

CLOCK = r"""
local function clock()
  local t = redis.call('TIME')
  return string.format('%d.%06d', t[1], t[2]), tonumber(t[1]) * 1000 + math.floor(t[2] / 1000)
end
"""

LEASE_DEADLINES_PASSED = (
    CLOCK
    + r"""
-- KEYS[1]: running set. Jobs whose lease deadline (ms) has passed, by the Redis clock.
local _, now_ms = clock()
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, ARGV[1])
"""
)

UNPUBLISHED = (
    CLOCK
    + r"""
-- KEYS[1]: unpublished set. ARGV: job key prefix, older_than_s, limit.
-- Queued jobs unconfirmed for longer than older_than_s; drops entries that are no longer queued.
local time = (clock())
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', tonumber(time) - tonumber(ARGV[2]),
  'LIMIT', 0, ARGV[3])
local out = {}
for _, id in ipairs(ids) do
  if redis.call('HGET', ARGV[1] .. id, 'state') == 'queued' then
    out[#out + 1] = id
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
"""
)

PUBLISH_NODE = (
    CLOCK
    + r"""
-- KEYS: node key, nodes set. ARGV: node_id, info json, ttl_ms.
local _, now_ms = clock()
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
return 1
"""
)

LIVE_NODES = (
    CLOCK
    + r"""
-- KEYS[1]: nodes set. ARGV[1]: node key prefix. Heartbeats still alive.
local _, now_ms = clock()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
local out = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local info = redis.call('GET', ARGV[1] .. id)
  if info then out[#out + 1] = info end
end
return out
"""
)

CREATE_BATCH = (
    CLOCK
    + r"""
-- KEYS[1]: batch hash. ARGV: total, metadata json, state names... Creates it unless it exists.
if redis.call('EXISTS', KEYS[1]) == 0 then
  redis.call('HSET', KEYS[1], 'total', ARGV[1], 'created_at', (clock()), 'metadata', ARGV[2])
  for i = 3, #ARGV do redis.call('HSET', KEYS[1], 'n_' .. ARGV[i], 0) end
end
return redis.call('HGETALL', KEYS[1])
"""
)

PRUNE_INDEXES = (
    CLOCK
    + r"""
-- KEYS: retired set, all index. ARGV: job prefix, state index prefix, owner index prefix,
-- batch index prefix, limit. Removes the index entries of finished jobs whose record expired.
local time = tonumber((clock()))
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', time, 'LIMIT', 0, ARGV[5])
for _, item in ipairs(items) do
  local id, owner, batch, state = unpack(cjson.decode(item))
  -- a record still there was created again under the same id: its entries are live
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('ZREM', KEYS[2], id)
    redis.call('ZREM', ARGV[2] .. state, id)
    if owner ~= '' then redis.call('ZREM', ARGV[3] .. owner, id) end
    if batch ~= '' then redis.call('ZREM', ARGV[4] .. batch, id) end
  end
  redis.call('ZREM', KEYS[1], item)
end
return #items
"""
)
