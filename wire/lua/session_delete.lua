-- A tenant deletes one of its sessions (DELETE /v1/sessions/<id>). Returns 1, or 0 when
-- there is no such session of this tenant (another tenant's is not told apart).
--
-- KEYS[1] session_key   the session's hash (wire.sessions.key)
-- KEYS[2] tenant_key    the tenant's sessions (wire.sessions.tenant_key)
-- ARGV[1] tenant
-- ARGV[2] session_id
local session_key, tenant_key = KEYS[1], KEYS[2]
local tenant, session_id = ARGV[1], ARGV[2]
if redis.call('HGET', session_key, 'tenant') ~= tenant then return 0 end
redis.call('DEL', session_key)
redis.call('ZREM', tenant_key, session_id)
return 1
