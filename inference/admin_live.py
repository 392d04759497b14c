"""Live admin pages: queue, slots, cache entries and daemons, from the daemons' snapshots;
the quarantine (requests present at two daemon deaths), from Redis.

The pages are plain admin templates that poll ``live/state.json`` about once a second;
the state is read from Redis only (``broker.live_daemons_sync``), so looking never slows
a daemon's decode loop. Actions (cancel, evict a tenant's cache, drain, resume) are
staff-only POSTs, each written to the admin log. No prompt or completion text appears.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from django.contrib import admin
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.db.models import Model
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import path
from django.views.decorators.http import require_POST, require_safe

from accounts.models import Tenant
from inference import broker
from inference.models import InferenceRequest
from wire import protocol, queue

_FINGERPRINT = re.compile(r"[0-9a-f]{64}")

PAGES = {"queue": "Queue", "slots": "Slots", "cache": "Cache entries", "daemons": "Daemons",
         "quarantine": "Quarantine"}
DAEMON_ACTIONS = {"drain", "resume", "evict_scope"}


class ActionRefused(Exception):
    """An admin action that cannot be done (unknown request, dead daemon, ...)."""


# -- state -----------------------------------------------------------------------------------


def tenant_pk(value: object) -> int | None:
    """A tenant primary key from text ("12"), or None: ASCII digits only (``str.isdigit``
    also takes "²", which ``int`` refuses), within a 64-bit key."""
    if not isinstance(value, str) or not (0 < len(value) <= 18):
        return None
    if not (value.isascii() and value.isdigit()):
        return None
    return int(value)


def tenant_names(scopes: set[str]) -> dict[str, str]:
    """cache_scope (str(tenant.id)) -> tenant name, for the scopes that name a tenant."""
    ids = {pk for pk in map(tenant_pk, scopes) if pk is not None}
    rows = Tenant.objects.filter(pk__in=ids).values_list("pk", "name")
    return {str(pk): name for pk, name in rows}


def _scopes(snaps: list[dict[str, Any]]) -> set[str]:
    found: set[str] = set()
    for snap in snaps:
        rows = [*(snap.get("slots") or []), *(snap.get("queue") or []),
                *(snap.get("preempted") or []),
                *((snap.get("cache") or {}).get("entries") or [])]
        found.update(str(r["cache_scope"]) for r in rows if r.get("cache_scope") is not None)
        found.update(str(t) for t in ((snap.get("fleet") or {}).get("taken_by_tenant") or {}))
    return found


def daemon_summary(snap: dict[str, Any], now: float) -> dict[str, Any]:
    """One daemon's row: liveness, settings, and counters boiled down."""
    counters = snap.get("counters") or {}
    prompt, cached = counters.get("prompt_tokens", 0), counters.get("cached_tokens", 0)
    cache = {k: v for k, v in (snap.get("cache") or {}).items() if k != "entries"}
    return {
        "daemon_id": snap.get("daemon_id"), "model": snap.get("model"),
        "host": snap.get("host"), "pid": snap.get("pid"),
        "heartbeat_age_s": round(now - snap.get("heartbeat_at", now), 2),
        "uptime_s": round(now - snap.get("started_at", now)),
        "draining": bool(snap.get("draining")), "admitting": snap.get("admitting"),
        "stuck": bool((snap.get("loop") or {}).get("stuck")),
        "loop_stalled_s": (snap.get("loop") or {}).get("stalled_s"),
        "restarts": snap.get("restarts", 0), "last_exit": snap.get("last_exit"),
        "config": snap.get("config") or {}, "kv": snap.get("kv") or {}, "cache": cache,
        "requests": sum(v for k, v in counters.items() if k.startswith("finished_")),
        "submitted": counters.get("submitted", 0),
        "prompt_tokens": prompt, "cached_tokens": cached,
        "completion_tokens": counters.get("completion_tokens", 0),
        "hit_ratio": round(cached / prompt, 3) if prompt else None,
        "kv_pressure": counters.get("kv_pressure", 0),
        "refusals": sum(v for k, v in counters.items() if k.startswith("refused_")),
        "slots_busy": sum(1 for s in snap.get("slots") or [] if s.get("state") != "idle"),
        "slots_total": len(snap.get("slots") or []),
        "queue_depth": len(snap.get("queue") or []),
    }


def live_state(snaps: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """Everything the live pages show, flattened to rows, tenants named."""
    now = time.time() if now is None else now
    quarantine = quarantined()
    names = tenant_names(_scopes(snaps) | {str(q.get("tenant_id")) for q in quarantine})
    state: dict[str, Any] = {"now": now, "daemons": [], "queue": [], "slots": [], "cache": []}

    def named(row: dict[str, Any], daemon_id: Any) -> dict[str, Any]:
        scope = row.get("cache_scope")
        scope = None if scope is None else str(scope)
        return {**row, "daemon_id": daemon_id, "cache_scope": scope,
                "tenant": names.get(scope or "", scope)}

    state["quarantine"] = [
        {**row, "tenant": names.get(str(row.get("tenant_id")), row.get("tenant_id"))}
        for row in quarantine
    ]
    fleet = fleet_view(snaps, names)
    for snap in sorted(snaps, key=lambda s: str(s.get("daemon_id"))):
        daemon_id = snap.get("daemon_id")
        state["daemons"].append({**daemon_summary(snap, now), **fleet.get(str(daemon_id), {})})
        state["queue"] += [named(q, daemon_id) for q in snap.get("queue") or []]
        state["queue"] += [{**named(q, daemon_id), "preempted": True}  # out of a slot a while
                           for q in snap.get("preempted") or []]
        state["slots"] += [{**named(s, daemon_id), "heartbeat_at": snap.get("heartbeat_at")}
                           for s in snap.get("slots") or []]
        entries = (snap.get("cache") or {}).get("entries") or []
        state["cache"] += [named(e, daemon_id) for e in entries]
    return state


def fleet_view(snaps: list[dict[str, Any]],
               names: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per daemon, how the fleet uses it (docs/fleet.md): the jobs it holds of what it can,
    the jobs routed to it and still waiting, the routing decisions that chose it (affinity
    hits), and its share of each tenant's jobs among the daemons of its model."""
    client = broker.sync_client()
    models = sorted({str(s.get("model")) for s in snaps})
    pipe = client.pipeline(transaction=False)
    for model in models:
        pipe.hgetall(queue.routes_key(model))
    for snap in snaps:
        pipe.zcard(queue.routed_key(str(snap.get("model")), str(snap.get("daemon_id"))))
    replies = pipe.execute()
    routes = {m: {protocol.as_text(k): int(v) for k, v in r.items()}
              for m, r in zip(models, replies[:len(models)], strict=True)}
    per_tenant: dict[tuple[str, str], int] = {}  # (model, tenant) -> jobs over its daemons
    for snap in snaps:
        for tenant, count in ((snap.get("fleet") or {}).get("taken_by_tenant") or {}).items():
            key = (str(snap.get("model")), str(tenant))
            per_tenant[key] = per_tenant.get(key, 0) + int(count)
    out = {}
    for snap, waiting in zip(snaps, replies[len(models):], strict=True):
        daemon, model = str(snap.get("daemon_id")), str(snap.get("model"))
        info = snap.get("fleet") or {}
        decided = routes.get(model, {})
        taken = info.get("taken_by_tenant") or {}
        out[daemon] = {
            "held": info.get("held"), "capacity": info.get("capacity"),
            "routed_waiting": waiting,
            "routed": sum(n for k, n in decided.items() if k.endswith(f":{daemon}")),
            "affinity_hits": decided.get(f"affinity:{daemon}", 0),
            "session_hits": decided.get(f"session:{daemon}", 0),
            "drain_per_s": info.get("drain_per_s"),
            "tenant_shares": {
                str(names.get(str(t), t)): round(int(n) / per_tenant[(model, str(t))], 3)
                for t, n in sorted(taken.items()) if per_tenant.get((model, str(t)))},
        }
    return out


def quarantined() -> list[dict[str, Any]]:
    """Requests that were running at two distinct daemon deaths (docs/daemon.md), newest first."""
    rows = []
    for fingerprint, raw in broker.sync_client().hgetall(protocol.QUARANTINE_HASH).items():
        try:
            record = json.loads(raw)
        except ValueError:
            record = {}
        if isinstance(record, dict):
            rows.append({**record, "fingerprint": _text(fingerprint)})
    return sorted(rows, key=lambda r: -float(r.get("at") or 0))


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# -- views -------------------------------------------------------------------------------------


def page_view(request: HttpRequest, page: str) -> HttpResponse:
    """A live page; its rows are drawn by admin_live.js from ``state.json``."""
    if page not in PAGES:
        raise Http404(page)
    context = {**admin.site.each_context(request), "title": f"Live: {PAGES[page]}",
               "page": page, "pages": PAGES}
    return render(request, "admin/live/page.html", context)


@require_safe
def state_view(request: HttpRequest) -> JsonResponse:
    """The live state as JSON (staff only, via admin_view)."""
    return JsonResponse(live_state(broker.live_daemons_sync()))


@require_POST
def action_view(request: HttpRequest) -> JsonResponse:
    """cancel (request_id), evict_scope (daemon_id, tenant_id), drain / resume (daemon_id),
    release (fingerprint: a quarantined request)."""
    action, form = request.POST.get("action", ""), request.POST
    try:
        if action == "cancel":
            message = cancel_request(request, form.get("request_id", ""))
        elif action == "release":
            message = release_quarantined(request, form.get("fingerprint", ""))
        elif action in DAEMON_ACTIONS:
            message = command_daemon(request, action, form.get("daemon_id", ""),
                                     form.get("tenant_id", ""))
        else:
            raise ActionRefused(f"Unknown action {action!r}.")
    except ActionRefused as refused:
        return JsonResponse({"ok": False, "message": str(refused)}, status=400)
    return JsonResponse({"ok": True, "message": message})


def cancel_request(request: HttpRequest, request_id: str) -> str:
    """Publish a cancel; the daemon ends the request with finish_reason ``cancelled``."""
    row = InferenceRequest.objects.filter(pk=request_id).first() if _is_uuid(request_id) else None
    active = row is not None and row.status in (InferenceRequest.Status.QUEUED,
                                                 InferenceRequest.Status.RUNNING)
    if not request_id or not (active or _is_running(request_id)):
        raise ActionRefused(f"No queued or running request {request_id!r}.")
    broker.publish_cancel_sync(request_id)
    log_action(request, f"Cancelled request {request_id}", row, repr_=f"request {request_id}")
    return f"Cancel sent for request {request_id}."


def release_quarantined(request: HttpRequest, fingerprint: str) -> str:
    """Let a quarantined request be run again (after the llama.cpp bug is fixed...)."""
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ActionRefused(f"Not a request fingerprint: {fingerprint!r}.")
    if not broker.sync_client().hdel(protocol.QUARANTINE_HASH, fingerprint):
        raise ActionRefused(f"No quarantined request {fingerprint}.")
    broker.sync_client().delete(protocol.deaths_key(fingerprint))
    log_action(request, f"Released quarantined request {fingerprint}", None,
               repr_=f"quarantine {fingerprint[:12]}")
    return f"Released {fingerprint[:12]}: it may run again."


def command_daemon(request: HttpRequest, action: str, daemon_id: str, tenant_id: str) -> str:
    """drain / resume / evict_scope on one live daemon, through its control stream."""
    if daemon_id not in {str(s.get("daemon_id")) for s in broker.live_daemons_sync()}:
        raise ActionRefused(f"No live daemon {daemon_id!r}.")
    tenant, args = None, {}
    if action == "evict_scope":
        pk = tenant_pk(tenant_id)
        tenant = Tenant.objects.filter(pk=pk).first() if pk is not None else None
        if tenant is None:
            raise ActionRefused(f"No tenant {tenant_id!r}.")
        args = {"scope": str(tenant.pk)}
    broker.send_command_sync(daemon_id, action, **args)
    what = f"{action} {tenant.name}'s cache" if tenant else action
    log_action(request, f"Sent {what} to daemon {daemon_id}", tenant, repr_=f"daemon {daemon_id}")
    return f"Sent {action} to daemon {daemon_id}."


def log_action(request: HttpRequest, message: str, obj: Model | None, repr_: str) -> None:
    """A CHANGE entry in the admin log, attached to ``obj`` when there is one."""
    LogEntry.objects.create(
        user_id=request.user.pk, action_flag=CHANGE, change_message=message,
        content_type=ContentType.objects.get_for_model(obj) if obj is not None else None,
        object_id=str(obj.pk) if obj is not None else None,
        object_repr=(str(obj) if obj is not None else repr_)[:200],
    )


def _is_running(request_id: str) -> bool:
    for snap in broker.live_daemons_sync():
        rows = [*(snap.get("slots") or []), *(snap.get("queue") or [])]
        if any(r.get("request_id") == request_id for r in rows):
            return True
    return False


def _is_uuid(value: str) -> bool:
    if not value.isascii():  # uuid.UUID takes any Unicode digits ("٠" * 32)
        return False
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def urls() -> list[Any]:
    """URL patterns for config/urls.py, every view behind ``admin_view`` (staff only)."""
    wrap = admin.site.admin_view
    return [
        path("state.json", wrap(state_view), name="admin-live-state"),
        path("action", wrap(action_view), name="admin-live-action"),
        path("<slug:page>/", wrap(page_view), name="admin-live"),
    ]
