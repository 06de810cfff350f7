-- live_event: append a running job's `preview` or `output` event (fenced); returns its seq.
-- A `preview` replaces the job's previous one: that entry is deleted from the stream, so the
-- stream (and Redis) holds at most one preview per job, the newest (its seq in the record's
-- `preview_seq` field). Errors: NOTFOUND, ILLEGAL (not running), STALE (fence).
-- KEYS[1] = job record (hash)
-- KEYS[2] = job events (stream)
-- ARGV[1] = job id
-- ARGV[2] = lease token
-- ARGV[3] = event type: preview | output
-- ARGV[4] = payload (JSON)
-- ARGV[5] = events kept per job
local job_key, events_key = KEYS[1], KEYS[2]
local job_id, token, etype, payload, maxlen = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

if etype ~= 'preview' and etype ~= 'output' then raise('ILLEGAL', 'event type ' .. etype) end
local job = load_job(job_key, job_id)
if TERMINAL[job.state] then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. etype) end
check_fence(job, 'token', token)
if job.state ~= S.running then raise('ILLEGAL', job.id .. ' ' .. job.state .. ' ' .. etype) end
local seq = append_event(job_key, events_key, maxlen, etype, (clock()), payload)
if etype == 'preview' then
  local previous = redis.call('HGET', job_key, 'preview_seq')
  if previous then redis.call('XDEL', events_key, previous .. '-0') end
  redis.call('HSET', job_key, 'preview_seq', seq)
end
return seq
