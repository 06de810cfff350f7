-- dead letters: a job that ends `failed` is copied, in the step that fails it, into the
-- dead-letter set with what an operator needs to judge and redrive it (storage/dead_letters.py
-- reads it). `d` holds the keys and settings, built by the including script from its KEYS/ARGV:
--   d.index: the set's index (zset: job id, scored by a number drawn from the creation sequence,
--     so paging newest first has no ties); d.record: this job's dead-letter hash;
--   d.record_prefix, d.owner_prefix: prefixes from storage/keys.py, completed with ids read from
--     the index and owners read from records (the cap drops entries the caller cannot name);
--   d.retention: seconds a dead letter is kept; d.cap: most dead letters kept (oldest dropped).

-- the job record's fields a dead letter copies as they are (JSON where the record holds JSON)
local DEAD_FIELDS = {'request', 'lane', 'owner', 'metadata', 'batch_id', 'queue', 'created_at',
  'started_at', 'finished_at', 'attempts', 'error', 'metrics', 'attempt_log'}

-- drop the oldest dead letters beyond the cap, their owner index entries with them
local function trim_dead_letters(d)
  local over = redis.call('ZCARD', d.index) - tonumber(d.cap)
  if over <= 0 then return end
  for _, id in ipairs(redis.call('ZRANGE', d.index, 0, over - 1)) do
    local owner = redis.call('HGET', d.record_prefix .. id, 'owner')
    if owner and owner ~= '' then redis.call('ZREM', d.owner_prefix .. owner, id) end
    redis.call('DEL', d.record_prefix .. id)
  end
  redis.call('ZREMRANGEBYRANK', d.index, 0, over - 1)
end

-- the job's last checkpoint as JSON: the newest entry of its record's `checkpoints` (newest
-- first: checkpoint.lua), or null; a record that does not parse gives null, never an error (the
-- job must fail all the same)
local function last_checkpoint(job_key)
  local text = redis.call('HGET', job_key, 'checkpoints')
  if not text then return 'null' end
  local ok, entries = pcall(cjson.decode, text)
  if not ok or type(entries) ~= 'table' or type(entries[1]) ~= 'table' then return 'null' end
  return cjson.encode(entries[1])
end

-- record the failed job `job` (load_job's table) read from `job_key`; `seq` is the creation
-- sequence counter. A job fails once (terminal), and a record already there is kept: never twice.
local function bury(d, job_key, seq, job, time)
  if redis.call('EXISTS', d.record) == 1 then return end
  local values = redis.call('HMGET', job_key, unpack(DEAD_FIELDS))
  local flat = {'id', job.id, 'dead_at', time, 'checkpoint', last_checkpoint(job_key)}
  for i, name in ipairs(DEAD_FIELDS) do
    if values[i] then flat[#flat + 1], flat[#flat + 2] = name, values[i] end
  end
  redis.call('HSET', d.record, unpack(flat))
  redis.call('EXPIRE', d.record, d.retention)
  local score = redis.call('INCR', seq)
  redis.call('ZADD', d.index, score, job.id)
  if job.job_owner ~= '' then
    local owned = d.owner_prefix .. job.job_owner
    redis.call('ZADD', owned, score, job.id)
    redis.call('EXPIRE', owned, d.retention)
  end
  trim_dead_letters(d)
end
