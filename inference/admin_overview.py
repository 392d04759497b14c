"""The operator's overview (/admin/overview/, staff only): the whole service over time.

Read from the time series the daemons keep in Redis (wire/timeseries.py; docs/observability.md,
"The operator's overview"): one range (``?range=`` 1h, 6h, 24h or 7d) read in at most a few
hundred buckets, drawn as server-made SVG charts (console/charts.py), each with its data as a
table. Tenants are named by their slug from the database; no prompt or completion text.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import redis
from django.conf import settings
from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_safe

from accounts.models import Tenant
from console import charts
from inference import broker
from inference.admin_live import tenant_pk
from wire import timeseries

DEFAULT_RANGE = "1h"
LABEL_FORMATS = {10: "%H:%M:%S", 60: "%H:%M", 300: "%H:%M", 1800: "%m-%d %H:%M"}


def _labels(starts: Sequence[int], step: int) -> list[str]:
    """Each bucket's start in the site's time zone."""
    form = LABEL_FORMATS.get(step, "%m-%d %H:%M")
    return [timezone.localtime(datetime.fromtimestamp(s, tz=UTC)).strftime(form) for s in starts]


def _chart(title: str, labels: list[str], series: dict[str, list[Any]], *, kind: str = "line",
           unit: str = "") -> dict[str, Any]:
    """A chart and its table (the rows with data only: a quiet hour is no row)."""
    if kind == "line":
        svg = charts.line_chart(labels, series, title=title, unit=unit)
    else:
        svg = charts.bar_chart(labels, series, stacked=kind == "stacked", title=title, unit=unit)
    rows = [i for i in range(len(labels)) if any(values[i] for values in series.values())]
    table = charts.table([labels[i] for i in rows],
                         {name: [values[i] for i in rows] for name, values in series.items()},
                         unit=unit, caption=title)
    has_data = bool(rows)
    return {"title": title, "svg": svg, "table": table, "has_data": has_data}


def tenant_slugs(ids: Sequence[str]) -> dict[str, str]:
    """tenant id (text) -> its slug, for the ids that name a tenant."""
    pks = {pk for pk in map(tenant_pk, ids) if pk is not None}
    return {str(pk): slug for pk, slug in Tenant.objects.filter(pk__in=pks)
            .values_list("pk", "slug")}


def build_charts(view: timeseries.Overview) -> list[dict[str, Any]]:
    """The overview's charts, in order, from a range's series."""
    labels = _labels(view.starts, view.step)
    running_waiting = {}
    for model in sorted(view.running.keys() | view.waiting.keys()):
        running_waiting[f"{model} running"] = view.running.get(model, [None] * len(labels))
        running_waiting[f"{model} waiting"] = view.waiting.get(model, [None] * len(labels))
    slugs = tenant_slugs([t for t, _ in view.top_tenants])
    tenant_names = [("others" if t == timeseries.OTHER_TENANTS else slugs.get(t, f"#{t}"))
                    for t, _ in view.top_tenants]
    return [
        _chart("Tokens per second", labels,
               {"prompt": view.tokens_per_s["prompt"],
                "generated": view.tokens_per_s["completion"]}),
        _chart("Queue depth per model (waiting in Redis)", labels, dict(view.queued)),
        _chart("Running and waiting requests per model", labels, running_waiting),
        _chart("Time to first token", labels, view.ttft_ms, unit=" ms"),
        _chart("Prefix cache hit ratio (cached share of prompt tokens)", labels,
               {"hit ratio": [None if v is None else round(v * 100, 1)
                              for v in view.cache_hit_ratio]}, unit="%"),
        _chart("Refusals by code", labels, dict(view.refusals), kind="stacked"),
        _chart(f"Top tenants by tokens (top {timeseries.TOP_TENANTS})", tenant_names,
               {"tokens": [n for _, n in view.top_tenants]}, kind="bars"),
    ]


@require_safe
def _overview(request: HttpRequest) -> HttpResponse:
    chosen = request.GET.get("range", DEFAULT_RANGE)
    if chosen not in timeseries.RANGES_S:
        chosen = DEFAULT_RANGE
    retention_s = settings.TIMESERIES_RETENTION_S
    error, view = None, None
    try:
        view = timeseries.read(broker.sync_client(), timeseries.RANGES_S[chosen], time.time(),
                               retention_s)
    except redis.RedisError as exc:
        error = f"Redis did not answer: {exc}"
    context = {
        **admin.site.each_context(request), "title": "Operator's overview",
        "ranges": list(timeseries.RANGES_S), "range": chosen, "error": error,
        "charts": build_charts(view) if view else [], "step_s": view.step if view else None,
        "retention_h": round(retention_s / 3600, 1),
        "summary": _summary(view) if view else None,
    }
    return render(request, "admin/overview.html", context)


def _summary(view: timeseries.Overview) -> dict[str, Any]:
    return {"prompt_tokens": sum(view.tokens["prompt"]),
            "completion_tokens": sum(view.tokens["completion"]),
            "requests": sum(view.requests), "ttft": view.ttft_range_ms,
            "refusals": sum(sum(v) for v in view.refusals.values()),
            "daemons": max(view.daemons, default=0)}


overview = admin.site.admin_view(_overview)
