-- After: queue_head.lua
-- Moves a daemon's routed set back into the shared one (a daemon that stops, or whose dead
-- entry is pruned). With leave "1", its fleet and load entries go in the same step: no job
-- can be routed to it after, and none stays in a routed set no TAKE looks at (take_jobs.lua
-- drains the routed sets of the daemons the fleet hash lists).
--
-- KEYS[1..8], ARGV[1..3]  queue_head.lua's
-- ARGV[4] daemon          the daemon's id
-- ARGV[5] leave           "1": drop its fleet and load entries too; "0": only move its jobs
-- Returns how many jobs moved.
local daemon, leave = ARGV[4], ARGV[5]
local moved = drain_back(daemon)
if leave == '1' then
  redis.call('HDEL', fleet, daemon)
  redis.call('HDEL', load, daemon)
end
return moved
