-- A turn of a session begins (the web, inside the request's admission): a new session is
-- made, or an existing one of the tenant and model is marked busy with this request. A
-- busy mark older than its request's deadline does not count (the turn's end was lost).
-- Returns {'ok', n_tokens} or {code[, detail]}: 'no_session' (unknown, expired, another
-- tenant's, or holding no turn yet for a continue), 'session_busy', 'too_many_sessions',
-- 'session_model_mismatch' (detail: the session's model).
--
-- KEYS[1] session_key     the session's hash (wire.sessions.key)
-- KEYS[2] tenant_key      the tenant's sessions: id -> expiry (unix s) (wire.sessions.tenant_key)
-- ARGV[1] mode            new | continue | reset (a full history replaces the session's)
-- ARGV[2] session_id
-- ARGV[3] tenant
-- ARGV[4] model
-- ARGV[5] request_id
-- ARGV[6] busy_until      unix s: the request's deadline and a margin
-- ARGV[7] ttl             seconds a session lives after its last turn (SESSION_TTL_S)
-- ARGV[8] cap             sessions one tenant may hold (SESSIONS_PER_TENANT)
-- ARGV[9] now             unix s
local session_key, tenant_key = KEYS[1], KEYS[2]
local mode, session_id, tenant, model = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local request_id, busy_until = ARGV[5], tonumber(ARGV[6])
local ttl, cap, now = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])

redis.call('ZREMRANGEBYSCORE', tenant_key, '-inf', now)
local n_tokens = 0
if mode == 'new' then
  if redis.call('ZCARD', tenant_key) >= cap then return {'too_many_sessions'} end
  if redis.call('EXISTS', session_key) == 1 then return {'session_busy'} end
  redis.call('HSET', session_key, 'tenant', tenant, 'model', model, 'turns', 0,
             'n_tokens', 0, 'busy', request_id, 'busy_until', busy_until)
else
  local s = redis.call('HMGET', session_key, 'tenant', 'model', 'busy', 'busy_until',
                       'n_tokens')
  if not s[1] or s[1] ~= tenant then return {'no_session'} end
  if s[2] ~= model then return {'session_model_mismatch', s[2]} end
  if s[3] and s[3] ~= '' and tonumber(s[4] or 0) > now then return {'session_busy'} end
  n_tokens = tonumber(s[5] or 0)
  if mode == 'continue' and n_tokens == 0 then return {'no_session'} end
  redis.call('HSET', session_key, 'busy', request_id, 'busy_until', busy_until)
end
local lives = math.max(ttl, math.ceil(busy_until - now) + ttl)
redis.call('EXPIRE', session_key, lives)
redis.call('ZADD', tenant_key, now + lives, session_id)
redis.call('EXPIRE', tenant_key, lives)
return {'ok', n_tokens}
