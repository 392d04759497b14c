-- After: in_flight.lua
-- A concurrency slot without tokens (a resume's reader): only the concurrency limit.
--
-- KEYS[1..2], ARGV[1]   in_flight.lua's
-- KEYS[3] refusals      refusals by code, every tenant's (limits.REFUSALS_HASH)
-- ARGV[2] member        the slot's member (limits.RESUME_SLOT_PREFIX + a random hex)
-- ARGV[3] expiry        when the slot lapses unless renewed (unix s)
-- ARGV[4] max_concurrent  the tenant's limit (-1: unlimited)
-- ARGV[5] inflight_ttl  the in-flight key's TTL at least (s)
-- ARGV[6] code          the concurrency limit's refusal code
-- Returns 'ok', or '<limit>:<how>:<retry after s>:<used>:<reserved>' (limits.decision).
local refusals = KEYS[3]
local member, expiry, concurrent = ARGV[2], ARGV[3], tonumber(ARGV[4])
local inflight_ttl, code = ARGV[5], ARGV[6]
local running = redis.call('ZCARD', inflight)
if concurrent >= 0 and running >= concurrent then
  local how = 'held'
  if concurrent < 1 then how = 'too_big' end
  return refuse(refusals, code, 'concurrency', how, 1, running)
end
redis.call('ZADD', inflight, expiry, member)
extend(inflight, inflight_ttl)
return 'ok'
