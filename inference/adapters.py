"""Tenants' adapters seen from the web: a request's adapter resolved, daemons told to unload a
deleted one, which daemons hold one loaded (docs/adapters.md).

A request names an adapter as ``"model": "<base>:<name>"`` or ``"lora": {"name": ...}``; it
resolves to the calling tenant's own ``Adapter`` row for that base model, nothing else. An
adapter of another tenant and a name nobody registered get the same answer as an unknown
model (404 ``model_not_found``, ``The model '<name>' does not exist.``): no oracle.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from inference import broker, db
from inference.errors import invalid, model_not_found
from inference.models import ADAPTER_NAME, Adapter
from wire import protocol

if TYPE_CHECKING:
    from accounts.models import ApiKey
    from inference.openai_request import ParsedRequest

log = logging.getLogger(__name__)

CACHE_TTL_S = 2.0  # a lookup is reused this long in a process (a deletion: at most this late)
CACHE_MAX_ENTRIES = 4096
LOADED_TTL_S = 1.0  # the admin's "loaded on" column reads the snapshots at most this often


@dataclass(frozen=True, slots=True)
class Found:
    """An adapter row as a job needs it."""

    key: str
    path: str
    sha256: str
    default_scale: float


_cache: dict[tuple[int, str, str], tuple[float, Found | None]] = {}
_cache_lock = threading.Lock()


def lookup(tenant_id: int, model: str, name: str) -> Found | None:
    """The tenant's adapter ``name`` for ``model`` (on the database thread), else None.
    Reused for CACHE_TTL_S; a name no adapter may have is not looked up."""
    if not model or ADAPTER_NAME.match(name) is None:
        return None
    cache_key = (tenant_id, model, name)
    with _cache_lock:
        hit = _cache.get(cache_key)
    if hit is not None and time.monotonic() - hit[0] < CACHE_TTL_S:
        return hit[1]
    row = Adapter.objects.filter(tenant_id=tenant_id, model=model, name=name).first()
    found = None
    if row is not None:
        adapter = row.job_adapter()
        found = Found(row.key, adapter["path"], row.sha256, row.default_scale)
    with _cache_lock:
        if len(_cache) >= CACHE_MAX_ENTRIES:
            _cache.clear()
        _cache[cache_key] = (time.monotonic(), found)
    return found


def forget(tenant_id: int) -> None:
    """Drop this process's lookups of a tenant (its adapters changed)."""
    with _cache_lock:
        for cache_key in [k for k in _cache if k[0] == tenant_id]:
            del _cache[cache_key]


async def resolve(api_key: ApiKey, parsed: ParsedRequest) -> None:
    """Set ``parsed.adapter`` (and the base model) from what the request named: 400 for a
    ``lora`` naming another adapter than the model's alias, 404 ``model_not_found`` for an
    adapter the key's tenant does not have for that base model."""
    alias, lora = parsed.alias_name, parsed.lora_name
    if alias is not None and await _is_base_name(parsed.model_sent):
        # a model whose name holds ':': no adapter (nor one in its shown name)
        parsed.model, parsed.alias_name, alias = parsed.model_sent, None, None
    if alias is not None and lora is not None and lora != alias:
        raise invalid("lora", f"lora names the adapter {lora!r} but model names {alias!r}; "
                              "name one adapter (or send the base model's name).")
    name = alias if alias is not None else lora
    if name is None:
        return
    parsed.adapter_name = name
    found = await db.run(lookup, api_key.tenant_id, parsed.model, name)
    if found is None:
        sent = parsed.model_sent if alias is not None else f"{parsed.model}:{name}"
        raise model_not_found(sent, "model" if alias is not None else "lora")
    scale = found.default_scale if parsed.lora_scale is None else parsed.lora_scale
    parsed.adapter = {"id": found.key, "path": found.path, "sha256": found.sha256,
                      "scale": float(scale)}


async def _is_base_name(model: str) -> bool:
    return model in settings.MODELS or await broker.is_served(model, 1.0)


def base_of(model: str) -> str:
    """The base model of a history row's ``model`` (``<base>:<adapter>`` or a base name)."""
    if ":" not in model or model in settings.MODELS:
        return model
    return model.rpartition(":")[0]


# -- daemons ---------------------------------------------------------------------------------


def live_daemons_of(model: str) -> list[str]:
    """The ids of the live daemons serving ``model``."""
    return sorted(str(s.get("daemon_id")) for s in broker.live_daemons_sync()
                  if s.get("model") == model and s.get("daemon_id"))


def unload(key: str, model: str) -> list[str]:
    """Record ``key`` deleted (``protocol.DELETED_ADAPTERS``: a daemon that starts later
    reads it) and send ``unload_adapter`` to every live daemon of ``model``; their ids."""
    now = time.time()
    client = broker.sync_client()
    pipe = client.pipeline(transaction=False)
    pipe.zadd(protocol.DELETED_ADAPTERS, {key: now})
    pipe.zremrangebyscore(protocol.DELETED_ADAPTERS, 0, now - protocol.DELETED_ADAPTERS_TTL_S)
    pipe.execute()
    daemons = live_daemons_of(model)
    for daemon_id in daemons:
        broker.send_command_sync(daemon_id, "unload_adapter", adapter=key)
    return daemons


def _unload_quietly(key: str, model: str) -> None:
    try:
        told = unload(key, model)
    except Exception:  # the row is gone: no request resolves to it; daemons evict it by LRU
        log.warning("could not send unload_adapter %s to the daemons of %s", key, model,
                    exc_info=True)
        return
    log.info("adapter %s deleted: unload_adapter sent to %s", key, told or "no live daemon")


@receiver(post_delete, sender=Adapter)
def _deleted(sender: type[Adapter], instance: Adapter, **kwargs: Any) -> None:
    """Whatever deletes a row (the admin, the command, its tenant's deletion): once the
    deletion is committed, the live daemons of its model unload it."""
    forget(instance.tenant_id)
    key, model = instance.key, instance.model
    transaction.on_commit(lambda: _unload_quietly(key, model))


_loaded: tuple[float, dict[str, list[str]]] = (0.0, {})


def loaded_on() -> dict[str, list[str]]:
    """Adapter key -> the live daemons whose snapshot lists it loaded (read at most once per
    LOADED_TTL_S; a daemon without adapters in its snapshot holds none)."""
    global _loaded
    at, found = _loaded
    if time.monotonic() - at < LOADED_TTL_S:
        return found
    found = {}
    for snap in broker.live_daemons_sync():
        for key in (snap.get("adapters") or {}).get("loaded") or ():
            found.setdefault(str(key), []).append(str(snap.get("daemon_id")))
    _loaded = (time.monotonic(), found)
    return found


def model_entries(tenant_id: int, served: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the tenant's adapters whose base model a daemon serves
    (``served``: the base models' entries), by base then name."""
    bases = {entry["id"]: entry for entry in served}
    rows = Adapter.objects.filter(tenant_id=tenant_id, model__in=list(bases)).select_related(
        "tenant").order_by("model", "name")
    return [{"id": str(row), "object": "model", "created": int(row.created.timestamp()),
             "owned_by": row.tenant.slug, "parent": row.model, "embeddings": False}
            for row in rows]
