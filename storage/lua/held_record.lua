-- held_record: a node's list of the job messages it holds (received, not yet finished), with
-- its heartbeat deadline, the time of this write and the writing process's token. The entry
-- stays while the list is empty: a node killed before it lists a message must still be seen to
-- lapse (held_claim). An entry another process wrote under the same node id (a node restarted
-- with a fixed --node-id) is kept aside under `<node id>~<its token>`, for held_claim to take
-- once it lapses: the restarted node must not erase what its previous life held.
-- Each entry's deadline is indexed too (KEYS[2]): held_claim reads the lapsed entries only.
-- Returns 1.
-- include: _held
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms/written_ms/incarnation job_id ...")
-- KEYS[2] = held deadlines (zset: each entry of KEYS[1] -> its deadline, ms)
-- ARGV[1] = node id
-- ARGV[2] = ttl (ms)
-- ARGV[3] = incarnation (a token of the writing process)
-- ARGV[4..] = job ids
local held_key, deadlines_key = KEYS[1], KEYS[2]
local node_id, ttl_ms, incarnation = ARGV[1], ARGV[2], ARGV[3]
local job_ids = {unpack(ARGV, 4)}

local previous = redis.call('HGET', held_key, node_id)
if previous then
  local entry = held_entry(previous)
  if entry.incarnation ~= incarnation then
    local aside = node_id .. '~' .. (entry.incarnation ~= '' and entry.incarnation or entry.written)
    redis.call('HSET', held_key, aside, previous)
    redis.call('ZADD', deadlines_key, entry.deadline or 0, aside)
  end
end
local _, now_ms = clock()
local value = (now_ms + tonumber(ttl_ms)) .. '/' .. now_ms .. '/' .. incarnation
if #job_ids > 0 then value = value .. ' ' .. table.concat(job_ids, ' ') end
redis.call('HSET', held_key, node_id, value)
redis.call('ZADD', deadlines_key, now_ms + tonumber(ttl_ms), node_id)
return 1
