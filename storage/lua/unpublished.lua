-- unpublished: queued jobs whose publish has not been confirmed for longer than older_than_s;
-- entries of jobs that are no longer queued are dropped. Returns up to `limit` job ids.
-- KEYS[1] = unpublished jobs (zset: job id -> time, s)
-- ARGV[1] = older_than_s
-- ARGV[2] = limit
-- ARGV[3] = job record prefix: completed with the ids read from the set
local unpublished_key = KEYS[1]
local older_than_s, limit, job_prefix = ARGV[1], ARGV[2], ARGV[3]

local time = (clock())
local ids = redis.call('ZRANGEBYSCORE', unpublished_key, '-inf',
  tonumber(time) - tonumber(older_than_s), 'LIMIT', 0, limit)
local out = {}
for _, id in ipairs(ids) do
  if redis.call('HGET', job_prefix .. id, 'state') == S.queued then
    out[#out + 1] = id
  else
    redis.call('ZREM', unpublished_key, id)
  end
end
return out
