-- A request's end for the key it was made with (wire/limits.py: ``record_usage`` at its end,
-- ``release`` when the web rolls it back): the key admit.lua recorded for it in ``key_of``
-- is charged its tokens (its tokens window and its month), its reservation is dropped and
-- the record goes. Nothing happens for a request with no key recorded (admitted without
-- one, or ended already): a second end charges nothing.
--
-- KEYS[1] key_of         the tenant's requests' keys: request id -> key id (limits.key_of_key)
-- ARGV[1] request_id     the request's id
-- ARGV[2] tokens         its tokens used (0: nothing charged, a release)
-- ARGV[3] bucket         the tokens window's bucket to charge (unix second)
-- ARGV[4] window_ttl     a window's TTL past its newest bucket (limits.WINDOW_KEY_TTL_S)
-- ARGV[5] month          the UTC month charged (YYYYMM)
-- ARGV[6] month_ttl      the month counter's TTL (limits.MONTH_USAGE_TTL_S)
-- ARGV[7] tpm_prefix     the key's tokens window is this + key id (limits.key_tpm_key)
-- ARGV[8] reserved_prefix  the key's reservations are this + key id (limits.key_reserved_key)
-- ARGV[9] month_prefix   the key's month is this + key id + ':' + month (limits.key_month_key)
-- Returns the key id charged, or false (none recorded).
local key_of = KEYS[1]
local request_id, tokens, bucket, window_ttl = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4]
local month, month_ttl = ARGV[5], ARGV[6]
local tpm_prefix, reserved_prefix, month_prefix = ARGV[7], ARGV[8], ARGV[9]

local key_id = redis.call('HGET', key_of, request_id)
if not key_id then return false end
if tokens > 0 then
  local window = tpm_prefix .. key_id
  redis.call('HINCRBY', window, bucket, tokens)
  redis.call('EXPIRE', window, window_ttl)
  local used = month_prefix .. key_id .. ':' .. month
  redis.call('INCRBY', used, tokens)
  redis.call('EXPIRE', used, month_ttl)
end
redis.call('HDEL', reserved_prefix .. key_id, request_id)
redis.call('HDEL', key_of, request_id)
return key_id
