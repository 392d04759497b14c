"""What /v1/health and /v1/models report, from the daemons' published snapshots.

/v1/health needs no key: to anyone it says only whether the service answers and which
models are up (``public_health``); with an API key or a staff session it also lists each
daemon's state (``health_report``: counts and names, never request ids or cache scopes).
"""

import asyncio
import json
import time
from typing import Any

import redis
from django.conf import settings

from inference import broker
from wire import protocol

OWNER = "llm-inference"


def health_report() -> dict[str, Any]:
    """A JSON-ready summary; answering at all means the web process is up."""
    daemons, redis_status = _live_daemons()
    return {
        "status": "ok",
        "redis": redis_status,
        "scheduler": _scheduler_status(daemons),
        "model": settings.MODELS[0],
        "models": sorted({d.get("model", "") for d in daemons}),
        "model_status": _model_status(daemons),
        "daemons": [_summary(d) for d in daemons],
    }


def public_health() -> dict[str, Any]:
    """What anyone may know: the service answers, and which models are up ("up": a live
    daemon serves it and its loop is not stuck; "down": none does), ``MODELS`` and any
    other model a daemon serves."""
    daemons, _ = _live_daemons()
    status = _model_status(daemons)
    return {
        "status": "ok",
        "models": sorted(name for name, state in status.items() if state == "up"),
        "model_status": status,
    }


def _live_daemons() -> tuple[list[dict[str, Any]], str]:
    try:
        return broker.live_daemons_sync(), "ok"
    except redis.RedisError:
        return [], "unavailable"


def _model_status(daemons: list[dict[str, Any]]) -> dict[str, str]:
    up = {d.get("model") for d in daemons if not _stuck(d)}
    names = dict.fromkeys([*settings.MODELS, *sorted({d.get("model") or "" for d in daemons})])
    return {name: "up" if name in up else "down" for name in names if name}


def _scheduler_status(daemons: list[dict[str, Any]]) -> str:
    """ok: a daemon serves; stuck: every live daemon's loop is stuck (its watchdog restarts
    it: requests wait, none is lost); unavailable: no daemon publishes."""
    if not daemons:
        return "unavailable"
    return "stuck" if all(_stuck(d) for d in daemons) else "ok"


def _stuck(snapshot: dict[str, Any]) -> bool:
    return bool((snapshot.get("loop") or {}).get("stuck"))


def _summary(snapshot: dict[str, Any]) -> dict[str, Any]:
    slots = snapshot.get("slots") or []
    loop = snapshot.get("loop") or {}
    return {
        "daemon_id": snapshot.get("daemon_id"),
        "model": snapshot.get("model"),
        "started_at": snapshot.get("started_at"),
        "heartbeat_age_s": round(time.time() - float(snapshot.get("heartbeat_at") or 0), 2),
        "slots_total": len(slots),
        "slots_busy": sum(1 for s in slots if s.get("state") != "idle"),
        "queue_depth": len(snapshot.get("queue") or []),
        "admitting": snapshot.get("admitting", True),
        "stuck": _stuck(snapshot),
        "loop_stalled_s": loop.get("stalled_s"),
        "restarts": snapshot.get("restarts", 0),
        "last_exit": snapshot.get("last_exit"),
    }


def model_list() -> list[dict[str, Any]]:
    """OpenAI ``model`` objects for the models live daemons serve (earliest start wins), in
    the order of ``MODELS``, then any other by name; each says whether it embeds, its
    default system prompt (a chat without a system message gets it; "" none) and how it
    shows tools (``chat_tools``: its template's tool-call format, or "generic")."""
    started: dict[str, float] = {}
    embeds: set[str] = set()
    defaults: dict[str, str] = {}
    snapshots = broker.live_daemons_sync()
    for snapshot in snapshots:
        name = snapshot.get("model")
        if name:
            at = float(snapshot.get("started_at") or time.time())
            if at <= started.get(name, at):  # the earliest daemon's word
                defaults[name] = str(snapshot.get("default_system_prompt") or "")
            started[name] = min(at, started.get(name, at))
            if snapshot.get("embeddings"):
                embeds.add(name)
    order = {name: i for i, name in enumerate(settings.MODELS)}  # the default model first
    tools = _families(snapshots)
    return [
        {"id": name, "object": "model", "created": int(at), "owned_by": OWNER,
         "embeddings": name in embeds, "default_system_prompt": defaults.get(name, ""),
         "chat_tools": tools.get(name) or "generic"}
        for name, at in sorted(started.items(), key=lambda item: (
            order.get(item[0], len(order)), item[0]))
    ]


CHAT_TOOLS_MAX_AGE_S = 1.0
# the first read of a process, made while its request waits (no value to serve yet): this
# long at most, the event loop stopped meanwhile; every later read runs beside the loop
CHAT_TOOLS_FIRST_READ_S = 0.25
_chat_tools: dict[str, str | None] = {}
_chat_tools_at = [-CHAT_TOOLS_MAX_AGE_S]  # when the values were read (monotonic)
_chat_tools_reading: list[asyncio.Task[None]] = []  # the read in flight (a reference kept)
_quick_clients: dict[str, redis.Redis] = {}


def chat_tools(model: str) -> str | None:
    """The tool-call format ``model``'s template renders tools in (``"hermes"``), when every
    live daemon of it says the same; None: tools go through the generic prompt (no daemon
    says one, they disagree, or Redis does not answer). The daemons' snapshots are read at
    most once a CHAT_TOOLS_MAX_AGE_S per process, by a request with tools. Inside an event
    loop (the views, the consumers) a stale value is served while a task reads the next one
    with the async client: a slow Redis never holds the loop (only a process's very first
    read waits, CHAT_TOOLS_FIRST_READ_S at most)."""
    if time.monotonic() - _chat_tools_at[0] > CHAT_TOOLS_MAX_AGE_S:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None:
            _keep_families(broker.live_daemons_sync)
        elif _chat_tools_at[0] < 0:  # nothing to serve yet
            _keep_families(_first_read)
        elif not _chat_tools_reading or _chat_tools_reading[0].done():
            _chat_tools_reading[:] = [loop.create_task(_read_families())]
    return _chat_tools.get(model)


async def fresh_chat_tools(body: Any) -> None:
    """Before a body with ``tools`` is parsed (``parse_request`` is synchronous and calls
    ``chat_tools``), by the async entry points: a view older than CHAT_TOOLS_MAX_AGE_S is
    read anew here, awaited with the async client (the loop goes on meanwhile), so that
    the request sees the daemons as they are, not the last read's view."""
    if not (isinstance(body, dict) and body.get("tools")):
        return
    if time.monotonic() - _chat_tools_at[0] > CHAT_TOOLS_MAX_AGE_S:
        await _read_families()


def _keep_families(read: Any) -> None:
    try:
        families = _families(read())
    except redis.RedisError:
        families = {}
    _store_families(families)


async def _read_families() -> None:
    try:
        families = _families(await broker.live_daemons())
    except Exception:  # Redis away or busy (the pool's own refusal): no family known
        families = {}
    _store_families(families)


def _store_families(families: dict[str, str | None]) -> None:
    _chat_tools.clear()
    _chat_tools.update(families)
    _chat_tools_at[0] = time.monotonic()


def _first_read() -> list[dict[str, Any]]:
    """The live daemons' snapshots, read with timeouts of CHAT_TOOLS_FIRST_READ_S."""
    url = settings.REDIS_URL
    if url not in _quick_clients:
        _quick_clients[url] = redis.Redis.from_url(
            url, socket_timeout=CHAT_TOOLS_FIRST_READ_S,
            socket_connect_timeout=CHAT_TOOLS_FIRST_READ_S)
    client = _quick_clients[url]
    ids = client.zrange(protocol.DAEMONS_ZSET, 0, -1)
    raws = client.mget([protocol.daemon_key(protocol.as_text(i)) for i in ids]) if ids else []
    snapshots = []
    for raw in raws:
        try:
            if raw:
                snapshots.append(json.loads(raw))
        except ValueError:
            continue
    return snapshots


def _families(snapshots: list[dict[str, Any]]) -> dict[str, str | None]:
    """model -> the ``chat_tools`` all its live daemons publish (None where they differ)."""
    seen: dict[str, set[str | None]] = {}
    for snapshot in snapshots:
        name = snapshot.get("model")
        if name:
            family = snapshot.get("chat_tools")
            seen.setdefault(name, set()).add(family if isinstance(family, str) else None)
    return {name: next(iter(found)) if len(found) == 1 else None
            for name, found in seen.items()}
