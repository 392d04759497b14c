"""The model's waiting work in Redis: one fair queue for every daemon of the model.

A daemon takes a job only when it can hold it (a free slot or room in its small local
queue, ``intake.py``), so waiting work stays here, where any live daemon of the model can
take it, and the web decides ``queue_full`` from what this queue holds, before anything
else (``GATE``, run inside the tenant-limits admission script: one round trip).

Keys (``<model>`` is the model's name):
Jobs     ``llm:jobs:<model>``             the jobs stream (wire/protocol.py), consumer group
                                          ``daemons``. A job waiting here is pending under
                                          the group's placeholder consumer ``HOLDER``; a
                                          daemon takes it by XCLAIM (then it is pending
                                          under the daemon: the dead-daemon recovery works
                                          as before, and skips ``HOLDER``).
Ready    ``llm:queue:ready:<model>``      sorted set: ``<entry id>|<tenant>`` -> its start
                                          tag in a start-time fair queue (each tenant's jobs
                                          in order, tenants taking turns)
Tenants  ``llm:queue:tenants:<model>``    hash: tenant -> jobs of it waiting
Tags     ``llm:queue:tags:<model>``       hash: tenant -> the tag its next job starts after
Clock    ``llm:queue:clock:<model>``      the tag of the job taken last (the virtual time)
Bell     ``llm:queue:bell:<model>``       a short stream, one tiny entry per enqueue: what an
                                          idle daemon blocks on (never the job itself)
Fleet    ``llm:fleet:<model>``            hash: daemon id -> JSON of what the gate and the
                                          routing need from it (``FleetEntry``), written
                                          with its heartbeat
Routed   ``llm:queue:ready:<model>:d:<id>``  jobs routed to one daemon (cache affinity, its
                                          session), waiting; moved back into the shared set
                                          when it dies, drains or stops (``TAKE``)
Routes   ``llm:route:<model>``            hash: route decisions by reason (and by daemon)

Fair queueing: a job of tenant t gets the tag ``S = max(clock, tags[t])`` and moves
``tags[t]`` to ``S + 1``; daemons take the lowest tags first and move the clock to the
tag taken. So one tenant's burst of 40 delays another tenant's next job by one turn, not
forty, across the whole fleet (the round robin ``fair_queue.py`` gives inside a daemon).

An entry added to the jobs stream without ``ENQUEUE`` (a rogue or an old writer) is swept
into the queue by the next ``ENQUEUE`` or ``TAKE`` (its tenant read from its JSON, ``?``
when it has none: the daemon then drops it as malformed).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

from .protocol import (
    HEARTBEAT_TTL_S,
    JOBS_GROUP,
    JOBS_MAX_PENDING,
    PREFIX,
    Job,
    jobs_stream,
    watch_key,
)

HOLDER = "__waiting__"  # the consumer waiting jobs are pending under
# Routing (setting ROUTING): where ENQUEUE puts a job.
ROUTE_CACHE_AWARE = "cache_aware"  # session, else the longest affinity match, if balanced
ROUTE_ROUND_ROBIN = "round_robin"  # each live daemon in turn (a baseline)
ROUTE_SHARED = "shared"  # every job in the shared set: whoever has room takes it
ROUTES = (ROUTE_CACHE_AWARE, ROUTE_ROUND_ROBIN, ROUTE_SHARED)
ROUTE_REASONS = ("affinity", "least_loaded", "session", "fallback", "round_robin")
BELL_MAXLEN = 16
# A daemon blocks this long on the bell at most (then it looks at the queue anyway: a job
# added without ENQUEUE rings no bell).
BELL_BLOCK_MS = 500
SWEEP_COUNT = 256  # unqueued entries swept per script run
ADMIT_HOLD_S = 30  # an admitted request not enqueued within this long no longer counts
ENQUEUED_TTL_S = 60  # how long an ENQUEUE sent again returns the first placement
TAKE_MEMO_TTL_S = 3600  # how long a TAKE sent again (after an outage) gets its jobs back
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
# Past any entry id: reading the history after it returns nothing, but counts as the
# consumer's interaction (XINFO CONSUMERS ``idle``), which the dead-daemon check reads.
_TOUCH_ID = "18446744073709551615-18446744073709551615"


def ready_key(model: str) -> str:
    return f"{PREFIX}:queue:ready:{model}"


def tenants_key(model: str) -> str:
    return f"{PREFIX}:queue:tenants:{model}"


def tags_key(model: str) -> str:
    return f"{PREFIX}:queue:tags:{model}"


def clock_key(model: str) -> str:
    return f"{PREFIX}:queue:clock:{model}"


def bell_stream(model: str) -> str:
    return f"{PREFIX}:queue:bell:{model}"


def fleet_key(model: str) -> str:
    return f"{PREFIX}:fleet:{model}"


def keys_of(model: str) -> list[str]:
    """Every key of a model's queue but the routed and tenant sets (a test's clean-up)."""
    return [*_queue_keys(model), routes_key(model), admitted_key(model)]


def routed_key(model: str, daemon_id: str) -> str:
    """Jobs routed to one daemon, waiting (the same members and tags as ``ready_key``)."""
    return f"{ready_key(model)}:d:{daemon_id}"


def taken_key(model: str, daemon_id: str) -> str:
    """A daemon's last take that took jobs: [its sequence number, entry ids] (TAKE)."""
    return f"{ready_key(model)}:taken:{daemon_id}"


def enqueued_key(request_id: str) -> str:
    """ENQUEUE's reply for a request, kept ENQUEUED_TTL_S: the same call sent again (a
    client's retry after a reply lost to a broken connection: redis-py resends a command
    once on a ConnectionError) gets it back instead of a second job entry, which would
    run the request again once the first had ended."""
    return f"{PREFIX}:queue:enqueued:{request_id}"


def admitted_key(model: str) -> str:
    """Requests the gate admitted and the web has not enqueued yet: request id -> when (unix
    s). They count as waiting (a burst admitted at once cannot pass the limit); ENQUEUE
    removes each, the gate drops those older than ADMIT_HOLD_S (a web that died between)."""
    return f"{PREFIX}:queue:admitted:{model}"


def tenant_admitted_key(model: str, tenant_id: str) -> str:
    return f"{admitted_key(model)}:t:{tenant_id}"


def load_key(model: str) -> str:
    """daemon id -> jobs it holds, live: TAKE adds what it takes, each job's end (the
    writer's flush) takes one off, every heartbeat sets the daemon's own count (so a count
    a crash left wrong lasts a second at most)."""
    return f"{PREFIX}:queue:load:{model}"


def routes_key(model: str) -> str:
    """Route decisions: reason -> count, ``<reason>:<daemon>`` -> count, the round robin's
    turn."""
    return f"{PREFIX}:route:{model}"


def _queue_keys(model: str) -> list[str]:
    return [jobs_stream(model), ready_key(model), tenants_key(model), tags_key(model),
            clock_key(model), bell_stream(model), fleet_key(model), load_key(model)]


# Shared by the scripts: KEYS[1..7] = _queue_keys. ``sweep`` delivers the entries of the
# stream not yet delivered to anyone to HOLDER and queues them (the one ENQUEUE just added,
# ``known``, where its routing put it; others in the shared set). ``live_fleet`` reads the
# fleet hash; ``drain_back`` moves a daemon's routed set into the shared one.
_COMMON = f"""
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
local function routed(daemon) return KEYS[2] .. ':d:' .. daemon end
local function sweep(known_id, known_tenant, known_set)
  local got = redis.call('XREADGROUP', 'GROUP', '{JOBS_GROUP}', '{HOLDER}', 'COUNT',
                         {SWEEP_COUNT}, 'STREAMS', KEYS[1], '>')
  if not got then return end
  local clock = tonumber(redis.call('GET', KEYS[5]) or '0')
  for _, entry in ipairs(got[1][2]) do
    local id, tenant, set = entry[1], known_tenant, known_set
    if id ~= known_id then tenant, set = tenant_of(entry[2]), KEYS[2] end
    local start = math.max(clock, tonumber(redis.call('HGET', KEYS[4], tenant) or '0'))
    redis.call('HSET', KEYS[4], tenant, start + 1)
    redis.call('ZADD', set, start, id .. '|' .. tenant)
    redis.call('HINCRBY', KEYS[3], tenant, 1)
  end
end
-- a daemon's jobs held now: the live count, else what its last beat said
local function load_of(daemon, d)
  local live = redis.call('HGET', KEYS[8], daemon)
  if live then return math.max(0, tonumber(live)) end
  return tonumber(d.held) or 0
end
-- {{id -> entry}} of the fleet hash's daemons, and which of them are live and take jobs
local function live_fleet(oldest)
  local raw = redis.call('HGETALL', KEYS[7])
  local all, live = {{}}, {{}}
  for i = 1, #raw, 2 do
    local ok, d = pcall(cjson.decode, raw[i + 1])
    if not ok or type(d) ~= 'table' then d = {{}} end
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
  for i = 1, #held, 2 do redis.call('ZADD', KEYS[2], held[i + 1], held[i]) end
  redis.call('DEL', key)
  return #held / 2
end
"""

# KEYS: the queue's (_queue_keys), the request's watch key, the route counters, the gate's
#       admitted sets (the model's, the tenant's)
# ARGV: the job's JSON, its tenant, the watch key's TTL (ms, 0: none), the stream's cap,
#       the request id, the routing (ROUTE_SHARED, ROUTE_CACHE_AWARE, ROUTE_ROUND_ROBIN), the oldest
#       heartbeat that counts, the balance thresholds (absolute, relative), the session's
#       key ("": none), the affinity summaries' key prefix, then the chain's hashes.
# Returns {entry id, reason, daemon or ""}, or false when the stream holds the cap already.
# Where the job goes (cache_aware): the daemon of its session, if that one is live; else
# the daemon whose summary holds the longest leading run of its chain; either only while
# that daemon is not busier than the least loaded by more than both thresholds (load: its
# jobs held at its last beat + those routed to it waiting); else the shared set, which any
# daemon takes from when it has room (the least loaded, in effect). One live daemon, or no
# chain and no session: the shared set ("fallback").
ENQUEUE = _COMMON + f"""
local prior = redis.call('GET', KEYS[13])  -- this request enqueued already: a resent call
if prior then return cjson.decode(prior) end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[4]) then return false end
if tonumber(ARGV[3]) > 0 then redis.call('SET', KEYS[9], 1, 'PX', ARGV[3]) end
redis.call('ZREM', KEYS[11], ARGV[5])  -- admitted by the gate: now it waits in the queue
redis.call('ZREM', KEYS[12], ARGV[5])
redis.pcall('XGROUP', 'CREATE', KEYS[1], '{JOBS_GROUP}', '0', 'MKSTREAM')  -- BUSYGROUP: there
local mode, reason, target = ARGV[6], 'fallback', nil
if mode ~= '{ROUTE_SHARED}' then
  local _, live = live_fleet(tonumber(ARGV[7]))
  local ids, load, least = {{}}, {{}}, nil
  for daemon, d in pairs(live) do
    ids[#ids + 1] = daemon
    load[daemon] = load_of(daemon, d) + redis.call('ZCARD', routed(daemon))
    if least == nil or load[daemon] < least then least = load[daemon] end
  end
  table.sort(ids)
  local abs, rel = tonumber(ARGV[8]), tonumber(ARGV[9])
  local function balanced(daemon)
    local l = load[daemon]
    return not (l - least > abs and l > rel * least)
  end
  if #ids >= 2 and mode == '{ROUTE_ROUND_ROBIN}' then
    local turn = redis.call('HINCRBY', KEYS[10], 'turn', 1)
    target, reason = ids[(turn % #ids) + 1], 'round_robin'
  elseif #ids >= 2 then
    if ARGV[10] ~= '' then
      local owner = redis.call('GET', ARGV[10])
      if owner and load[owner] and balanced(owner) then target, reason = owner, 'session' end
    end
    if target == nil and #ARGV >= 12 then
      local chain = {{}}
      for i = 12, #ARGV do chain[#chain + 1] = ARGV[i] end
      local best, best_run = nil, 0
      for _, daemon in ipairs(ids) do
        local has = redis.call('SMISMEMBER', ARGV[11] .. daemon, unpack(chain))
        local run = 0
        while run < #has and has[run + 1] == 1 do run = run + 1 end
        if run > best_run or (run == best_run and run > 0 and load[daemon] < load[best]) then
          best, best_run = daemon, run
        end
      end
      if best ~= nil then
        if balanced(best) then target, reason = best, 'affinity' else reason = 'least_loaded' end
      end
    end
    if target == nil and (reason == 'least_loaded' or ARGV[10] ~= '' or #ARGV >= 12) then
      -- the least loaded daemon, if it has room now (ties in turn); else the shared set,
      -- where the first daemon with room takes it
      reason = 'least_loaded'
      local tied = {{}}
      for _, daemon in ipairs(ids) do
        if load[daemon] == least then tied[#tied + 1] = daemon end
      end
      local pick = tied[(redis.call('HINCRBY', KEYS[10], 'turn', 1) % #tied) + 1]
      if least < (tonumber(live[pick].capacity) or 0) then target = pick end
    end
  end
end
local id = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1])
local set = KEYS[2]
if target ~= nil then set = routed(target) end
sweep(id, ARGV[2], set)
redis.call('XADD', KEYS[6], 'MAXLEN', '~', {BELL_MAXLEN}, '*', 'n', 1)
redis.call('HINCRBY', KEYS[10], reason, 1)
if target ~= nil then redis.call('HINCRBY', KEYS[10], reason .. ':' .. target, 1) end
local placed = {{id, reason, target or ''}}
redis.call('SET', KEYS[13], cjson.encode(placed), 'EX', {ENQUEUED_TTL_S})
return placed
"""

# KEYS: the queue's; ARGV: the daemon (consumer) id, how many jobs it can hold now (0:
# none, it only shows it is alive), the oldest heartbeat that counts, the take's sequence
# number ("0": none). Takes the lowest tag of its own routed set and the shared one, first
# moving back into the shared set what was routed to daemons that are gone or drained.
# Returns {entries, the bell's last id}: each entry {id, fields} as XCLAIM gives it, now
# pending under the daemon. A take with the sequence number of the daemon's last take that
# took jobs is that take sent again (its reply was lost: the jobs are pending under the
# daemon, which does not know them): it gets the same jobs back and takes no others.
TAKE = _COMMON + f"""
local function last_bell()
  local bell = redis.call('XREVRANGE', KEYS[6], '+', '-', 'COUNT', 1)
  if bell[1] then return bell[1][1] end
  return '0-0'
end
local memo_key, seq = KEYS[2] .. ':taken:' .. ARGV[1], ARGV[4]
if tonumber(ARGV[2]) > 0 and seq ~= '0' then
  local memo = redis.call('GET', memo_key)
  if memo then
    local m = cjson.decode(memo)
    if m[1] == seq then
      local again = {{}}
      for i = 2, #m do  -- those still pending under this daemon (not ended, not reclaimed)
        local mine = redis.call('XPENDING', KEYS[1], '{JOBS_GROUP}', m[i], m[i], 1, ARGV[1])
        local entry = redis.call('XRANGE', KEYS[1], m[i], m[i])
        if mine[1] and entry[1] then again[#again + 1] = entry[1] end
      end
      return {{again, last_bell()}}
    end
  end
end
sweep(nil, nil, nil)
local all, live = live_fleet(tonumber(ARGV[3]))
for daemon, _ in pairs(all) do
  if not live[daemon] and daemon ~= ARGV[1] then drain_back(daemon) end
end
redis.call('XGROUP', 'CREATECONSUMER', KEYS[1], '{JOBS_GROUP}', ARGV[1])
redis.call('XREADGROUP', 'GROUP', '{JOBS_GROUP}', ARGV[1], 'COUNT', 1, 'STREAMS', KEYS[1],
           '{_TOUCH_ID}')
local out = {{}}
local want = tonumber(ARGV[2])
local own = routed(ARGV[1])
while #out < want do
  local mine = redis.call('ZRANGE', own, 0, 0, 'WITHSCORES')
  local shared = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  local head, from = mine, own
  if #mine == 0 or (#shared > 0 and tonumber(shared[2]) < tonumber(mine[2])) then
    head, from = shared, KEYS[2]
  end
  if #head == 0 then break end
  local member, tag = head[1], head[2]
  redis.call('ZREM', from, member)
  redis.call('SET', KEYS[5], tag)
  local bar = string.find(member, '|', 1, true)
  local id, tenant = string.sub(member, 1, bar - 1), string.sub(member, bar + 1)
  if redis.call('HINCRBY', KEYS[3], tenant, -1) <= 0 then redis.call('HDEL', KEYS[3], tenant) end
  local claimed = redis.call('XCLAIM', KEYS[1], '{JOBS_GROUP}', ARGV[1], 0, id)
  if claimed[1] then out[#out + 1] = claimed[1] end  -- else deleted meanwhile
end
if #out > 0 then
  redis.call('HINCRBY', KEYS[8], ARGV[1], #out)
  if seq ~= '0' then
    local m = {{seq}}
    for i = 1, #out do m[#m + 1] = out[i][1] end
    redis.call('SET', memo_key, cjson.encode(m), 'EX', {TAKE_MEMO_TTL_S})
  end
end
if redis.call('HLEN', KEYS[3]) == 0 then
  -- nothing waits: forget the tags at or behind the clock (a tag there counts as none), so
  -- the hash holds only the tenants served last; the clock and the tags ahead of it stay,
  -- or a tenant whose job was just taken would tie the next tenant's first job
  local clock, tags = tonumber(redis.call('GET', KEYS[5]) or '0'), redis.call('HGETALL', KEYS[4])
  for i = 1, #tags, 2 do
    if tonumber(tags[i + 1]) <= clock then redis.call('HDEL', KEYS[4], tags[i]) end
  end
end
return {{out, last_bell()}}
"""

# KEYS: the queue's; ARGV: a daemon id, and "1" to take it out of the fleet as well. Its
# routed set back into the shared one (a daemon that stops, or whose dead entry is pruned);
# with "1", its fleet and load entries go in the same step: no job can be routed to it
# after, and none stays in a routed set no TAKE looks at (TAKE drains the routed sets of
# the daemons the fleet hash lists). Returns how many jobs moved.
DRAIN_BACK = _COMMON + """
local moved = drain_back(ARGV[1])
if ARGV[2] == '1' then
  redis.call('HDEL', KEYS[7], ARGV[1])
  redis.call('HDEL', KEYS[8], ARGV[1])
end
return moved
"""


@dataclass(frozen=True, slots=True)
class Route:
    """How ENQUEUE places one job: the routing, the thresholds, the job's session key and
    affinity chain (wire/affinity.py)."""

    mode: str = ROUTE_SHARED
    balance_abs: float = 4.0
    balance_rel: float = 1.5
    session_key: str = ""
    chain: tuple[str, ...] = ()
    summary_prefix: str = f"{PREFIX}:affinity:"

    def args(self, now: float) -> list[Any]:
        return [self.mode, repr(now - HEARTBEAT_TTL_S), self.balance_abs, self.balance_rel,
                self.session_key, self.summary_prefix, *self.chain]


@dataclass(frozen=True, slots=True)
class Placed:
    """Where ENQUEUE put a job: its entry id, why (ROUTE_REASONS), the daemon ("" shared)."""

    entry_id: str
    reason: str
    daemon: str


def enqueue_call(model: str, job_json: str, tenant_id: str, request_id: str, watch_key: str,
                 watch_ms: int, cap: int, route: Route | None = None,
                 now: float | None = None) -> tuple[str, list[str], list[Any]]:
    """(script, keys, args) of ENQUEUE, for a sync or an async client's ``eval``."""
    route = route or Route()
    now = time.time() if now is None else now
    keys = [*_queue_keys(model), watch_key, routes_key(model), admitted_key(model),
            tenant_admitted_key(model, tenant_id), enqueued_key(request_id)]  # KEYS[9] ..
    return ENQUEUE, keys, [job_json, tenant_id, watch_ms, cap, request_id, *route.args(now)]


def placed(reply: Any) -> Placed | None:
    """ENQUEUE's reply as a ``Placed`` (None: the stream was full)."""
    if not reply:
        return None
    entry_id, reason, daemon = (_text(v) for v in reply)
    return Placed(entry_id, reason, daemon)


def enqueue(client: Any, job: Job, watch_ms: int = 0, cap: int = JOBS_MAX_PENDING,
            route: Route | None = None) -> Placed | None:
    """ENQUEUE with a synchronous client (the web's async one: ``inference/broker.py``)."""
    script, keys, args = enqueue_call(job.model, job.encode()["job"], job.tenant_id, job.id,
                                      watch_key(job.id), watch_ms, cap, route)
    return placed(client.eval(script, len(keys), *keys, *args))


def take(client: Any, model: str, daemon_id: str, count: int,
         seq: int = 0) -> tuple[list[Any], str]:
    """Take up to ``count`` jobs (its routed ones and the shared ones, fair across tenants)
    for ``daemon_id``: ([(entry id, fields)], the bell's last id, to block on with
    ``wait_for_bell``). ``count`` 0 takes nothing and only marks the daemon's consumer as
    alive (and moves gone daemons' routed jobs back). ``seq``: the take's number, the same
    again after an error (the reply may be lost with the jobs it took: the same number
    gets them back), the next one after a reply (0: no such retries)."""
    keys = _queue_keys(model)
    entries, last = client.eval(TAKE, len(keys), *keys, daemon_id, max(0, int(count)),
                                repr(time.time() - HEARTBEAT_TTL_S), str(int(seq)))
    return [(entry[0], _fields(entry[1])) for entry in entries], _text(last)


def drain_back(client: Any, model: str, daemon_id: str, leave: bool = False) -> int:
    """Move the jobs routed to ``daemon_id`` back into the shared set; how many moved.
    ``leave``: and drop its fleet and load entries, atomically with the move."""
    keys = _queue_keys(model)
    return int(client.eval(DRAIN_BACK, len(keys), *keys, daemon_id, "1" if leave else "0"))


def waiting(client: Any, model: str) -> int:
    """Jobs waiting for the model: shared and routed (the gate counts the same)."""
    routed = [routed_key(model, _text(d)) for d in client.hkeys(fleet_key(model))]
    pipe = client.pipeline(transaction=False)
    for key in [ready_key(model), *routed]:
        pipe.zcard(key)
    return sum(pipe.execute())


def wait_for_bell(client: Any, model: str, after: str, block_ms: int = BELL_BLOCK_MS) -> bool:
    """Block until a job is enqueued after the bell entry ``after`` (True) or ``block_ms``
    pass (False)."""
    return bool(client.xread({bell_stream(model): after}, count=1, block=block_ms))


def _fields(flat: list[Any]) -> dict[Any, Any]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- the fleet: what the web's gate knows of each daemon ----------------------------------------


@dataclass(frozen=True, slots=True)
class FleetEntry:
    """One daemon, as its heartbeat writes it under ``fleet_key(model)``."""

    at: float  # unix seconds of the heartbeat (older than HEARTBEAT_TTL_S: not counted)
    taking: bool  # serving and not drained: its queue allowance counts
    max_queue: int  # MAX_QUEUE: jobs waiting for the model it adds to the gate's limit
    max_queue_per_tenant: int  # MAX_QUEUE_PER_TENANT: what it adds to a tenant's share
    drain_per_s: float  # jobs it took per second lately (the Retry-After's rate)
    capacity: int  # jobs it holds at most (slots + local queue)
    held: int  # jobs it holds now

    def encode(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))


# The gate, run first in the tenant-limits admission script (wire/limits.py ``admit``):
# KEYS[g], KEYS[g+1], KEYS[g+2] = ready, tenants, fleet; ARGV[a] .. ARGV[a+4] = tenant id,
# the tenant's own cap per daemon (-1: the daemons' MAX_QUEUE_PER_TENANT), the oldest
# heartbeat that counts (unix s), the codes for queue_full and tenant_queue_full, now, the
# request id; KEYS[g+3], KEYS[g+4]: the admitted sets (the model's, the tenant's); KEYS[g+5]
# the daemons' live load.
# Refuses with ``refuse_here(code, limit, how, retry, used)`` of the admission script. With no
# live daemon counted it admits: the web waits for one (a restart) as before.
def gate_lua(g: int, a: int) -> str:
    return f"""
do
  local fleet = redis.call('HGETALL', KEYS[{g + 2}])
  local live, cap, share, rate, free = 0, 0, 0, 0, 0
  for i = 1, #fleet, 2 do
    local ok, d = pcall(cjson.decode, fleet[i + 1])
    if ok and type(d) == 'table' and tonumber(d.at) and tonumber(d.at) >= tonumber(ARGV[{a + 2}])
        and d.taking == true then
      live = live + 1
      -- its queue allowance, and the room it had at its last beat (a burst after a quiet
      -- spell is not refused before the daemons could take it)
      local held = math.max(0, tonumber(redis.call('HGET', KEYS[{g + 5}], fleet[i]) or d.held) or 0)
      free = free + math.max(0, (tonumber(d.capacity) or 0) - held)
      cap = cap + (tonumber(d.max_queue) or 0)
      share = share + (tonumber(d.max_queue_per_tenant) or 0)
      rate = rate + (tonumber(d.drain_per_s) or 0)
    end
  end
  local hold = tonumber(ARGV[{a + 5}]) - {ADMIT_HOLD_S}
  redis.call('ZREMRANGEBYSCORE', KEYS[{g + 3}], '-inf', hold)
  redis.call('ZREMRANGEBYSCORE', KEYS[{g + 4}], '-inf', hold)
  if live > 0 then
    rate = math.max(rate, 0.1 * live)
    cap = cap + free
    local waiting = redis.call('ZCARD', KEYS[{g}]) + redis.call('ZCARD', KEYS[{g + 3}])
    for i = 1, #fleet, 2 do
      waiting = waiting + redis.call('ZCARD', KEYS[{g}] .. ':d:' .. fleet[i])
    end
    local function wait_s(n)
      return math.min({RETRY_AFTER_MAX_S}, math.max({RETRY_AFTER_MIN_S}, n / rate))
    end
    if waiting >= cap then
      return refuse_here(ARGV[{a + 3}], 'queue', 'full', wait_s(waiting), waiting)
    end
    local own = tonumber(ARGV[{a + 1}])
    if own >= 0 then share = own * live end
    share = share + free
    local mine = tonumber(redis.call('HGET', KEYS[{g + 1}], ARGV[{a}]) or '0')
    mine = mine + redis.call('ZCARD', KEYS[{g + 4}])
    if mine >= share then
      -- its own jobs at the fleet's drain rate: nothing of other tenants' queues goes into
      -- it, so a refusal's Retry-After cannot tell a tenant how many others have work queued
      return refuse_here(ARGV[{a + 4}], 'tenant_queue', 'full', wait_s(mine), mine)
    end
  end
end
"""


def gate_commit_lua(g: int, a: int) -> str:
    """Run where the admission script admits: the request counts as waiting until ENQUEUE."""
    return f"""
redis.call('ZADD', KEYS[{g + 3}], ARGV[{a + 5}], ARGV[{a + 6}])
redis.call('EXPIRE', KEYS[{g + 3}], {2 * ADMIT_HOLD_S})
redis.call('ZADD', KEYS[{g + 4}], ARGV[{a + 5}], ARGV[{a + 6}])
redis.call('EXPIRE', KEYS[{g + 4}], {2 * ADMIT_HOLD_S})
"""


def gate_keys(model: str, tenant_id: str) -> list[str]:
    return [ready_key(model), tenants_key(model), fleet_key(model), admitted_key(model),
            tenant_admitted_key(model, tenant_id), load_key(model)]


def gate_args(tenant_id: str, tenant_cap: int | None, now: float, ttl_s: float,
              queue_full: str, tenant_queue_full: str, request_id: str) -> list[Any]:
    return [tenant_id, -1 if tenant_cap is None else int(tenant_cap), repr(now - ttl_s),
            queue_full, tenant_queue_full, repr(now), request_id]


def unadmit(pipe: Any, model: str, tenant_id: str, request_id: str) -> None:
    """Queue on ``pipe``: a request the gate admitted will not be enqueued after all."""
    pipe.zrem(admitted_key(model), request_id)
    pipe.zrem(tenant_admitted_key(model, tenant_id), request_id)


def retry_after(waiting: int, drain_per_s: float) -> int:
    """The gate's Retry-After for ``waiting`` jobs ahead draining at ``drain_per_s`` (the
    Python twin of the Lua, for the docs and tests)."""
    rate = max(drain_per_s, 0.1)
    return int(math.ceil(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, waiting / rate))))
