"""Prometheus metrics at /metrics (docs/observability.md).

Two sources, read at scrape time or kept here:
- every live daemon's published snapshot (``broker.live_daemons_sync()``): its counters
  since it started (labelled by daemon, so a restart is an ordinary counter reset; every
  one of them as ``llm_daemon_counter_total{name}``, the main ones also in families of
  their own), its queue, slots, KV blocks and RAM prompt cache;
- this web process: TTFT and end-to-end latency histograms, observed when a request it
  submitted ends (per process: each web process exports its own), and the limit refusals
  of every web process (a Redis hash written by the admission script).
No tenant labels anywhere: a tenant's numbers are the usage API's business.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from inference import broker, limits
from wire import queue
from wire.errors import error_body, type_of

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600)
CACHE_TIERS = ("slot", "cross_slot", "ram")
DAEMON_REFUSALS = {
    "refused_queue_full": "queue_full",
    "refused_context_length": "context_length_exceeded",
    "refused_device_memory_budget": "device_memory_budget_exceeded",
    "refused_tenant_queue_full": "tenant_queue_full",
}

# a daemon counter's name as the code spells it (a snapshot is the daemon's, never a tenant's
# text, but a name past this shape is not exported: the label set stays bounded)
COUNTER_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
# adapters are labelled by their public id only (never a tenant's name for one), at most
# MAX_ADAPTERS_PER_DAEMON of them per daemon and family
ADAPTER_ID = re.compile(r"ad_[0-9a-f]{16}")
MAX_ADAPTERS_PER_DAEMON = 256

REGISTRY = CollectorRegistry(auto_describe=True)
TTFT = Histogram(
    "llm_request_ttft_seconds",
    "Time from queueing to the first token.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
DURATION = Histogram(
    "llm_request_duration_seconds",
    "Time from queueing to the last event.",
    buckets=LATENCY_BUCKETS_S,
    registry=REGISTRY,
)
ENDED = Counter(
    "llm_web_requests",
    "Requests this web process saw end, by outcome.",
    ["status"],
    registry=REGISTRY,
)


def observe_end(data: dict[str, Any], kind: str) -> None:
    """A request this process submitted ended with ``data`` (a done or error event)."""
    status = data.get("finish_reason") if kind == "done" else data.get("code") or "error"
    ENDED.labels(status=str(status or "unknown")).inc()
    timings = data.get("timings") or {}
    if timings.get("ttft_ms") is not None:
        TTFT.observe(timings["ttft_ms"] / 1000)
    if timings.get("duration_ms") is not None:
        DURATION.observe(timings["duration_ms"] / 1000)


class DaemonCollector(Collector):
    """Metrics of every live daemon and of the shared limit refusals, read per scrape."""

    def collect(self) -> Iterator[Metric]:
        try:
            snapshots = broker.live_daemons_sync()
            refusals = limits.refusal_counts_sync()
        except Exception:  # a scrape must answer even when Redis does not
            log.warning("metrics: could not read Redis", exc_info=True)
            snapshots, refusals = [], {}
        yield from _daemon_metrics(snapshots)
        yield from _adapter_metrics(snapshots)
        yield _route_metrics(sorted({str(s.get("model")) for s in snapshots}))
        limit_refusals = CounterMetricFamily(
            "llm_limit_refusals", "Requests refused by tenant limits, by code.", labels=["code"]
        )
        for code in limits.REFUSAL_CODES:
            limit_refusals.add_metric([code], refusals.get(code, 0))
        yield limit_refusals
        queue_refusals = CounterMetricFamily(
            "llm_queue_refusals", "Requests the web refused for a full model queue (or a "
            "tenant's full share of it), by code: no daemon saw them.", labels=["code"])
        for code in limits.QUEUE_REFUSAL_CODES:
            queue_refusals.add_metric([code], refusals.get(code, 0))
        yield queue_refusals
        stream_refusals = CounterMetricFamily(
            "llm_stream_refusals", "Streams and resumes this web process refused, by code: "
            "a tenant's share of its streams or one request's readers (too_many_streams), or "
            "all its streams (service_unavailable).", labels=["code"])
        for code, count in sorted(broker.place_refusals.items()):
            stream_refusals.add_metric([code], count)
        yield stream_refusals


def _route_metrics(models: list[str]) -> Metric:
    """The web's routing decisions per model and reason (wire/queue.py ENQUEUE counts them
    in Redis: every web process's)."""
    family = CounterMetricFamily(
        "llm_route_decisions", "Where the web's enqueue put each job, by reason: its session's "
        "daemon, the longest affinity match, the shared queue (least_loaded), round_robin, or "
        "no routing (fallback).", labels=["model", "reason"])
    try:
        pipe = broker.sync_client().pipeline(transaction=False)
        for model in models:
            pipe.hgetall(queue.routes_key(model))
        decided = pipe.execute()
    except Exception:
        log.warning("metrics: could not read the route counters", exc_info=True)
        decided = [{} for _ in models]
    for model, counts in zip(models, decided, strict=True):
        for reason in queue.ROUTE_REASONS:
            family.add_metric([model, reason], int(counts.get(reason.encode(), 0)))
    return family


def _daemon_metrics(snapshots: list[dict[str, Any]]) -> Iterator[Metric]:
    labels = ["daemon", "model"]
    live = GaugeMetricFamily("llm_daemons", "Live scheduler daemons.", labels=["model"])
    finished = CounterMetricFamily(
        "llm_requests",
        "Requests a daemon finished, by finish reason.",
        labels=[*labels, "finish_reason"],
    )
    tokens = {
        kind: CounterMetricFamily(
            f"llm_{kind}_tokens", f"{kind.capitalize()} tokens of finished requests.", labels=labels
        )
        for kind in ("prompt", "completion", "cached")
    }
    lookups = CounterMetricFamily(
        "llm_prefix_cache_lookups", "Prefix cache lookups.", labels=labels
    )
    hits = CounterMetricFamily(
        "llm_prefix_cache_hits", "Prefix cache hits, by tier.", labels=[*labels, "tier"]
    )
    hit_tokens = CounterMetricFamily(
        "llm_prefix_cache_hit_tokens", "Prompt tokens reused, by tier.", labels=[*labels, "tier"]
    )
    refused = CounterMetricFamily(
        "llm_daemon_refusals", "Requests a daemon refused, by code.", labels=[*labels, "code"]
    )
    rejected = CounterMetricFamily(
        "llm_rejected_jobs",
        "Jobs a daemon answered with an error before starting them, by reason (a refusal "
        "code, malformed, internal_error).",
        labels=[*labels, "reason"],
    )
    request_failures = CounterMetricFamily(
        "llm_request_failures",
        "Requests that failed alone in the engine (sampler, grammar, decoding) while the "
        "others carried on.",
        labels=labels,
    )
    kv_pressure = CounterMetricFamily(
        "llm_kv_pressure_events", "llama_decode found the KV cache full.", labels=labels
    )
    every_counter = CounterMetricFamily(
        "llm_daemon_counter", "Every counter a daemon keeps (scheduler, prefix cache tiers), "
        "by name, since it started (docs/observability.md lists them).",
        labels=[*labels, "name"])
    queue = GaugeMetricFamily("llm_queue_depth", "Requests waiting for a slot.", labels=labels)
    active = GaugeMetricFamily("llm_active_slots", "Slots serving a request.", labels=labels)
    slots = GaugeMetricFamily("llm_slots", "Slots (parallel sequences).", labels=labels)
    blocks_used = GaugeMetricFamily("llm_kv_blocks_used", "KV blocks handed out.", labels=labels)
    blocks_total = GaugeMetricFamily("llm_kv_blocks", "KV blocks in the budget.", labels=labels)
    ram_bytes = GaugeMetricFamily(
        "llm_ram_cache_bytes", "Bytes held by the RAM prompt cache.", labels=labels
    )
    ram_budget = GaugeMetricFamily(
        "llm_ram_cache_budget_bytes", "The RAM prompt cache's budget.", labels=labels
    )
    stuck = GaugeMetricFamily(
        "llm_daemon_stuck", "1 while the daemon's loop has not turned for a while (its "
        "supervisor kills it at TICK_DEADLINE_S).", labels=labels)
    stalled = GaugeMetricFamily(
        "llm_daemon_loop_stalled_seconds", "Seconds since the daemon's loop last turned.",
        labels=labels)
    longest = GaugeMetricFamily(
        "llm_daemon_longest_turn_seconds", "The daemon's longest loop turn since it started.",
        labels=labels)
    restarts = GaugeMetricFamily(
        "llm_daemon_restarts", "Times the supervisor restarted this daemon id (crashes, hangs).",
        labels=labels)
    per_model: dict[str, int] = {}
    for snap in snapshots:
        key = [str(snap.get("daemon_id", "")), str(snap.get("model", ""))]
        per_model[key[1]] = per_model.get(key[1], 0) + 1
        counters = snap.get("counters") or {}
        for name, value in counters.items():
            if name.startswith("finished_"):
                finished.add_metric([*key, name.removeprefix("finished_")], value)
            if isinstance(name, str) and COUNTER_NAME.fullmatch(name):
                every_counter.add_metric([*key, name], value)
        for kind, family in tokens.items():
            family.add_metric(key, counters.get(f"{kind}_tokens", 0))
        lookups.add_metric(key, counters.get("cache_lookups", 0))
        for tier in CACHE_TIERS:
            hits.add_metric([*key, tier], counters.get(f"cache_hits_{tier}", 0))
            hit_tokens.add_metric([*key, tier], counters.get(f"cache_hit_tokens_{tier}", 0))
        for counter, code in DAEMON_REFUSALS.items():
            refused.add_metric([*key, code], counters.get(counter, 0))
        kv_pressure.add_metric(key, counters.get("kv_pressure", 0))
        for reason, count in (snap.get("rejected") or {}).items():
            rejected.add_metric([*key, str(reason)], count)
        request_failures.add_metric(key, counters.get("request_failures", 0))
        slot_list = snap.get("slots") or []
        queue.add_metric(key, len(snap.get("queue") or []))
        active.add_metric(key, sum(1 for s in slot_list if s.get("state") != "idle"))
        slots.add_metric(key, len(slot_list))
        kv = snap.get("kv") or {}
        blocks_used.add_metric(key, kv.get("blocks_used", 0))
        blocks_total.add_metric(key, kv.get("blocks_total", 0))
        cache = snap.get("cache") or {}
        ram_bytes.add_metric(key, cache.get("ram_bytes", 0))
        ram_budget.add_metric(key, cache.get("ram_budget_bytes", 0))
        loop = snap.get("loop") or {}
        stuck.add_metric(key, 1 if loop.get("stuck") else 0)
        stalled.add_metric(key, loop.get("stalled_s") or 0)
        longest.add_metric(key, loop.get("longest_turn_s") or 0)
        restarts.add_metric(key, snap.get("restarts") or 0)
    for model, n in per_model.items():
        live.add_metric([model], n)
    yield from (
        live,
        finished,
        *tokens.values(),
        lookups,
        hits,
        hit_tokens,
        refused,
        rejected,
        request_failures,
        kv_pressure,
        every_counter,
        queue,
        active,
        slots,
        blocks_used,
        blocks_total,
        ram_bytes,
        ram_budget,
        stuck,
        stalled,
        longest,
        restarts,
    )


def _adapter_metrics(snapshots: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per daemon and adapter id: loads, unloads, tokens served, and which are loaded now
    (a snapshot's ``adapters``; absent: none)."""
    labels = ["daemon", "model", "adapter"]
    counters = {
        "loads": CounterMetricFamily("llm_adapter_loads", "Times a daemon loaded an adapter.",
                                     labels=labels),
        "unloads": CounterMetricFamily("llm_adapter_unloads", "Times a daemon unloaded an "
                                       "adapter (LRU, or its deletion).", labels=labels),
        "tokens": CounterMetricFamily("llm_adapter_tokens", "Tokens a daemon computed under an "
                                      "adapter (prompt and generated).", labels=labels),
    }
    loaded = GaugeMetricFamily("llm_adapter_loaded", "1 for each adapter a daemon holds "
                               "loaded.", labels=labels)
    for snap in snapshots:
        key = [str(snap.get("daemon_id", "")), str(snap.get("model", ""))]
        found = snap.get("adapters")
        if not isinstance(found, dict):
            continue
        for field, family in counters.items():
            counts = found.get(field)
            if isinstance(counts, dict):
                for adapter, count in _adapter_ids(counts.items()):
                    family.add_metric([*key, adapter], count)
        ids = found.get("loaded")
        if isinstance(ids, list):
            for adapter, _ in _adapter_ids((i, 1) for i in ids):
                loaded.add_metric([*key, adapter], 1)
    yield from (*counters.values(), loaded)


def _adapter_ids(items: Iterable[tuple[Any, Any]]) -> list[tuple[str, float]]:
    """(id, number) pairs whose id is an adapter id and number a number, the first
    MAX_ADAPTERS_PER_DAEMON by id."""
    kept = {i: v for i, v in items if isinstance(i, str) and ADAPTER_ID.fullmatch(i)
            and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return sorted(kept.items())[:MAX_ADAPTERS_PER_DAEMON]


REGISTRY.register(DaemonCollector())


def refusal(request: HttpRequest) -> HttpResponse | None:
    """Why /metrics is not for this request, in the API's error shape, or None. With
    ``METRICS_TOKEN`` set: ``Authorization: Bearer <METRICS_TOKEN>``, else 401
    ``invalid_api_key``. Without: a client address (``REMOTE_ADDR``, the real client's
    behind the proxy: daphne's ``--proxy-headers``) in ``METRICS_ALLOWED_NETS``, else 403
    ``permission_denied``."""
    token = settings.METRICS_TOKEN
    if token:
        keyword, _, sent = request.headers.get("Authorization", "").partition(" ")
        if keyword.lower() == "bearer" and hmac.compare_digest(
                sent.strip().encode(), token.encode()):
            return None
        response = _error(401, "invalid_api_key",
                          "/metrics needs Authorization: Bearer <METRICS_TOKEN>.")
        response["WWW-Authenticate"] = "Bearer"
        return response
    if _address_allowed(request.META.get("REMOTE_ADDR", "")):
        return None
    return _error(403, "permission_denied", "/metrics is not served to your address.")


def _address_allowed(raw: str) -> bool:
    try:
        address = ipaddress.ip_address(raw)
    except ValueError:
        return False
    if address.version == 6 and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(
        address in ipaddress.ip_network(net, strict=False) for net in settings.METRICS_ALLOWED_NETS
    )


def _error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse(error_body(message, type_of(status), code), status=status)


def metrics_view(request: HttpRequest) -> HttpResponse:
    """GET /metrics: the Prometheus text format."""
    refused = refusal(request)
    if refused is not None:
        return refused
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)
