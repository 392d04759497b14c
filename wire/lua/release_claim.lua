-- Gives an Idempotency-Key's claim back: deletes it only while it is still ours (a later
-- claim of the key is left alone; inference/idempotency.py).
--
-- KEYS[1] claim_key  the key's claim
-- ARGV[1] record     the record our claim wrote there
-- Returns 1 when deleted, else 0.
local claim_key, record = KEYS[1], ARGV[1]
if redis.call('GET', claim_key) == record then return redis.call('DEL', claim_key) end
return 0
