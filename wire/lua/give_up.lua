-- The web gives up on a request whose owner died and that no daemon took over: it takes
-- the ownership ("web") and writes the request's end, an error event, unless the owner
-- moved on or the stream has ended (an owner is deleted with its request's end). No owner
-- at all passes too (a daemon that predates owners). One step, so a daemon continuing the
-- request meanwhile and the web cannot both win (wire/ownership.py).
--
-- KEYS[1] owner_key    the request's owner (protocol.owner_key)
-- KEYS[2] events       the request's events stream (protocol.events_stream)
-- ARGV[1] owner        the owner given up on ("" for none)
-- ARGV[2] ttl          the owner key's TTL (ownership.OWNER_TTL_S)
-- ARGV[3] data         the error event's data (JSON)
-- ARGV[4] retention_s  the events stream's TTL (STREAM_RETENTION_S)
-- Returns 1 when this call ended the request, else 0.
local owner_key, events = KEYS[1], KEYS[2]
local owner, ttl, data, retention_s = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local current = redis.call('GET', owner_key) or ''
if current ~= owner and current ~= '' then return 0 end
local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)[1]
if last then
  local fields = last[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'type' and (fields[i + 1] == 'done' or fields[i + 1] == 'error') then
      return 0
    end
  end
end
redis.call('SET', owner_key, 'web', 'EX', ttl)
redis.call('XADD', events, '*', 'type', 'error', 'data', data)
redis.call('EXPIRE', events, retention_s)
return 1
