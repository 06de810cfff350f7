-- held: a node's entry in the held deliveries hash (node id -> its value), shared by held_record
-- and held_claim. The value is "<deadline_ms>/<written_ms>/<incarnation> <job id> ...": the
-- heartbeat deadline, the time of the write and the writing process's token, then the job ids.
-- An entry written before the times and token existed ("<deadline_ms> <job id> ...") reads with
-- written = deadline and an empty token.

-- {deadline (ms, nil if unreadable), written (ms), incarnation, job ids}
local function held_entry(value)
  local words = {}
  for word in string.gmatch(value, '%S+') do words[#words + 1] = word end
  local head = words[1] or ''
  local deadline, written, incarnation = string.match(head, '^(%d+)/(%d+)/(%S*)$')
  if deadline == nil then
    deadline, written, incarnation = head, head, ''
  end
  return {deadline = tonumber(deadline), written = tonumber(written) or 0,
    incarnation = incarnation, jobs = {unpack(words, 2)}}
end
