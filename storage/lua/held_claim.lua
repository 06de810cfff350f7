-- held_claim: take the held lists of nodes whose heartbeat deadline passed (they died holding
-- messages that only the visibility timeout would bring back). Each list is returned once: the
-- entries are removed here, so two sweepers never both get one.
-- Returns the job ids (flat, possibly repeated).
-- KEYS[1] = held deliveries (hash: node id -> "deadline_ms job_id job_id ...")
local held_key = KEYS[1]

local _, now_ms = clock()
local flat = redis.call('HGETALL', held_key)
local out = {}
for i = 1, #flat, 2 do
  local node_id, value = flat[i], flat[i + 1]
  local deadline = nil
  for word in string.gmatch(value, '%S+') do
    if deadline == nil then
      deadline = tonumber(word)
      if deadline == nil or deadline > now_ms then break end
    else
      out[#out + 1] = word
    end
  end
  if deadline == nil or deadline <= now_ms then redis.call('HDEL', held_key, node_id) end
end
return out
