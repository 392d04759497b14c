-- A request's ownership moves to ``new_owner`` if its owner is one of ``from``: a
-- compare-and-set (wire/ownership.py).
--
-- KEYS[1] owner_key  the request's owner (protocol.owner_key)
-- ARGV[1] new_owner  the owner it moves to (a daemon id, "web")
-- ARGV[2] ttl        the owner key's TTL (ownership.OWNER_TTL_S)
-- ARGV[3..] from     the owners it may be taken from ("" stands for no owner yet)
-- Returns 1 when taken, else 0.
local owner_key = KEYS[1]
local new_owner, ttl = ARGV[1], ARGV[2]
local current = redis.call('GET', owner_key) or ''
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('SET', owner_key, new_owner, 'EX', ttl)
    return 1
  end
end
return 0
