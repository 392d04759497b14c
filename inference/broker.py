"""The web side of the Redis wire (key names and shapes: ``wire/protocol.py``).

Async functions serve the streaming views and the websocket consumer (``redis.asyncio``,
one client per event loop); the ``*_sync`` ones serve plain DRF views (health, models,
cancel). ``settings.REDIS_URL`` is read when a client is made, never at import time.
"""
from __future__ import annotations

import asyncio
import json
import time
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis
import redis.asyncio as aredis
from django.conf import settings
from redis.asyncio import retry as aretry
from redis.backoff import NoBackoff
from redis.driver_info import DriverInfo

from config.env import env_float
from inference.errors import ApiError
from inference.stream_reader import Follower, StreamReader
from wire import affinity, errors, ownership, protocol, queue
from wire.backoff import Backoff

T = TypeVar("T")

SOCKET_TIMEOUT_S = 10.0  # above any XREAD BLOCK we issue

# Redis connections of one web process (one event loop), and how they are shared. Every
# reader of a request's stream (a streamed or waited-for request, an SSE or websocket
# resume) is a follower of the process's one stream reader (inference/stream_reader.py):
# one connection of its own, one XREAD BLOCK over every followed stream. Everything else
# holds a pooled connection for a round trip. Each reader holds a place in the process
# (``take_place``) from before it is admitted to its end: past its tenant's share of the
# places, or past the readers one request may have, it is refused with 429
# ``too_many_streams``; past ``max_readers`` with 503 ``service_unavailable``. A short
# command that waits over ``pool_timeout_s`` for a connection is a 503 too, never a 500.
# Defaults of the settings of the same names:
WEB_REDIS_MAX_CONNECTIONS = 128  # the async pool's size (redis-py's default: 100)
WEB_MAX_STREAMS = 512  # readers open at once per process; past it: 503
# WEB_TENANT_STREAMS: one tenant's readers in a process; unset (or 0): this share of
# WEB_MAX_STREAMS, so that three tenants at their share leave room for a fourth
TENANT_STREAMS_SHARE = 4
WEB_READERS_PER_REQUEST = 4  # readers of one request at once: its stream and a few resumes
WEB_REDIS_POOL_TIMEOUT_S = 5.0  # how long a command waits for a free connection
POOL_RETRY_S = 0.01  # how often a command waiting for a connection looks again
BUSY_RETRY_AFTER_S = 1
# Redis away (a restart: AOF keeps the queue and the streams): a reader of a request's
# stream and its liveness checks retry with backoff (wire/backoff.py) this long, then
# RedisDown ends the request typed. New requests are refused at once (503, Retry-After).
REDIS_OUTAGE_S = 10.0
OUTAGE_RETRY_AFTER_S = 5
# Heartbeat keys expire while Redis is away longer than their TTL, and a live daemon
# publishes its own again within a heartbeat interval of Redis answering: a check that
# lived through an outage waits this long before it takes a missing key for a dead daemon.
RESTART_SETTLE_S = protocol.HEARTBEAT_TTL_S


class RedisBusy(ApiError, redis.ConnectionError):
    """503 ``service_unavailable``: this web process has no Redis capacity left right now.
    An ApiError (answered as such by the views and the websocket) and a ConnectionError
    (code that tolerates Redis being away tolerates this too)."""

    def __init__(self, message: str) -> None:
        super().__init__("service_unavailable", message,
                         headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})


class RedisDown(ApiError, redis.ConnectionError):
    """503 ``service_unavailable``: Redis does not answer (down, restarting) or refused a
    write. An ApiError (answered as such by the views and the websocket) and a
    ConnectionError (code that tolerates Redis being away tolerates this too)."""

    def __init__(self, message: str = "The service's queue (Redis) is not answering; "
                 "try again shortly.") -> None:
        super().__init__("service_unavailable", message,
                         headers={"Retry-After": str(OUTAGE_RETRY_AFTER_S)})


@dataclass(frozen=True, slots=True)
class PoolConfig:
    max_connections: int
    max_readers: int
    pool_timeout_s: float
    tenant_readers: int  # one tenant's readers at most
    request_readers: int  # one request's readers at most

    @classmethod
    def from_settings(cls) -> PoolConfig:
        max_readers = max(1, int(setting("WEB_MAX_STREAMS", WEB_MAX_STREAMS)))
        tenant_readers = int(setting("WEB_TENANT_STREAMS", 0) or 0)
        if tenant_readers <= 0:
            tenant_readers = max(1, max_readers // TENANT_STREAMS_SHARE)
        return cls(
            max_connections=max(1, int(setting("WEB_REDIS_MAX_CONNECTIONS",
                                               WEB_REDIS_MAX_CONNECTIONS))),
            max_readers=max_readers,
            pool_timeout_s=float(setting("WEB_REDIS_POOL_TIMEOUT_S", WEB_REDIS_POOL_TIMEOUT_S)),
            tenant_readers=tenant_readers,
            request_readers=max(1, int(setting("WEB_READERS_PER_REQUEST",
                                               WEB_READERS_PER_REQUEST))),
        )


def setting(name: str, default: float) -> float:
    """``settings.<name>`` if set, else the environment variable ``<name>``, else
    ``default`` (for knobs of the web's own that config/settings.py does not list)."""
    value = getattr(settings, name, None)
    return env_float(name, default) if value is None else value


class _Pool(aredis.ConnectionPool):
    """A pool of at most ``max_connections`` whose exhaustion waits up to ``wait_s`` for a
    connection to come back, then is a 503 (RedisBusy), not redis-py's MaxConnectionsError.
    (Not redis-py's BlockingConnectionPool: with it, cancelling a task blocked in XREAD was
    sometimes lost under Python 3.11, and a closed socket left its request running.)"""

    def __init__(self, *args: Any, wait_s: float = WEB_REDIS_POOL_TIMEOUT_S,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_s = wait_s

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        deadline = None
        while True:
            try:
                return await super().get_connection(*args, **kwargs)
            except redis.exceptions.MaxConnectionsError as exc:
                now = time.monotonic()
                deadline = deadline or now + self.wait_s
                if now >= deadline:
                    raise RedisBusy("This server has no Redis connection free right now; "
                                    "try again shortly.") from exc
                await asyncio.sleep(POOL_RETRY_S)


@dataclass(slots=True)
class _LoopState:
    """One event loop's (one web process's) Redis clients and reader accounting."""

    config: PoolConfig
    clients: dict[str, aredis.Redis] = field(default_factory=dict)
    stream_readers: dict[str, StreamReader] = field(default_factory=dict)
    readers: int = 0  # places held (``take_place``)
    tenant_readers: dict[str, int] = field(default_factory=dict)  # tenant id -> places
    request_readers: dict[str, int] = field(default_factory=dict)  # request id -> places
    # (tenant id, request id) of places dropped unreleased, queued by their finalizers (on
    # any thread) for the loop, which gives them back before it next reads the counts
    dropped: deque[tuple[str, str]] = field(default_factory=deque)


_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = (
    weakref.WeakKeyDictionary()
)
_sync_clients: dict[str, redis.Redis] = {}


def _state() -> _LoopState:
    loop = asyncio.get_running_loop()
    state = _loops.get(loop)
    if state is None:
        config = PoolConfig.from_settings()
        state = _loops[loop] = _LoopState(config)
    return state


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One entry of a request's events stream; ``entry_id`` is None for a synthetic one."""

    entry_id: str | None
    kind: str
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        return self.kind in protocol.TERMINAL


# redis-py's version as a new connection names it (CLIENT SETINFO): given, not looked up
# in the installed package's metadata by every new connection (a burst grows the pool by a
# connection a request, and the lookup, a file read and an email-header parse, was 7% of a
# web process's CPU in a burst of 256 streams)
DRIVER_INFO = DriverInfo(lib_version=redis.__version__)
# After a Redis restart every idle pooled connection is dead, and the asyncio pool hands
# them out unchecked (it sees the server's close only once it has read it): one retry on a
# fresh connection, at once; a Redis that is really away fails that one too.
STALE_CONNECTION_RETRY = aretry.Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))


def async_client() -> aredis.Redis:
    """The running loop's client for settings.REDIS_URL (its pool: ``PoolConfig``)."""
    state = _state()
    url = settings.REDIS_URL
    if url not in state.clients:
        pool = _Pool.from_url(
            url, max_connections=state.config.max_connections,
            wait_s=state.config.pool_timeout_s, socket_timeout=SOCKET_TIMEOUT_S,
            socket_connect_timeout=2, retry=STALE_CONNECTION_RETRY, driver_info=DRIVER_INFO,
        )
        state.clients[url] = aredis.Redis(connection_pool=pool)
    return state.clients[url]


def stream_reader() -> StreamReader:
    """The running loop's reader of request streams for settings.REDIS_URL."""
    state = _state()
    url = settings.REDIS_URL
    if url not in state.stream_readers:
        state.stream_readers[url] = StreamReader(
            # a pool of one (not single_connection_client, whose __del__ closes its
            # connection on a loop that may be gone)
            connect=lambda: aredis.Redis(connection_pool=aredis.ConnectionPool.from_url(
                url, max_connections=1, socket_timeout=SOCKET_TIMEOUT_S,
                socket_connect_timeout=2, retry=STALE_CONNECTION_RETRY,
                driver_info=DRIVER_INFO)),
            waker=async_client, decode=_stream_event)
    return state.stream_readers[url]


def _stream_event(entry_id: str, fields: Any) -> StreamEvent:
    kind, data = protocol.decode_event(fields)
    return StreamEvent(entry_id, kind, data)


@contextmanager
def reader(request_id: str, after: str = "0-0") -> Iterator[Follower]:
    """An open reader of a request's stream: a follower of the process's stream reader
    (pass it to ``read_events``); left on exit. Its place in the process is the caller's
    (``take_place``)."""
    shared = stream_reader()
    follower = shared.follow(protocol.events_stream(request_id), after)
    try:
        yield follower
    finally:
        shared.leave(follower)


class ReaderPlace:
    """A reader's place in this process, counted for the process, its tenant and its
    request until ``release``: once, however often it is called (a ``with`` block, a
    ``finally``). A place dropped unreleased (a reply nobody iterated) is given back once it
    is collected: its finalizer, which may run on any thread (cyclic GC), only queues it
    (``_LoopState.dropped``); the counts change on the event loop alone."""

    __slots__ = ("tenant_id", "request_id", "_state", "_dropped", "__weakref__")

    def __init__(self, state: _LoopState, tenant_id: str, request_id: str) -> None:
        self.tenant_id = tenant_id
        self.request_id = request_id
        self._state = state
        self._dropped = weakref.finalize(self, state.dropped.append, (tenant_id, request_id))
        self._dropped.atexit = False

    @property
    def held(self) -> bool:
        return self._dropped.alive

    def release(self) -> None:
        """Give the place back now (on its event loop); a no-op once given back."""
        if self._dropped.detach() is not None:
            _leave_place(self._state, self.tenant_id, self.request_id)

    def __enter__(self) -> ReaderPlace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# Reader places refused by this process, by code (too_many_streams, service_unavailable):
# /metrics' llm_stream_refusals_total.
place_refusals: dict[str, int] = {errors.TOO_MANY_STREAMS: 0, errors.SERVICE_UNAVAILABLE: 0}


def take_place(tenant_id: str, request_id: str) -> ReaderPlace:
    """A place for one more reader of ``request_id`` (the tenant's), checked and counted in
    one step (no await between: concurrent readers never overshoot a cap). Raises ApiError
    429 ``too_many_streams`` when the tenant holds its share of the process's places
    (``tenant_readers``) or the request has ``request_readers`` readers already, RedisBusy
    (503) when the process holds ``max_readers``."""
    state = _counted_state()
    config = state.config
    tenant = state.tenant_readers.get(tenant_id, 0)
    if tenant >= config.tenant_readers:
        raise _too_many(f"This tenant is streaming {tenant} requests and resumes on this "
                        "server, its share; wait for one to end.")
    readers = state.request_readers.get(request_id, 0)
    if readers >= config.request_readers:
        raise _too_many(f"This request already has {readers} readers on this server, its "
                        "most at once; close one first.")
    if state.readers >= config.max_readers:
        place_refusals[errors.SERVICE_UNAVAILABLE] += 1
        raise RedisBusy(f"This server is streaming {state.readers} requests, its most; "
                        "try again shortly.")
    state.readers += 1
    state.tenant_readers[tenant_id] = tenant + 1
    state.request_readers[request_id] = readers + 1
    return ReaderPlace(state, tenant_id, request_id)


def _counted_state() -> _LoopState:
    """The running loop's state, the places dropped since its last count given back."""
    state = _state()
    while state.dropped:  # only the loop pops; finalizers only append (deque: thread-safe)
        _leave_place(state, *state.dropped.popleft())
    return state


def _leave_place(state: _LoopState, tenant_id: str, request_id: str) -> None:
    state.readers -= 1
    for counts, key in ((state.tenant_readers, tenant_id), (state.request_readers, request_id)):
        left = counts.get(key, 0) - 1
        if left > 0:
            counts[key] = left
        else:
            counts.pop(key, None)


def _too_many(message: str) -> ApiError:
    place_refusals[errors.TOO_MANY_STREAMS] += 1
    return ApiError(errors.TOO_MANY_STREAMS, message,
                    headers={"Retry-After": str(BUSY_RETRY_AFTER_S)},
                    retry_after_s=BUSY_RETRY_AFTER_S)


def open_readers(tenant_id: str | None = None) -> int:
    """Reader places held in this process now (the tenant's, with ``tenant_id``)."""
    state = _counted_state()
    return state.readers if tenant_id is None else state.tenant_readers.get(tenant_id, 0)


def sync_client() -> redis.Redis:
    """A thread-safe client (connection pool) for settings.REDIS_URL."""
    url = settings.REDIS_URL
    if url not in _sync_clients:
        _sync_clients[url] = redis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=2
        )
    return _sync_clients[url]


# -- daemons -------------------------------------------------------------------------------


def _snapshots(raws: list[bytes | None]) -> list[dict[str, Any]]:
    out = []
    for raw in raws:
        if raw:
            try:
                out.append(json.loads(raw))
            except ValueError:
                continue
    return out


async def live_daemons() -> list[dict[str, Any]]:
    """Snapshots of daemons whose heartbeat key still exists."""
    client = async_client()
    ids = await client.zrange(protocol.DAEMONS_ZSET, 0, -1)
    if not ids:
        return []
    return _snapshots(await client.mget([protocol.daemon_key(protocol.as_text(i)) for i in ids]))


def live_daemons_sync() -> list[dict[str, Any]]:
    """``live_daemons`` for sync code."""
    client = sync_client()
    ids = client.zrange(protocol.DAEMONS_ZSET, 0, -1)
    if not ids:
        return []
    return _snapshots(client.mget([protocol.daemon_key(protocol.as_text(i)) for i in ids]))


def send_command_sync(daemon_id: str, action: str, **args: Any) -> str:
    """Append an operator command (drain, resume, evict_scope) to one daemon's control
    stream; returns the entry id. The daemon applies it between ticks."""
    entry = sync_client().xadd(
        protocol.control_stream(daemon_id), protocol.encode_command(action, **args),
        maxlen=1000, approximate=True,
    )
    return protocol.as_text(entry)


_seen_served: dict[str, float] = {}  # model -> when a live daemon was last seen serving it


async def live_models(patient: bool = True) -> set[str]:
    """Models at least one live daemon serves. ``patient``: a reader's check, which waits out
    an outage (``_settled``); else Redis errors are raised at once (a new request)."""
    return (await _models(patient))[0]


async def taking_models() -> tuple[set[str], set[str]]:
    """(models a live daemon serves, models a live daemon takes jobs for now: serving, not
    drained or stopping), waiting out an outage."""
    return await _models(True)


async def _models(patient: bool) -> tuple[set[str], set[str]]:
    snapshots = await (_settled(live_daemons) if patient else live_daemons())
    models = {snap.get("model", "") for snap in snapshots}
    taking = {snap.get("model", "") for snap in snapshots if snap.get("state") == "serving"}
    now = time.monotonic()
    _seen_served.update(dict.fromkeys(models, now))
    return models, taking


async def is_served(model: str, max_age_s: float = 0.0) -> bool:
    """Whether a live daemon serves ``model``; a yes read at most ``max_age_s`` ago is
    reused (the snapshots are read and parsed otherwise). A no is always read afresh."""
    seen = _seen_served.get(model)
    if seen is not None and time.monotonic() - seen <= max_age_s:
        return True
    if model in await live_models(patient=False):
        return True
    if seen is None:
        return False
    # Served before: Redis may have restarted a moment ago, its daemons' heartbeats (expired
    # while it was away) not yet back. Asked again once they must be.
    uptime_s = (await async_client().info("server"))["uptime_in_seconds"]
    if uptime_s >= RESTART_SETTLE_S:
        return False
    await asyncio.sleep(RESTART_SETTLE_S - uptime_s)
    return model in await live_models(patient=False)


async def daemon_alive(daemon_id: str) -> bool:
    """Whether the daemon's heartbeat key exists (waiting out an outage: ``_settled``)."""
    key = protocol.daemon_key(daemon_id)
    return bool(await _settled(lambda: async_client().exists(key)))


async def _settled(call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` (a liveness check), retried while Redis is away; when it lived through an
    outage, asked again RESTART_SETTLE_S later (heartbeats expired meanwhile come back)."""
    result, outage = await _through_outage(call)
    if outage:
        await asyncio.sleep(RESTART_SETTLE_S)
        result, _ = await _through_outage(call)
    return result


async def _through_outage(call: Callable[[], Awaitable[T]]) -> tuple[T, bool]:
    """``call()``'s result, retried with backoff while Redis is away, and whether it was;
    RedisDown when Redis stays away REDIS_OUTAGE_S."""
    outage = Backoff()
    while True:
        try:
            result = await call()
        except ApiError:
            raise  # RedisBusy: this process's own capacity, not an outage
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            await _wait_out(outage, exc)
            continue
        return result, outage.succeeded() is not None


async def _wait_out(outage: Backoff, error: Exception) -> None:
    """Sleep before the next try (raise RedisDown instead once REDIS_OUTAGE_S are gone)."""
    delay = outage.failed(error)
    left = REDIS_OUTAGE_S - outage.failing_for()
    if left <= 0:
        raise RedisDown() from error
    await asyncio.sleep(min(delay, left))


# -- jobs, events, cancels -------------------------------------------------------------------


async def enqueue(job: protocol.Job, watch_ms: int = 0) -> None:
    """Queue a job for the daemons of its model, in the model's fair queue (wire/queue.py).
    Raises ApiError 503 when the model's jobs stream already holds JOBS_MAX_PENDING jobs
    (no daemon keeps up with it). ``watch_ms`` > 0: the request's watch key
    (inference/watch.py) is written with that TTL in the same script, before the job
    exists: one round trip, and no daemon sees it unwatched."""
    script, keys, args = queue.enqueue_call(
        job.model, job.encode()["job"], job.tenant_id, job.id, protocol.watch_key(job.id),
        watch_ms, protocol.JOBS_MAX_PENDING, route_of(job))
    added = queue.placed(await async_client().eval(script, len(keys), *keys, *args))
    if added is None:
        raise ApiError("service_unavailable",
                       f"{protocol.JOBS_MAX_PENDING} requests are already waiting for the "
                       f"model {job.model!r}; try again shortly.",
                       headers={"Retry-After": str(BUSY_RETRY_AFTER_S)})


async def unadmit(model: str, tenant_id: str, request_id: str) -> None:
    """Give up the place the gate held for a request that will not be enqueued (never
    raises: the place lapses by itself after ``queue.ADMIT_HOLD_S``)."""
    try:
        pipe = async_client().pipeline(transaction=False)
        queue.unadmit(pipe, model, tenant_id, request_id)
        await pipe.execute()
    except redis.RedisError:
        pass


def route_of(job: protocol.Job) -> queue.Route:
    """How the enqueue places ``job`` in a fleet (settings ROUTING, ROUTE_BALANCE_ABS,
    ROUTE_BALANCE_REL; wire/lua/enqueue.lua's header says what each does)."""
    session = (affinity.session_key(job.model, job.session_hash) if job.session_hash
               else "")
    return queue.Route(
        mode=str(getattr(settings, "ROUTING", queue.ROUTE_CACHE_AWARE)),
        balance_abs=float(getattr(settings, "ROUTE_BALANCE_ABS", 4)),
        balance_rel=float(getattr(settings, "ROUTE_BALANCE_REL", 1.5)),
        session_key=session, chain=tuple(job.affinity or ()),
        summary_prefix=affinity.summary_key(""))


async def read_events(
    request_id: str, after: str, block_ms: int, count: int | None = None,
    follower: Follower | None = None,
) -> list[StreamEvent]:
    """Entries after ``after`` ("0-0": from the start), waiting up to ``block_ms`` for the
    first, through the process's stream reader (``follower``: the caller's from
    ``reader``; without one, the call follows the stream for its own duration).

    Redis away (a restart): retried with backoff; RedisDown (503 ``service_unavailable``)
    once it has been away REDIS_OUTAGE_S. After an outage an empty read is returned only
    RESTART_SETTLE_S after Redis answered again: the caller then checks for a live daemon,
    whose heartbeat may have expired meanwhile (and whose events may wait in its buffer)."""
    if follower is None:
        with reader(request_id, after) as own:
            return await read_events(request_id, after, block_ms, count, own)
    shared = stream_reader()
    outage = Backoff()
    settle_until = 0.0
    while True:
        try:
            events = await shared.read(follower, after, block_ms, count)
        except ApiError:
            raise  # RedisBusy: this process's own capacity, not an outage
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            await _wait_out(outage, exc)
            continue
        finally:
            _raise_if_cancelled()
        if outage.succeeded() is not None:
            settle_until = time.monotonic() + RESTART_SETTLE_S
        if events or time.monotonic() >= settle_until:
            return events


def _raise_if_cancelled() -> None:
    """Python 3.11's ``asyncio.wait_for`` (redis-py sends commands through it) can swallow a
    cancellation that lands as the command completes; the task stays marked as cancelling.
    A reader checks after each read, so a lost cancel costs at most one read, not a stream."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def first_event(request_id: str) -> StreamEvent | None:
    """The stream's first entry (its ``accepted``, naming the daemon), if any."""
    stream = protocol.events_stream(request_id)
    return _only(await async_client().xrange(stream, count=1))


async def last_event(request_id: str) -> StreamEvent | None:
    """The stream's latest entry, if any."""
    stream = protocol.events_stream(request_id)
    return _only(await async_client().xrevrange(stream, count=1))


def _only(entries: list[tuple[Any, Any]]) -> StreamEvent | None:
    if not entries:
        return None
    entry_id, fields = entries[0]
    kind, data = protocol.decode_event(fields)
    return StreamEvent(protocol.as_text(entry_id), kind, data)


async def stream_exists(request_id: str) -> bool:
    return bool(await async_client().exists(protocol.events_stream(request_id)))


async def publish_cancel(request_id: str) -> None:
    """Durable flag (checked before a job starts) plus a pub/sub nudge (in-flight work)."""
    pipe = async_client().pipeline(transaction=False)
    pipe.set(protocol.cancel_key(request_id), 1, ex=protocol.CANCEL_TTL_S)
    pipe.publish(protocol.CANCEL_CHANNEL, request_id)
    await pipe.execute()


def publish_cancel_sync(request_id: str) -> None:
    """``publish_cancel`` for sync code."""
    pipe = sync_client().pipeline(transaction=False)
    pipe.set(protocol.cancel_key(request_id), 1, ex=protocol.CANCEL_TTL_S)
    pipe.publish(protocol.CANCEL_CHANNEL, request_id)
    pipe.execute()


async def give_up(request_id: str, owner: str, message: str) -> bool:
    """End a request with ``inference_interrupted`` if ``owner`` (a dead daemon; "" for
    none) still owns it: no daemon took it over within RECOVERY_TIMEOUT_S. One script, so a
    daemon continuing it meanwhile and this call cannot both win (wire/ownership.py). True
    when this call wrote the end."""
    keys, args = ownership.give_up_args(request_id, owner, message,
                                        int(setting("STREAM_RETENTION_S",
                                                    protocol.STREAM_RETENTION_S)))
    return bool(await async_client().eval(ownership.GIVE_UP, len(keys), *keys, *args))


async def owner_of(request_id: str) -> str | None:
    """The request's owner now (a daemon id, "web"), None when it has none."""
    owner = await async_client().get(protocol.owner_key(request_id))
    return None if owner is None else protocol.as_text(owner)
