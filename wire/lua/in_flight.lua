-- Heads: admit.lua, take_slot.lua
-- The shared head of the scripts that take a tenant's concurrency slot (wire/limits.py),
-- loaded before each of them (wire/scripts.py). Drops expired in-flight members and their
-- reservations (and reservations whose member is gone), then sums what the live ones
-- reserved (``reserved``); defines ``live_reserved``, ``extend`` and ``refuse``.
--
-- KEYS[1] inflight  the tenant's in-flight set: member -> expiry (limits.inflight_key)
-- KEYS[2] reserved  the tenant's reservations: request id -> tokens (limits.reserved_key)
-- ARGV[1] now       unix seconds
-- The files it heads name their own KEYS and ARGV from KEYS[3] and ARGV[2] on.
local inflight, reservations = KEYS[1], KEYS[2]
local now = tonumber(ARGV[1])

local expired = redis.call('ZRANGEBYSCORE', inflight, '-inf', now)
for i = 1, #expired do redis.call('HDEL', reservations, expired[i]) end
if #expired > 0 then redis.call('ZREMRANGEBYSCORE', inflight, '-inf', now) end
-- the tokens a reservations hash (request id -> tokens) holds for live in-flight members;
-- the entries of members gone are dropped (the tenant's and a key's: admit.lua)
local function live_reserved(hash)
  local sum = 0
  local held = redis.call('HGETALL', hash)
  for i = 1, #held, 2 do
    if redis.call('ZSCORE', inflight, held[i]) then
      sum = sum + tonumber(held[i + 1])
    else
      redis.call('HDEL', hash, held[i])
    end
  end
  return sum
end
local reserved = live_reserved(reservations)
local function extend(key, ttl)  -- a key's TTL only grows: it holds others' members too
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
-- counts the refusal under its code in ``counter``; the reply limits.decision reads
-- (``held``: the tokens reserved that the refused limit counts; the tenant's if nil)
local function refuse(counter, code, limit, how, retry, used, held)
  redis.call('HINCRBY', counter, code, 1)
  return table.concat({limit, how, math.max(1, math.ceil(retry)), used, held or reserved}, ':')
end
