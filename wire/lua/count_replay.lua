-- After: windows.lua
-- Counts a replay (a resume of a finished request: its stored stream sent again) in its
-- tenant's replay window and, when the tenant has a requests-per-minute limit, in its
-- requests window (a replay is a request's worth); or refuses it, counting nothing but the
-- refusal. A window is a hash of one-second buckets (wire/limits.py's); it holds the last
-- `window_s` seconds. The refusal names the limit that keeps the replay out longest.
--
-- KEYS[1] replays_key       the tenant's replay window (limits.replays_key)
-- KEYS[2] rpm_key           the tenant's requests window (limits.rpm_key)
-- KEYS[3] refusals          refusals by code, every tenant's (limits.REFUSALS_HASH)
-- KEYS[4] tenant_refusals   the tenant's refusals by code (limits.tenant_refusals_key)
-- ARGV[1] now               unix seconds
-- ARGV[2] window_s          the windows' length (limits.WINDOW_S)
-- ARGV[3] key_ttl_s         a window's TTL past its newest bucket (limits.WINDOW_KEY_TTL_S)
-- ARGV[4] replays_limit     replays per window (-1: unlimited)
-- ARGV[5] rpm_limit         requests per window (-1: unlimited)
-- ARGV[6] replays_code      the replay rate's refusal code
-- ARGV[7] rpm_code          the requests per minute's refusal code
-- ARGV[8] earlier_code      the code of refusals a web process made without this script
-- ARGV[9] earlier_count     how many ('' and 0: none); counted first, whatever this one is
-- Returns 'ok', or '<limit>:<how>:<retry after s>:<used>:0' (limits.decision reads it).
local replays_key, rpm_key, refusals, tenant_refusals = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, window_s, key_ttl_s = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local replays_limit, rpm_limit = tonumber(ARGV[4]), tonumber(ARGV[5])
local replays_code, rpm_code = ARGV[6], ARGV[7]
local oldest = math.floor(now) - window_s  -- buckets from here on are in the window

local earlier_code, earlier_count = ARGV[8], tonumber(ARGV[9])
if earlier_count > 0 and earlier_code ~= '' then
  redis.call('HINCRBY', refusals, earlier_code, earlier_count)
  redis.call('HINCRBY', tenant_refusals, earlier_code, earlier_count)
end

local worst = nil
local function check(key, limit, name, code)
  if limit < 0 then return end
  local live, used = window(key, oldest)
  local how, retry = 'over', 0
  if limit < 1 then how, retry = 'too_big', window_s
  elseif used >= limit then retry = window_wait(live, used + 1 - limit, window_s, now)
  else return end
  if worst == nil or retry > worst.retry then
    worst = {name = name, how = how, retry = retry, used = used, code = code}
  end
end

check(replays_key, replays_limit, 'replays', replays_code)
check(rpm_key, rpm_limit, 'rpm', rpm_code)
if worst then
  redis.call('HINCRBY', refusals, worst.code, 1)
  redis.call('HINCRBY', tenant_refusals, worst.code, 1)
  return table.concat({worst.name, worst.how, math.max(1, math.ceil(worst.retry)),
                       worst.used, 0}, ':')
end
local bucket = string.format('%d', math.floor(now))
if replays_limit >= 0 then
  redis.call('HINCRBY', replays_key, bucket, 1)
  redis.call('EXPIRE', replays_key, key_ttl_s)
end
if rpm_limit >= 0 then
  redis.call('HINCRBY', rpm_key, bucket, 1)
  redis.call('EXPIRE', rpm_key, key_ttl_s)
end
return 'ok'
