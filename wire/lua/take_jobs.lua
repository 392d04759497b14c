-- After: queue_head.lua
-- A daemon takes jobs: the lowest tags of its own routed set and the shared one, first
-- moving back into the shared set what was routed to daemons that are gone or drained.
-- A take with the sequence number of the daemon's last take that took jobs is that take
-- sent again (its reply was lost: the jobs are pending under the daemon, which does not
-- know them): it gets the same jobs back and takes no others.
--
-- KEYS[1..8], ARGV[1..3]  queue_head.lua's
-- ARGV[4] daemon          the daemon's (consumer's) id
-- ARGV[5] want            how many jobs it can hold now (0: none, it only shows it is alive)
-- ARGV[6] oldest          the oldest heartbeat that counts (unix s)
-- ARGV[7] seq             the take's sequence number ("0": none)
-- ARGV[8] touch_id        an entry id past any (queue._TOUCH_ID): reading after it marks
--                         the consumer alive
-- ARGV[9] memo_ttl_s      how long a take's jobs are kept for the same take sent again
--                         (queue.TAKE_MEMO_TTL_S)
-- Returns {entries, the bell's last id}: each entry {id, fields} as XCLAIM gives it, now
-- pending under the daemon.
local daemon, want, oldest, seq = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), ARGV[7]
local touch_id, memo_ttl_s = ARGV[8], ARGV[9]
local memo_key = ready .. ':taken:' .. daemon  -- queue.taken_key

local function last_bell()
  local last = redis.call('XREVRANGE', bell, '+', '-', 'COUNT', 1)
  if last[1] then return last[1][1] end
  return '0-0'
end
if want > 0 and seq ~= '0' then
  local memo = redis.call('GET', memo_key)
  if memo then
    local m = cjson.decode(memo)
    if m[1] == seq then
      local again = {}
      for i = 2, #m do  -- those still pending under this daemon (not ended, not reclaimed)
        local mine = redis.call('XPENDING', jobs, group, m[i], m[i], 1, daemon)
        local entry = redis.call('XRANGE', jobs, m[i], m[i])
        if mine[1] and entry[1] then again[#again + 1] = entry[1] end
      end
      return {again, last_bell()}
    end
  end
end
sweep(nil, nil, nil)
local all, live = live_fleet(oldest)
for other, _ in pairs(all) do
  if not live[other] and other ~= daemon then drain_back(other) end
end
redis.call('XGROUP', 'CREATECONSUMER', jobs, group, daemon)
redis.call('XREADGROUP', 'GROUP', group, daemon, 'COUNT', 1, 'STREAMS', jobs, touch_id)
local out = {}
local own = routed(daemon)
while #out < want do
  local mine = redis.call('ZRANGE', own, 0, 0, 'WITHSCORES')
  local shared = redis.call('ZRANGE', ready, 0, 0, 'WITHSCORES')
  local head, from = mine, own
  if #mine == 0 or (#shared > 0 and tonumber(shared[2]) < tonumber(mine[2])) then
    head, from = shared, ready
  end
  if #head == 0 then break end
  local member, tag = head[1], head[2]
  redis.call('ZREM', from, member)
  redis.call('SET', clock, tag)
  local bar = string.find(member, '|', 1, true)
  local id, tenant = string.sub(member, 1, bar - 1), string.sub(member, bar + 1)
  if redis.call('HINCRBY', tenants, tenant, -1) <= 0 then redis.call('HDEL', tenants, tenant) end
  local claimed = redis.call('XCLAIM', jobs, group, daemon, 0, id)
  if claimed[1] then out[#out + 1] = claimed[1] end  -- else deleted meanwhile
end
if #out > 0 then
  redis.call('HINCRBY', load, daemon, #out)
  if seq ~= '0' then
    local m = {seq}
    for i = 1, #out do m[#m + 1] = out[i][1] end
    redis.call('SET', memo_key, cjson.encode(m), 'EX', memo_ttl_s)
  end
end
if redis.call('HLEN', tenants) == 0 then
  -- nothing waits: forget the tags at or behind the clock (a tag there counts as none), so
  -- the hash holds only the tenants served last; the clock and the tags ahead of it stay,
  -- or a tenant whose job was just taken would tie the next tenant's first job
  local now_tag, all_tags = tonumber(redis.call('GET', clock) or '0'), redis.call('HGETALL', tags)
  for i = 1, #all_tags, 2 do
    if tonumber(all_tags[i + 1]) <= now_tag then redis.call('HDEL', tags, all_tags[i]) end
  end
end
return {out, last_bell()}
