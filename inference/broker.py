"""The web side of the Redis wire (key names and shapes: ``scheduler_daemon/protocol.py``).

Async functions serve the streaming views and the websocket consumer (``redis.asyncio``,
one client per event loop); the ``*_sync`` ones serve plain DRF views (health, models,
cancel). ``settings.REDIS_URL`` is read when a client is made, never at import time.
"""
from __future__ import annotations

import asyncio
import json
import time
import weakref
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio as aredis
from django.conf import settings

from scheduler_daemon import protocol

SOCKET_TIMEOUT_S = 10.0  # above any XREAD BLOCK we issue

_async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, aredis.Redis]] = (
    weakref.WeakKeyDictionary()
)
_sync_clients: dict[str, redis.Redis] = {}


@dataclass(frozen=True, slots=True)
class StreamEvent:
    """One entry of a request's events stream; ``entry_id`` is None for a synthetic one."""

    entry_id: str | None
    kind: str
    data: dict[str, Any]

    @property
    def is_terminal(self) -> bool:
        return self.kind in protocol.TERMINAL


def async_client() -> aredis.Redis:
    """The running loop's client for settings.REDIS_URL."""
    per_loop = _async_clients.setdefault(asyncio.get_running_loop(), {})
    url = settings.REDIS_URL
    if url not in per_loop:
        per_loop[url] = aredis.Redis.from_url(
            url, socket_timeout=SOCKET_TIMEOUT_S, socket_connect_timeout=2
        )
    return per_loop[url]


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
    return _snapshots(await client.mget([protocol.daemon_key(_text(i)) for i in ids]))


def live_daemons_sync() -> list[dict[str, Any]]:
    """``live_daemons`` for sync code."""
    client = sync_client()
    ids = client.zrange(protocol.DAEMONS_ZSET, 0, -1)
    if not ids:
        return []
    return _snapshots(client.mget([protocol.daemon_key(_text(i)) for i in ids]))


def send_command_sync(daemon_id: str, action: str, **args: Any) -> str:
    """Append an operator command (drain, resume, evict_scope) to one daemon's control
    stream; returns the entry id. The daemon applies it between ticks."""
    entry = sync_client().xadd(
        protocol.control_stream(daemon_id), protocol.encode_command(action, **args),
        maxlen=1000, approximate=True,
    )
    return _text(entry)


_seen_served: dict[str, float] = {}  # model -> when a live daemon was last seen serving it


async def live_models() -> set[str]:
    """Models at least one live daemon serves."""
    models = {snap.get("model", "") for snap in await live_daemons()}
    now = time.monotonic()
    _seen_served.update(dict.fromkeys(models, now))
    return models


async def is_served(model: str, max_age_s: float = 0.0) -> bool:
    """Whether a live daemon serves ``model``; a yes read at most ``max_age_s`` ago is
    reused (the snapshots are read and parsed otherwise). A no is always read afresh."""
    seen = _seen_served.get(model)
    if seen is not None and time.monotonic() - seen <= max_age_s:
        return True
    return model in await live_models()


async def daemon_alive(daemon_id: str) -> bool:
    return bool(await async_client().exists(protocol.daemon_key(daemon_id)))


# -- jobs, events, cancels -------------------------------------------------------------------


async def enqueue(job: protocol.Job) -> None:
    """Queue a job for the daemons of its model."""
    await async_client().xadd(
        protocol.jobs_stream(job.model), job.encode(),
        maxlen=protocol.JOBS_MAXLEN, approximate=True,
    )


async def read_events(
    request_id: str, after: str, block_ms: int, count: int | None = None
) -> list[StreamEvent]:
    """Entries after ``after`` ("0-0": from the start), blocking up to ``block_ms``."""
    reply = await async_client().xread(
        {protocol.events_stream(request_id): after}, count=count, block=block_ms
    )
    events = []
    for _stream, entries in reply or []:
        for entry_id, fields in entries:
            kind, data = protocol.decode_event(fields)
            events.append(StreamEvent(_text(entry_id), kind, data))
    return events


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
    return StreamEvent(_text(entry_id), kind, data)


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


async def write_interrupted(request_id: str, message: str) -> bool:
    """End a request's stream with ``inference_interrupted``, unless someone else already
    did (SET NX guard shared with the daemons). True when this call wrote it."""
    client = async_client()
    won = await client.set(
        protocol.interrupted_key(request_id), "web", nx=True, ex=protocol.EVENTS_TTL_S
    )
    if not won:
        return False
    stream = protocol.events_stream(request_id)
    data = {"code": protocol.INFERENCE_INTERRUPTED, "message": message, "finish_reason": "error"}
    pipe = client.pipeline(transaction=False)
    pipe.xadd(stream, protocol.encode_event(protocol.ERROR, data))
    pipe.expire(stream, protocol.EVENTS_TTL_AFTER_END_S)
    await pipe.execute()
    return True


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
