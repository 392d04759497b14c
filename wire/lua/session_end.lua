-- A turn of a session ends: the daemon at the request's last event (with the session's
-- tokens when the turn finished: what the conversation holds now, prompt and reply), or
-- the web when the request never reached a daemon (no tokens). Only the turn that marked
-- the session busy ends it: a late or repeated end changes nothing. Returns 1 if it did.
--
-- KEYS[1] session_key   the session's hash (wire.sessions.key)
-- KEYS[2] tenant_key    the tenant's sessions (wire.sessions.tenant_key)
-- ARGV[1] request_id
-- ARGV[2] tokens        the conversation's tokens, int32 little-endian; '' keeps them
-- ARGV[3] ttl           SESSION_TTL_S
-- ARGV[4] now           unix s
-- ARGV[5] session_id
local session_key, tenant_key = KEYS[1], KEYS[2]
local request_id, tokens = ARGV[1], ARGV[2]
local ttl, now, session_id = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if redis.call('HGET', session_key, 'busy') ~= request_id then return 0 end
if tokens ~= '' then
  redis.call('HSET', session_key, 'tokens', tokens, 'n_tokens', #tokens / 4)
  redis.call('HINCRBY', session_key, 'turns', 1)
end
redis.call('HSET', session_key, 'busy', '', 'busy_until', 0)
redis.call('EXPIRE', session_key, ttl)
redis.call('ZADD', tenant_key, now + ttl, session_id)
return 1
