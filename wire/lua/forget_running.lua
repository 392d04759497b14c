-- Deletes a dead daemon's running records of the jobs just recovered, each only if it is
-- still the entry that was read: one a later run of the same daemon id wrote since is kept.
--
-- KEYS[1]          running_key  the dead daemon's running hash (protocol.running_key)
-- ARGV[2i-1]       request_id   a recovered job's request id
-- ARGV[2i]         entry        the running entry read for it (protocol.running_entry)
local running_key = KEYS[1]
for i = 1, #ARGV, 2 do
  local request_id, entry = ARGV[i], ARGV[i + 1]
  if redis.call('HGET', running_key, request_id) == entry then
    redis.call('HDEL', running_key, request_id)
  end
end
return 0
