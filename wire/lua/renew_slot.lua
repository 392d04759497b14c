-- Pushes a held slot's expiry on, and its key's TTL with it (never shorter); a slot no
-- longer held stays gone.
--
-- KEYS[1] inflight  the tenant's in-flight set (limits.inflight_key)
-- ARGV[1] member    the slot's member
-- ARGV[2] expiry    its new expiry (unix s)
-- ARGV[3] ttl       the key's TTL at least (whole seconds)
-- Returns 1 when renewed, 0 when the slot was not held.
local inflight = KEYS[1]
local member, expiry, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
if not redis.call('ZSCORE', inflight, member) then return 0 end
redis.call('ZADD', inflight, 'XX', expiry, member)
if redis.call('TTL', inflight) < ttl then redis.call('EXPIRE', inflight, ttl) end
return 1
