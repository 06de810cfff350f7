-- held_jobs: the job ids of every entry in the held deliveries, live or lapsed and not claimed
-- yet (a lapsed node's jobs are the sweeper's to publish again). Reads only.
-- include: _held
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms/written_ms/incarnation job_id ...")
local held_key = KEYS[1]

local out = {}
for _, value in ipairs(redis.call('HVALS', held_key)) do
  for _, job_id in ipairs(held_entry(value).jobs) do out[#out + 1] = job_id end
end
return out
