-- Adds one death to a job fingerprint's set of deaths, once, however many copies of the job
-- ran at it and however many daemons recover them at once; returns every death of the set.
-- A string left by a daemon that counted with INCR is replaced: its count names no death.
--
-- KEYS[1] deaths_key  the fingerprint's deaths set (protocol.deaths_key)
-- ARGV[1] death       the death (protocol.death_id: "<daemon id>/<run id>")
-- ARGV[2] ttl         the set's TTL in seconds (protocol.DEATHS_TTL_S)
local deaths_key = KEYS[1]
local death, ttl = ARGV[1], ARGV[2]
if redis.call('TYPE', deaths_key).ok ~= 'set' then redis.call('DEL', deaths_key) end
redis.call('SADD', deaths_key, death)
redis.call('EXPIRE', deaths_key, ttl)
return redis.call('SMEMBERS', deaths_key)
