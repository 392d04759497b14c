"""The model's waiting work in Redis: one fair queue for every daemon of the model.

A daemon takes a job only when it can hold it (a free slot or room in its small local
queue, ``intake.py``), so waiting work stays here, where any live daemon of the model can
take it, and the web decides ``queue_full`` from what this queue holds, before anything
else (the gate, run inside the tenant-limits admission script, wire/lua/admit.lua: one
round trip). The scripts are wire/lua/'s queue_head.lua followed by enqueue.lua (its header
states the routing), take_jobs.lua or drain_back.lua.

Keys (``<model>`` is the model's name):
Jobs     ``llm:jobs:<model>``             the jobs stream (wire/protocol.py), consumer group
                                          ``daemons``. A job waiting here is pending under
                                          the group's placeholder consumer ``HOLDER``; a
                                          daemon takes it by XCLAIM (then it is pending
                                          under the daemon, where the dead-daemon
                                          recovery finds it; it skips ``HOLDER``).
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
from .scripts import lua

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


# The scripts (wire/lua/, each headed by queue_head.lua: the queue's keys, _queue_keys, then
# _head_args). ENQUEUE's header states the routing: its algorithm and thresholds.
ENQUEUE = lua("enqueue")  # one job queued, routed (``enqueue_call``)
TAKE = lua("take_jobs")  # a daemon takes jobs (``take``)
DRAIN_BACK = lua("drain_back")  # a daemon's routed jobs back into the shared set


def _head_args() -> list[Any]:
    """ARGV[1..3] of every queue script (wire/lua/queue_head.lua)."""
    return [JOBS_GROUP, HOLDER, SWEEP_COUNT]


@dataclass(frozen=True, slots=True)
class Route:
    """How ENQUEUE places one job: the routing (``mode``), the balance thresholds, the
    job's session key and affinity chain (wire/affinity.py). The decision is
    ``route`` in wire/lua/enqueue.lua, whose header states it: the session's daemon, else
    the longest affinity match, each only while balanced (not busier than the least loaded
    by more than ``balance_abs`` jobs and ``balance_rel`` times), else the least loaded with
    room, else the shared set."""

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
    return ENQUEUE, keys, [*_head_args(), job_json, tenant_id, watch_ms, cap, request_id,
                           BELL_MAXLEN, ENQUEUED_TTL_S, *route.args(now)]


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
    entries, last = client.eval(TAKE, len(keys), *keys, *_head_args(), daemon_id,
                                max(0, int(count)), repr(time.time() - HEARTBEAT_TTL_S),
                                str(int(seq)), _TOUCH_ID, TAKE_MEMO_TTL_S)
    return [(entry[0], _fields(entry[1])) for entry in entries], _text(last)


def drain_back(client: Any, model: str, daemon_id: str, leave: bool = False) -> int:
    """Move the jobs routed to ``daemon_id`` back into the shared set; how many moved.
    ``leave``: and drop its fleet and load entries, atomically with the move."""
    keys = _queue_keys(model)
    return int(client.eval(DRAIN_BACK, len(keys), *keys, *_head_args(), daemon_id,
                           "1" if leave else "0"))


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


# The gate: run first in the admission script (wire/lua/admit.lua, given these keys and
# args), it refuses queue_full when the jobs waiting for the model (and those admitted, not
# yet enqueued) reach the live daemons' MAX_QUEUE summed plus the room they had free, and
# tenant_queue_full when the tenant's reach its share; admitting, it holds the request's
# place (the admitted sets) until ENQUEUE, or ADMIT_HOLD_S.
def gate_keys(model: str, tenant_id: str) -> list[str]:
    """KEYS[8..13] of wire/lua/admit.lua."""
    return [ready_key(model), tenants_key(model), fleet_key(model), admitted_key(model),
            tenant_admitted_key(model, tenant_id), load_key(model)]


def gate_args(tenant_id: str, tenant_cap: int | None, now: float, ttl_s: float,
              queue_full: str, tenant_queue_full: str) -> list[Any]:
    """ARGV[17..24] of wire/lua/admit.lua (``ttl_s``: a heartbeat's)."""
    return [tenant_id, -1 if tenant_cap is None else int(tenant_cap), repr(now - ttl_s),
            queue_full, tenant_queue_full, ADMIT_HOLD_S, RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]


def unadmit(pipe: Any, model: str, tenant_id: str, request_id: str) -> None:
    """Queue on ``pipe``: a request the gate admitted will not be enqueued after all."""
    pipe.zrem(admitted_key(model), request_id)
    pipe.zrem(tenant_admitted_key(model, tenant_id), request_id)


def retry_after(waiting: int, drain_per_s: float) -> int:
    """The gate's Retry-After for ``waiting`` jobs ahead draining at ``drain_per_s`` (the
    Python twin of the Lua, for the docs and tests)."""
    rate = max(drain_per_s, 0.1)
    return int(math.ceil(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, waiting / rate))))
