"""Lua sources for leases and other per-job writes; same calling convention as storage/lua.py."""

from __future__ import annotations

ACQUIRE = r"""
-- ARGV[A..]: job_id, owner, ttl_ms. Returns the new fencing token.
local job = load(ARGV[A])
local owner, ttl = ARGV[A + 1], ARGV[A + 2]
local held = redis.call('GET', K_LEASE)
if held then
  local holder = string.sub(held, string.find(held, '|', 1, true) + 1)
  if holder ~= owner then raise('LEASEHELD', job.id .. ' ' .. holder) end
end
local token = redis.call('HINCRBY', K_JOB, 'fence', 1)
redis.call('HSET', K_JOB, 'lease_token', token, 'lease_owner', owner)
redis.call('SET', K_LEASE, token .. '|' .. owner, 'PX', ttl)
if job.state == 'running' then
  local _, now_ms = clock()
  redis.call('ZADD', K_RUNNING, now_ms + ttl, job.id)
end
return token
"""

RENEW = r"""
-- ARGV[A..]: job_id, token, ttl_ms. 1 if the token is still current (lease re-armed), else 0.
local v = redis.call('HMGET', K_JOB, 'lease_token', 'lease_owner', 'state')
if not v[1] or v[1] == '0' or v[1] ~= ARGV[A + 1] then return 0 end
redis.call('SET', K_LEASE, v[1] .. '|' .. v[2], 'PX', ARGV[A + 2])
if v[3] == 'running' then
  local _, now_ms = clock()
  redis.call('ZADD', K_RUNNING, now_ms + ARGV[A + 2], ARGV[A])
end
return 1
"""

RELEASE = r"""
-- ARGV[A..]: job_id, token. A running job released without a transition is reaped at once.
local v = redis.call('HMGET', K_JOB, 'lease_token', 'state')
if not v[1] or v[1] == '0' or v[1] ~= ARGV[A + 1] then return 0 end
redis.call('HSET', K_JOB, 'lease_token', '0')
redis.call('DEL', K_LEASE)
if v[2] == 'running' then redis.call('ZADD', K_RUNNING, 0, ARGV[A]) end
return 1
"""

MARK_PUBLISHED = r"""
-- ARGV[A]: job_id
local job = load(ARGV[A])
redis.call('HSET', K_JOB, 'published', '1')
redis.call('ZREM', K_UNPUBLISHED, job.id)
return 1
"""

WEBHOOK_ATTEMPT = r"""
-- ARGV[A..]: job_id, attempt json, cap. The log lives as long as the record.
load(ARGV[A])
redis.call('RPUSH', K_HOOKS, ARGV[A + 1])
redis.call('LTRIM', K_HOOKS, -tonumber(ARGV[A + 2]), -1)
local ttl = redis.call('PTTL', K_JOB)
if ttl > 0 then redis.call('PEXPIRE', K_HOOKS, ttl) end
return 1
"""
