-- Heads: enqueue.lua, take_jobs.lua, drain_back.lua
-- The shared head of the model queue's scripts (wire/queue.py), loaded before each of them
-- (wire/scripts.py): it binds the keys and arguments they share and defines what they do
-- alike. ``sweep`` delivers the entries of the jobs stream not yet delivered to anyone to
-- the holder and queues them (the one ENQUEUE just added, ``known``, where its routing put
-- it; others in the shared set); ``live_fleet`` reads the fleet hash; ``drain_back`` moves
-- a daemon's routed set into the shared one.
--
-- KEYS[1] jobs         the model's jobs stream (protocol.jobs_stream)
-- KEYS[2] ready        the shared set of waiting jobs (queue.ready_key); a daemon's routed
--                      set is this key + ':d:' + its id (queue.routed_key)
-- KEYS[3] tenants      tenant -> jobs of it waiting (queue.tenants_key)
-- KEYS[4] tags         tenant -> the tag its next job starts after (queue.tags_key)
-- KEYS[5] clock        the tag of the job taken last (queue.clock_key)
-- KEYS[6] bell         the bell stream idle daemons block on (queue.bell_stream)
-- KEYS[7] fleet        daemon id -> its FleetEntry's JSON (queue.fleet_key)
-- KEYS[8] load         daemon id -> jobs it holds, live (queue.load_key)
-- ARGV[1] group        the jobs stream's consumer group (protocol.JOBS_GROUP)
-- ARGV[2] holder       the consumer waiting jobs are pending under (queue.HOLDER)
-- ARGV[3] sweep_count  unqueued entries swept per run at most (queue.SWEEP_COUNT)
-- The files it heads name their own KEYS and ARGV from KEYS[9] and ARGV[4] on.
local jobs, ready, tenants, tags, clock, bell = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local fleet, load = KEYS[7], KEYS[8]
local group, holder, sweep_count = ARGV[1], ARGV[2], ARGV[3]

local function tenant_of(fields)
  for i = 1, #fields, 2 do
    if fields[i] == 'job' then
      -- the Job's JSON names tenant_id before any text (an escaped quote cannot match)
      local t = string.match(fields[i + 1], '"tenant_id":"([^"]*)"')
      if t and t ~= '' and not string.find(t, '|', 1, true) then return t end
    end
  end
  return '?'
end
local function routed(daemon) return ready .. ':d:' .. daemon end
local function sweep(known_id, known_tenant, known_set)
  local got = redis.call('XREADGROUP', 'GROUP', group, holder, 'COUNT', sweep_count,
                         'STREAMS', jobs, '>')
  if not got then return end
  local now_tag = tonumber(redis.call('GET', clock) or '0')
  for _, entry in ipairs(got[1][2]) do
    local id, tenant, set = entry[1], known_tenant, known_set
    if id ~= known_id then tenant, set = tenant_of(entry[2]), ready end
    local start = math.max(now_tag, tonumber(redis.call('HGET', tags, tenant) or '0'))
    redis.call('HSET', tags, tenant, start + 1)
    redis.call('ZADD', set, start, id .. '|' .. tenant)
    redis.call('HINCRBY', tenants, tenant, 1)
  end
end
-- a daemon's jobs held now: the live count, else what its last beat said
local function load_of(daemon, d)
  local live = redis.call('HGET', load, daemon)
  if live then return math.max(0, tonumber(live)) end
  return tonumber(d.held) or 0
end
-- {id -> entry} of the fleet hash's daemons, and which of them are live and take jobs
local function live_fleet(oldest)
  local raw = redis.call('HGETALL', fleet)
  local all, live = {}, {}
  for i = 1, #raw, 2 do
    local ok, d = pcall(cjson.decode, raw[i + 1])
    if not ok or type(d) ~= 'table' then d = {} end
    all[raw[i]] = d
    if tonumber(d.at) and tonumber(d.at) >= oldest and d.taking == true then
      live[raw[i]] = d
    end
  end
  return all, live
end
local function drain_back(daemon)
  local key = routed(daemon)
  local held = redis.call('ZRANGE', key, 0, -1, 'WITHSCORES')
  for i = 1, #held, 2 do redis.call('ZADD', ready, held[i + 1], held[i]) end
  redis.call('DEL', key)
  return #held / 2
end
