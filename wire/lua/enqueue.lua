-- After: queue_head.lua
-- Queues one job for the model's daemons: writes the request's watch key (before the job
-- exists), turns the gate's hold on the request into a place in the queue, adds the job to
-- the jobs stream and puts it, tagged for the fair queue, where the routing says: a
-- daemon's routed set or the shared one. A call sent again (a client's retry after a lost
-- reply) gets the first call's placement back, not a second job.
--
-- Routing (``route`` below; setting ROUTING, ``mode``):
--   shared       every job in the shared set: whoever has room takes it ('fallback').
--   round_robin  each live daemon in turn ('round_robin').
--   cache_aware  the default, in this order:
--     1. session: the daemon the job's session is pinned to, if it is live and balanced.
--     2. affinity: the daemon whose affinity summary holds the longest leading run of the
--        job's chain (ties: the less loaded), if balanced; one that is not makes the
--        reason 'least_loaded'.
--     3. least_loaded (a job with a session or a chain that 1 and 2 did not place): the
--        least loaded daemon (ties in turn), if it has room now (load < its capacity);
--        else the shared set, where the first daemon with room takes it.
--     A job with neither session nor chain goes to the shared set ('fallback').
--   Any mode with fewer than two live daemons: the shared set ('fallback').
-- Live: its heartbeat is at or after ``oldest`` and it takes jobs. Load: the jobs it holds
-- (the live count, else its last beat's) + the jobs routed to it waiting. Balanced: not
-- (load - least > balance_abs and load > balance_rel * least), ``least`` the fleet's least
-- load; the thresholds are settings ROUTE_BALANCE_ABS (4) and ROUTE_BALANCE_REL (1.5).
-- Every decision is counted in the routes hash: by reason, and by reason:daemon.
--
-- KEYS[1..8], ARGV[1..3]  queue_head.lua's
-- KEYS[9]  watch_key      the request's watch key (protocol.watch_key)
-- KEYS[10] routes         route decisions by reason, and the turn (queue.routes_key)
-- KEYS[11] admitted       the gate's admitted set, the model's (queue.admitted_key)
-- KEYS[12] tenant_admitted  the same, the tenant's (queue.tenant_admitted_key)
-- KEYS[13] enqueued       this call's reply, kept for a resent call (queue.enqueued_key)
-- ARGV[4]  job            the Job's JSON
-- ARGV[5]  tenant         its tenant id
-- ARGV[6]  watch_ms       the watch key's TTL in ms (0: no watch key)
-- ARGV[7]  cap            the most entries the jobs stream may hold (protocol.JOBS_MAX_PENDING)
-- ARGV[8]  request_id     the request's id
-- ARGV[9]  bell_maxlen    the bell stream's length, about (queue.BELL_MAXLEN)
-- ARGV[10] enqueued_ttl_s how long the reply is kept (queue.ENQUEUED_TTL_S)
-- ARGV[11] mode           the routing: 'cache_aware', 'round_robin' or 'shared'
-- ARGV[12] oldest         the oldest heartbeat that counts (unix s)
-- ARGV[13] balance_abs    the balance's absolute threshold (jobs)
-- ARGV[14] balance_rel    the balance's relative threshold (times the least load)
-- ARGV[15] session_key    the key naming the daemon of the job's session ('': none)
-- ARGV[16] summary_prefix a daemon's affinity summary is this + its id (a set of hashes)
-- ARGV[17..] chain        the job's affinity chain (wire/affinity.py), first block first
-- Returns {entry id, reason, daemon or ''}, or false when the stream holds the cap already.
local watch_key, routes, admitted, tenant_admitted, enqueued =
  KEYS[9], KEYS[10], KEYS[11], KEYS[12], KEYS[13]
local job, tenant, watch_ms, cap, request_id = ARGV[4], ARGV[5], tonumber(ARGV[6]),
  tonumber(ARGV[7]), ARGV[8]
local bell_maxlen, enqueued_ttl_s = ARGV[9], ARGV[10]
local mode, oldest = ARGV[11], tonumber(ARGV[12])
local balance_abs, balance_rel = tonumber(ARGV[13]), tonumber(ARGV[14])
local session_key, summary_prefix = ARGV[15], ARGV[16]
local chain = {}
for i = 17, #ARGV do chain[#chain + 1] = ARGV[i] end

-- Where the job goes: (the daemon or nil for the shared set, the reason). See the header.
local function route()
  if mode == 'shared' then return nil, 'fallback' end
  local _, live = live_fleet(oldest)
  local ids, loads, least = {}, {}, nil
  for daemon, d in pairs(live) do
    ids[#ids + 1] = daemon
    loads[daemon] = load_of(daemon, d) + redis.call('ZCARD', routed(daemon))
    if least == nil or loads[daemon] < least then least = loads[daemon] end
  end
  if #ids < 2 then return nil, 'fallback' end
  table.sort(ids)
  local function balanced(daemon)
    local l = loads[daemon]
    return not (l - least > balance_abs and l > balance_rel * least)
  end
  if mode == 'round_robin' then
    local turn = redis.call('HINCRBY', routes, 'turn', 1)
    return ids[(turn % #ids) + 1], 'round_robin'
  end
  -- 1. session
  if session_key ~= '' then
    local owner = redis.call('GET', session_key)
    if owner and loads[owner] and balanced(owner) then return owner, 'session' end
  end
  if session_key == '' and #chain == 0 then return nil, 'fallback' end
  -- 2. affinity: the longest leading run of the chain in a daemon's summary
  if #chain > 0 then
    local best, best_run = nil, 0
    for _, daemon in ipairs(ids) do
      local has = redis.call('SMISMEMBER', summary_prefix .. daemon, unpack(chain))
      local run = 0
      while run < #has and has[run + 1] == 1 do run = run + 1 end
      if run > best_run or (run == best_run and run > 0 and loads[daemon] < loads[best]) then
        best, best_run = daemon, run
      end
    end
    if best ~= nil and balanced(best) then return best, 'affinity' end
  end
  -- 3. least loaded, if it has room now (ties in turn); else the shared set
  local tied = {}
  for _, daemon in ipairs(ids) do
    if loads[daemon] == least then tied[#tied + 1] = daemon end
  end
  local pick = tied[(redis.call('HINCRBY', routes, 'turn', 1) % #tied) + 1]
  if least < (tonumber(live[pick].capacity) or 0) then return pick, 'least_loaded' end
  return nil, 'least_loaded'
end

local prior = redis.call('GET', enqueued)  -- this request enqueued already: a resent call
if prior then return cjson.decode(prior) end
if redis.call('XLEN', jobs) >= cap then return false end
if watch_ms > 0 then redis.call('SET', watch_key, 1, 'PX', watch_ms) end
redis.call('ZREM', admitted, request_id)  -- admitted by the gate: now it waits in the queue
redis.call('ZREM', tenant_admitted, request_id)
redis.pcall('XGROUP', 'CREATE', jobs, group, '0', 'MKSTREAM')  -- BUSYGROUP: there already
local target, reason = route()
local id = redis.call('XADD', jobs, '*', 'job', job)
local set = ready
if target ~= nil then set = routed(target) end
sweep(id, tenant, set)
redis.call('XADD', bell, 'MAXLEN', '~', bell_maxlen, '*', 'n', 1)
redis.call('HINCRBY', routes, reason, 1)
if target ~= nil then redis.call('HINCRBY', routes, reason .. ':' .. target, 1) end
local placed = {id, reason, target or ''}
redis.call('SET', enqueued, cjson.encode(placed), 'EX', enqueued_ttl_s)
return placed
