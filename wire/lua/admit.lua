-- After: in_flight.lua, windows.lua
-- Admits a request, or says why not, in one step. Given the model queue's keys (the gate,
-- wire/queue.py), the model's queue is looked at first (queue_full, tenant_queue_full);
-- then every tenant limit (budget, tokens and requests per minute, concurrency) and, given
-- the key's keys, the key's own (budget, tokens and requests per minute), before anything
-- is counted: refused, it counts nothing but the refusal (by code, every tenant's and the
-- tenant's). The refusal names the limit that keeps it out longest (the tenant's on a tie).
-- Admitted, it counts as a request in the window, holds a slot until ``expiry`` and, when
-- ``want`` > 0, a reservation of that many tokens; through the gate, it also counts as
-- waiting in the model's queue until enqueue.lua takes it (or ``admit_hold_s`` pass).
-- With a key it also counts in the key's requests window, records which key the request
-- is (``key_of``: its end charges that key, end_key.lua) and, when ``key_want`` > 0,
-- holds a reservation of the key's; the key's reservations count only while the tenant's
-- in-flight member of their request lives (a lost request's lapses with its slot).
--
-- KEYS[1..2], ARGV[1]     in_flight.lua's
-- KEYS[3] rpm             the tenant's requests window (limits.rpm_key)
-- KEYS[4] tpm             the tenant's tokens window (limits.tpm_key)
-- KEYS[5] month           the tenant's tokens this month (limits.month_key)
-- KEYS[6] refusals        refusals by code, every tenant's (limits.REFUSALS_HASH)
-- KEYS[7] tenant_refusals the tenant's refusals by code (limits.tenant_refusals_key)
-- The gate's, all six or none (queue.gate_keys):
-- KEYS[8]  ready          the model's shared set of waiting jobs (a daemon's routed set:
--                         this key + ':d:' + its id)
-- KEYS[9]  tenants        tenant -> jobs of it waiting
-- KEYS[10] fleet          daemon id -> its FleetEntry's JSON
-- KEYS[11] admitted       requests admitted, not yet enqueued: id -> when (the model's)
-- KEYS[12] tenant_admitted  the same, the tenant's
-- KEYS[13] load           daemon id -> jobs it holds, live
-- The key's, all five or none (limits.key_keys), last: KEYS[k + 1..k + 5] with k = #KEYS - 5
-- (KEYS[8..12] without the gate's, KEYS[14..18] with them):
--   key_rpm       the key's requests window (limits.key_rpm_key)
--   key_tpm       the key's tokens window (limits.key_tpm_key)
--   key_month     the key's tokens this month (limits.key_month_key)
--   key_reserved  the key's reservations: request id -> tokens (limits.key_reserved_key)
--   key_of        the tenant's requests' keys: request id -> key id (limits.key_of_key)
-- ARGV[2]  request_id     the request's id (its slot's member)
-- ARGV[3]  expiry         when its slot lapses (unix s)
-- ARGV[4]  inflight_ttl   the in-flight and reservation keys' TTL at least (s)
-- ARGV[5]  to_next_month  seconds to the next UTC month (the budget's Retry-After)
-- ARGV[6]  want           tokens to reserve (0: none)
-- ARGV[7]  budget         monthly token budget   } -1: unlimited
-- ARGV[8]  tpm_limit      tokens per minute      }
-- ARGV[9]  rpm_limit      requests per minute    }
-- ARGV[10] max_concurrent requests in flight     }
-- ARGV[11..14]            the refusal codes of budget, tpm, rpm, concurrency
-- ARGV[15] window_s       the windows' length (limits.WINDOW_S)
-- ARGV[16] window_ttl     a window's TTL past its newest bucket (limits.WINDOW_KEY_TTL_S)
-- ARGV[17] key_id         the key's id ('': no key, and none of the key's KEYS)
-- ARGV[18] key_want       tokens to reserve of the key's (0: none)
-- ARGV[19] key_budget     the key's monthly token budget   } -1: unlimited
-- ARGV[20] key_tpm        the key's tokens per minute      }
-- ARGV[21] key_rpm        the key's requests per minute    }
-- The gate's, with its keys (queue.gate_args):
-- ARGV[22] tenant         the tenant's id
-- ARGV[23] tenant_cap     the tenant's own cap per daemon (-1: the daemons'
--                         MAX_QUEUE_PER_TENANT)
-- ARGV[24] oldest         the oldest heartbeat that counts (unix s)
-- ARGV[25] queue_full     the refusal code of a full queue
-- ARGV[26] tenant_queue_full  the refusal code of the tenant's full share
-- ARGV[27] admit_hold_s   an admitted request not enqueued this long no longer counts
-- ARGV[28] retry_min      the gate's Retry-After, at least (s)
-- ARGV[29] retry_max      and at most (s)
-- Returns 'ok', or '<limit>:<how>:<retry after s>:<used>:<reserved>' (limits.decision); a
-- key's limit is named 'key_budget', 'key_tpm' or 'key_rpm' (<reserved>: the key's).
local rpm_key, tpm_key, month_key, refusals, tenant_refusals =
  KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local request_id, expiry, inflight_ttl, to_next_month = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local want = tonumber(ARGV[6])
local budget, tpm, rpm, concurrent = tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9]),
  tonumber(ARGV[10])
local code = {budget = ARGV[11], tpm = ARGV[12], rpm = ARGV[13], concurrency = ARGV[14],
  key_budget = ARGV[11], key_tpm = ARGV[12], key_rpm = ARGV[13]}
local window_s, window_ttl = tonumber(ARGV[15]), ARGV[16]
local key_id, key_want = ARGV[17], tonumber(ARGV[18])
local key_budget, key_tpm, key_rpm = tonumber(ARGV[19]), tonumber(ARGV[20]), tonumber(ARGV[21])
local keyed = key_id ~= ''
local k = #KEYS - 5  -- the key's KEYS follow k
local gated = #KEYS > (keyed and 12 or 7)
local ready, tenants, fleet, admitted, tenant_admitted, load =
  KEYS[8], KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local tenant, tenant_cap, oldest = ARGV[22], tonumber(ARGV[23]), tonumber(ARGV[24])
local queue_full, tenant_queue_full = ARGV[25], ARGV[26]
local admit_hold_s, retry_min, retry_max = tonumber(ARGV[27]), tonumber(ARGV[28]),
  tonumber(ARGV[29])

local function refuse_here(refusal_code, limit, how, retry, used, held)
  redis.call('HINCRBY', tenant_refusals, refusal_code, 1)
  return refuse(refusals, refusal_code, limit, how, retry, used, held)
end

-- The gate. With no live daemon counted it admits: the web waits for one (a restart).
if gated then
  local daemons = redis.call('HGETALL', fleet)
  local live, cap, share, rate, free = 0, 0, 0, 0, 0
  for i = 1, #daemons, 2 do
    local ok, d = pcall(cjson.decode, daemons[i + 1])
    if ok and type(d) == 'table' and tonumber(d.at) and tonumber(d.at) >= oldest
        and d.taking == true then
      live = live + 1
      -- its queue allowance, and the room it had at its last beat (a burst after a quiet
      -- spell is not refused before the daemons could take it)
      local held = math.max(0, tonumber(redis.call('HGET', load, daemons[i]) or d.held) or 0)
      free = free + math.max(0, (tonumber(d.capacity) or 0) - held)
      cap = cap + (tonumber(d.max_queue) or 0)
      share = share + (tonumber(d.max_queue_per_tenant) or 0)
      rate = rate + (tonumber(d.drain_per_s) or 0)
    end
  end
  local hold = now - admit_hold_s
  redis.call('ZREMRANGEBYSCORE', admitted, '-inf', hold)
  redis.call('ZREMRANGEBYSCORE', tenant_admitted, '-inf', hold)
  if live > 0 then
    rate = math.max(rate, 0.1 * live)
    cap = cap + free
    local waiting = redis.call('ZCARD', ready) + redis.call('ZCARD', admitted)
    for i = 1, #daemons, 2 do
      waiting = waiting + redis.call('ZCARD', ready .. ':d:' .. daemons[i])
    end
    local function wait_s(n)
      return math.min(retry_max, math.max(retry_min, n / rate))
    end
    if waiting >= cap then
      return refuse_here(queue_full, 'queue', 'full', wait_s(waiting), waiting)
    end
    if tenant_cap >= 0 then share = tenant_cap * live end
    share = share + free
    local mine = tonumber(redis.call('HGET', tenants, tenant) or '0')
    mine = mine + redis.call('ZCARD', tenant_admitted)
    if mine >= share then
      -- its own jobs at the fleet's drain rate: nothing of other tenants' queues goes into
      -- it, so a refusal's Retry-After cannot tell a tenant how many others have work queued
      return refuse_here(tenant_queue_full, 'tenant_queue', 'full', wait_s(mine), mine)
    end
  end
end

-- The tenant's limits.
local oldest_bucket = math.floor(now) - window_s  -- buckets from here on are in the window
local need = math.max(want, 1)  -- a request uses a token at least, reserved or not

local worst = nil
local function note(limit, how, retry, used, held)
  if worst == nil or retry > worst[3] then worst = {limit, how, retry, used, held} end
end
local function never(limit, retry, used, held)
  return refuse_here(code[limit], limit, 'too_big', retry, used, held)
end

if budget >= 0 then
  local used = tonumber(redis.call('GET', month_key) or '0')
  if want > budget then return never('budget', to_next_month, used) end
  if used + need > budget then note('budget', 'over', to_next_month, used)
  elseif used + reserved + need > budget then note('budget', 'held', 1, used) end
end

local tpm_live, tokens = window(tpm_key, oldest_bucket)
if tpm >= 0 then
  if want > tpm then return never('tpm', window_s, tokens) end
  local excess = tokens + reserved + need - tpm
  if excess > tokens then note('tpm', 'held', 1, tokens)
  elseif excess > 0 then
    note('tpm', 'over', window_wait(tpm_live, excess, window_s, now), tokens)
  end
end

local rpm_live, requests = window(rpm_key, oldest_bucket)
if rpm >= 0 then
  if rpm < 1 then return never('rpm', window_s, requests) end
  if requests >= rpm then
    note('rpm', 'over', window_wait(rpm_live, requests + 1 - rpm, window_s, now), requests)
  end
end

if concurrent >= 0 then
  local running = redis.call('ZCARD', inflight)
  if concurrent < 1 then return never('concurrency', window_s, running) end
  if running >= concurrent then note('concurrency', 'held', 1, running) end
end

-- The key's limits: the same rules, its own counters and reservations.
local key_rpm_key, key_tpm_key, key_month_key, key_reservations, key_of
if keyed then
  key_rpm_key, key_tpm_key, key_month_key, key_reservations, key_of =
    KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], KEYS[k + 4], KEYS[k + 5]
  -- a key's reservation (and a request's key) lives while its request's slot does
  local key_reserved = live_reserved(key_reservations)
  local keys_of = redis.call('HKEYS', key_of)
  for i = 1, #keys_of do
    if not redis.call('ZSCORE', inflight, keys_of[i]) then
      redis.call('HDEL', key_of, keys_of[i])
    end
  end
  local key_need = math.max(key_want, 1)

  if key_budget >= 0 then
    local used = tonumber(redis.call('GET', key_month_key) or '0')
    if key_want > key_budget then
      return never('key_budget', to_next_month, used, key_reserved)
    end
    if used + key_need > key_budget then
      note('key_budget', 'over', to_next_month, used, key_reserved)
    elseif used + key_reserved + key_need > key_budget then
      note('key_budget', 'held', 1, used, key_reserved)
    end
  end

  local key_tpm_live, key_tokens = window(key_tpm_key, oldest_bucket)
  if key_tpm >= 0 then
    if key_want > key_tpm then return never('key_tpm', window_s, key_tokens, key_reserved) end
    local excess = key_tokens + key_reserved + key_need - key_tpm
    if excess > key_tokens then note('key_tpm', 'held', 1, key_tokens, key_reserved)
    elseif excess > 0 then
      note('key_tpm', 'over', window_wait(key_tpm_live, excess, window_s, now), key_tokens,
           key_reserved)
    end
  end

  local key_rpm_live, key_requests = window(key_rpm_key, oldest_bucket)
  if key_rpm >= 0 then
    if key_rpm < 1 then return never('key_rpm', window_s, key_requests, key_reserved) end
    if key_requests >= key_rpm then
      note('key_rpm', 'over', window_wait(key_rpm_live, key_requests + 1 - key_rpm, window_s,
                                          now), key_requests, key_reserved)
    end
  end
end

if worst then
  return refuse_here(code[worst[1]], worst[1], worst[2], worst[3], worst[4], worst[5])
end

-- Admitted: count it.
redis.call('HINCRBY', rpm_key, string.format('%d', math.floor(now)), 1)
redis.call('EXPIRE', rpm_key, window_ttl)
redis.call('ZADD', inflight, expiry, request_id)
extend(inflight, inflight_ttl)
if want > 0 then
  redis.call('HSET', reservations, request_id, want)
  extend(reservations, inflight_ttl)
end
if keyed then
  redis.call('HINCRBY', key_rpm_key, string.format('%d', math.floor(now)), 1)
  redis.call('EXPIRE', key_rpm_key, window_ttl)
  redis.call('HSET', key_of, request_id, key_id)
  extend(key_of, inflight_ttl)
  if key_want > 0 then
    redis.call('HSET', key_reservations, request_id, key_want)
    extend(key_reservations, inflight_ttl)
  end
end
if gated then  -- it counts as waiting in the model's queue until enqueue.lua takes it
  redis.call('ZADD', admitted, ARGV[1], request_id)
  redis.call('EXPIRE', admitted, 2 * admit_hold_s)
  redis.call('ZADD', tenant_admitted, ARGV[1], request_id)
  redis.call('EXPIRE', tenant_admitted, 2 * admit_hold_s)
end
return 'ok'
