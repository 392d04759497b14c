"""Telemetry: what the daemon does, as one JSON object per log line (docs/observability.md).

Every line goes to the ``scheduler_daemon.telemetry`` logger and names its ``event``; each
event has fixed fields (``FIELDS``, null where a value is unknown), after the common ones
(``COMMON``). No prompt or output text ever: counts, ids, times. ``run_scheduler`` gives the
logger a queue-backed handler (``install_handler``) that writes the message alone, so a hook
that runs with the scheduler's lock held, or on the disk writer's thread, only formats a
small dict and puts a record on a queue.

The hooks, and the thread each runs on:
- ``on_tick`` (loop thread, after a committed tick): ``request.start`` for each request whose
  prompt this tick first computed, and a sampled ``tick`` (at most one per ``tick_every_s``);
- ``on_kv_pressure`` (loop thread, lock held): ``kv_pressure``;
- ``on_cache_event`` (loop thread with the lock held; the disk writer's thread for disk
  saves): ``cache`` and ``prefix_instability``;
- ``on_event`` (core listener, lock held): a finished request forgotten;
- ``request_end`` (the event writer's thread, once the end is written): ``request.done`` or
  ``request.exception``, then each of ``end_listeners`` (the time series' sampler,
  scheduler_daemon/service/timeseries.py) with the same arguments.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any

from ..core.plan import Phase, TickPlan
from ..core.state import CacheEvent, Event, FinishedEvent, Status, TickStats

LOGGER = "scheduler_daemon.telemetry"
log = logging.getLogger(LOGGER)

COMMON = ("event", "ts", "daemon_id", "model")
_END = ("request_id", "tenant_id", "finish_reason", "error_code", "prompt_tokens",
        "cached_tokens", "completion_tokens", "queue_ms", "ttft_ms", "duration_ms",
        "prompt_eval_rate", "generation_rate", "resumed")
FIELDS: dict[str, tuple[str, ...]] = {
    "request.start": ("request_id", "tenant_id", "seq_id", "prompt_tokens", "cached_tokens",
                      "cache_tier", "queue_ms"),
    "request.done": _END,
    "request.exception": _END,
    "tick": ("tick", "batch_tokens", "decode_tokens", "prefill_tokens", "active_slots",
             "queue_depth", "eval_ms", "kv_retries", "ticks", "tokens"),
    "kv_pressure": ("tick", "retry", "remedy", "batch_tokens", "next_batch_tokens"),
    "cache": ("tier", "op", "bytes", "tokens", "entries", "reason"),
    "prefix_instability": ("request_id", "matched_tokens", "cached_tokens"),
}
CACHE_OPS = ("save", "restore", "evict", "reject")
QUEUE_LINES = 65536  # lines waiting for the handler's thread; past this they are dropped


class Telemetry:
    """The daemon's telemetry events; one per daemon, shared by the parts that report."""

    def __init__(
        self,
        daemon_id: str,
        model: str,
        tick_every_s: float = 1.0,
        tenant_of: Callable[[str], str | None] = lambda _request_id: None,
        cache_entries: Callable[[str], int | None] = lambda _tier: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``tick_every_s``: at most one ``tick`` line per this many seconds (0: every
        tick). ``tenant_of``: a request id's tenant; ``cache_entries``: a tier's entry count
        after an operation (both cheap, callable from any thread)."""
        self.daemon_id = daemon_id
        self.model = model
        self.tick_every_s = tick_every_s
        self.tenant_of = tenant_of
        self.cache_entries = cache_entries
        self._clock = clock
        self._next_tick_at = 0.0
        self._ticks = 0  # ticks since the last tick line
        self._tokens = 0  # and their batch tokens
        self._started: set[str] = set()  # requests whose request.start is out (loop thread)
        # called with request_end's arguments after its line (cheap; a failure is logged)
        self.end_listeners: list[Callable[[str, str, dict[str, Any], str | None], None]] = []

    def emit(self, event: str, **fields: Any) -> None:
        """One line: the common fields, then ``event``'s fixed fields (missing ones null)."""
        names = FIELDS[event]
        extra = fields.keys() - set(names)
        if extra:
            raise ValueError(f"{event} has no field {sorted(extra)}")
        line = {"event": event, "ts": round(time.time(), 3), "daemon_id": self.daemon_id,
                "model": self.model, **{name: fields.get(name) for name in names}}
        log.info(json.dumps(line, separators=(",", ":")))

    # -- the loop thread ------------------------------------------------------------------

    def on_tick(self, stats: TickStats, plan: TickPlan | None) -> None:
        """After a committed tick: ``request.start`` for the requests whose first prompt
        tokens ``plan`` computed, and the sampled ``tick`` line."""
        try:
            if plan is not None and plan.tick == stats.tick:
                self._starts(plan)
            self._ticks += 1
            self._tokens += stats.batch_tokens
            now = self._clock()
            if now < self._next_tick_at:
                return
            self._next_tick_at = now + self.tick_every_s
            self.emit("tick", tick=stats.tick, batch_tokens=stats.batch_tokens,
                      decode_tokens=stats.decode_tokens, prefill_tokens=stats.prefill_tokens,
                      active_slots=stats.active_slots, queue_depth=stats.queue_depth,
                      eval_ms=round(stats.eval_ms, 2), kv_retries=stats.kv_retries,
                      ticks=self._ticks, tokens=self._tokens)
            self._ticks = self._tokens = 0
        except Exception:  # telemetry never breaks the loop
            logging.getLogger(__name__).exception("telemetry: the tick hook failed")

    def _starts(self, plan: TickPlan) -> None:
        for planned in plan.rows:
            if planned.phase is not Phase.PREFILL:
                continue
            req = planned.request
            request_id = req.id.split("#", 1)[0]  # a choice of several: its request's id
            if request_id in self._started:
                continue
            if req.status < Status.FINISHED_STOPPED:  # else it ended this tick: nothing to forget
                self._started.add(request_id)
            queue_ms = (None if req.t_started is None
                        else round((req.t_started - req.arrival) * 1000, 1))
            self.emit("request.start", request_id=request_id,
                      tenant_id=self.tenant_of(request_id), seq_id=planned.seq_id,
                      prompt_tokens=len(req.prompt), cached_tokens=req.cached_tokens,
                      cache_tier=req.cache_tier, queue_ms=queue_ms)

    def on_kv_pressure(self, tick: int, retry: int, remedy: str, batch_tokens: int,
                       next_batch_tokens: int) -> None:
        """``llama_decode`` found the KV cache full (scheduler lock held): ``remedy`` is
        purge_idle, halve_batch or fail_largest."""
        try:
            self.emit("kv_pressure", tick=tick, retry=retry, remedy=remedy,
                      batch_tokens=batch_tokens, next_batch_tokens=next_batch_tokens)
        except Exception:
            logging.getLogger(__name__).exception("telemetry: the kv_pressure hook failed")

    def on_event(self, event: Event) -> None:
        """Core listener (lock held): a finished request's start is forgotten."""
        if isinstance(event, FinishedEvent):
            self._started.discard(event.request_id)

    # -- the loop thread (lock held) or the disk writer's ----------------------------------

    def on_cache_event(self, event: CacheEvent) -> None:
        """A prefix cache operation or a prefix instability (no scope, no tokens)."""
        if event.kind == "prefix_instability":
            self.emit("prefix_instability", request_id=event.request_id,
                      matched_tokens=event.n_tokens, cached_tokens=event.history_tokens)
            return
        self.emit("cache", tier=event.tier, op=event.kind, bytes=event.size_bytes,
                  tokens=event.n_tokens, entries=self.cache_entries(event.tier),
                  reason=event.reason)

    # -- the event writer's thread --------------------------------------------------------

    def request_end(self, request_id: str, kind: str, data: dict[str, Any],
                    tenant_id: str | None) -> None:
        """A request's end, written: ``data`` is its ``done`` or ``error`` event's."""
        usage = data.get("usage") or {}
        timings = data.get("timings") or {}
        self.emit(
            "request.done" if kind == "done" else "request.exception",
            request_id=request_id, tenant_id=tenant_id,
            finish_reason=data.get("finish_reason", "error"), error_code=data.get("code"),
            prompt_tokens=usage.get("prompt_tokens"),
            cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
            completion_tokens=usage.get("completion_tokens"),
            queue_ms=timings.get("queue_ms"), ttft_ms=timings.get("ttft_ms"),
            duration_ms=timings.get("duration_ms"),
            prompt_eval_rate=timings.get("prompt_eval_rate"),
            generation_rate=timings.get("generation_rate"),
            resumed=data.get("resumed", 0))
        for listener in self.end_listeners:
            try:
                listener(request_id, kind, data, tenant_id)
            except Exception:  # a listener never breaks the writer
                logging.getLogger(__name__).exception("telemetry: an end listener failed")


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Puts records on a bounded queue; a full one drops the line (and counts it) rather
    than block a thread that holds the scheduler's lock."""

    def __init__(self, lines: queue.Queue) -> None:
        super().__init__(lines)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # the message is a finished JSON string: nothing to format here


def install_handler(stream: IO[str] | None = None) -> logging.handlers.QueueListener:
    """Telemetry lines to ``stream`` (stderr), the message alone, from a thread of their
    own; not passed on to the root logger (no second, prefixed copy). Returns the started
    listener (``stop()`` it to write what is queued)."""
    lines: queue.Queue = queue.Queue(QUEUE_LINES)
    writer = logging.StreamHandler(stream or sys.stderr)
    writer.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(lines, writer)
    listener.start()
    log.addHandler(_DroppingQueueHandler(lines))
    log.setLevel(logging.INFO)
    log.propagate = False
    return listener


def stop_listener(listener: logging.handlers.QueueListener) -> None:
    """Flush and stop: every queued line written (at exit)."""
    stopping = threading.Thread(target=listener.stop, daemon=True)
    stopping.start()
    stopping.join(timeout=5)
