-- preempt_request: ask a running job's node to suspend it at its next step boundary, so that the
-- waiting interactive job `for` can start (tasks/control/preemption.py chooses both). The ask is
-- the job's stop request (the one its cancel and pause use: _machine.lua), which its node's
-- cancel watch reads with the rest. The guard is checked here, in one step, so that control
-- processes deciding at once ask once: the job is running, no stop of it (a cancel, a pause, a
-- preemption) is pending, it was preempted fewer than `cap` times, and its run has lasted
-- `min run` since its latest start; no other preemption is claimed for the waiting job. Returns
-- 1 when asked (the request and the claim written), else 0 with nothing written. A cancel or a
-- pause asked later replaces the request (cancel.lua, pause.lua).
-- KEYS[1] = job record (hash) of the running job
-- KEYS[2] = its stop request (string: a cancel, a pause or a preemption)
-- KEYS[3] = the waiting job's preemption claim (string: the running job's id)
-- ARGV[1] = the running job's id
-- ARGV[2] = the stop request's value that asks for this preemption (it names the waiting job)
-- ARGV[3] = most preemptions of one job
-- ARGV[4] = least run (s) since its latest start
-- ARGV[5] = how long the request and the claim live (ms)
local job_key, stop_key, claim_key = KEYS[1], KEYS[2], KEYS[3]
local job_id, stop_value, cap, min_run_s, ttl_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]

local v = redis.call('HMGET', job_key, 'state', 'started_at', 'preemptions')
if v[1] ~= S.running then return 0 end
if tonumber(v[3] or '0') >= tonumber(cap) then return 0 end
local now = clock()
if tonumber(now) - tonumber(v[2] or now) < tonumber(min_run_s) then return 0 end
if redis.call('EXISTS', stop_key, claim_key) > 0 then return 0 end
redis.call('SET', stop_key, stop_value, 'PX', ttl_ms)
redis.call('SET', claim_key, job_id, 'PX', ttl_ms)
return 1
