-- checkpoint: record a step checkpoint of a running job whose lease the caller holds (fenced).
-- The record's `checkpoints` field is a JSON list, newest first, of at most ARGV[4] entries; the
-- new entry goes first and the oldest beyond that fall off. A stale token records nothing.
-- The entry gets `written_at`, the Redis clock ('<s>.<us>', as records keep time). Returns JSON
-- {written_at, dropped}: that time and the object keys of the entries that fell off. An entry
-- whose key the record names already is not added again: its time, nothing dropped.
-- Errors: NOTFOUND, STALE (fence), ILLEGAL (not running).
-- KEYS[1] = job record (hash)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = the checkpoint's entry (JSON object with `key`, without `written_at`)
-- ARGV[4] = entries kept
local job_key = KEYS[1]
local job_id, token, entry, kept = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])

local job = load_job(job_key, job_id)
check_fence(job, 'token', token)
if job.state ~= S.running then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' checkpoint') end
local entries = cjson.decode(redis.call('HGET', job_key, 'checkpoints') or '[]')
local new = cjson.decode(entry)
for _, old in ipairs(entries) do
  -- recorded already (a retried write whose answer was lost): named once, nothing dropped
  if old.key == new.key then return cjson.encode({written_at = old.written_at, dropped = {}}) end
end
new.written_at = (clock())
table.insert(entries, 1, new)
local dropped = {}
while #entries > kept do table.insert(dropped, table.remove(entries).key) end
redis.call('HSET', job_key, 'checkpoints', cjson.encode(entries))
return cjson.encode({written_at = new.written_at, dropped = dropped})
