"""The daemon's part of the service's time series (wire/timeseries.py): a sampler thread.

What ends is counted as it ends (``request_end``, a telemetry listener on the event writer's
thread: a lock and a few additions); every ``interval_s`` the sampler thread takes those
counts, the heartbeat's last snapshot (slots, the local queue, the jobs refused before
starting) and the model's queue in Redis, and writes them in one pipeline. It never touches
the scheduler or its lock, so the tick thread never waits for it. Redis away: the sample is
dropped (logged once per outage, wire/backoff.py); the daemon carries on.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from wire import queue, timeseries
from wire.backoff import Backoff

from ..core.lifecycle import State
from .context import DaemonContext

log = logging.getLogger(__name__)


class Sampler:
    """Counts request ends and writes one sample per ``interval_s`` (``run`` is its
    thread, until ``STOPPING``; ``sample()`` once more at the end)."""

    def __init__(self, ctx: DaemonContext, snapshot: Callable[[], dict[str, Any] | None],
                 interval_s: float = timeseries.DEFAULT_INTERVAL_S,
                 retention_s: int = timeseries.DEFAULT_RETENTION_S,
                 clock: Callable[[], float] = time.time) -> None:
        """``snapshot``: the heartbeat's last published snapshot (None before the first)."""
        self.redis = ctx.redis
        self.model = ctx.model
        self.daemon_id = ctx.daemon_id
        self.lifecycle = ctx.lifecycle
        self.snapshot = snapshot
        self.interval_s = max(1.0, float(interval_s))
        self.retention_s = int(retention_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._ended = self._empty()
        self._rejected_before: Counter[str] = Counter()  # the snapshot's, at the last sample
        self.outage = Backoff("writing the time series", log)
        self.dropped = 0  # samples lost to a Redis outage

    def _empty(self) -> timeseries.Sample:
        return timeseries.Sample(self.daemon_id, self.model)

    # -- the event writer's thread -----------------------------------------------------------

    def request_end(self, request_id: str, kind: str, data: dict[str, Any],
                    tenant_id: str | None) -> None:
        """A request's end, written (a telemetry listener): its tokens, TTFT, tenant."""
        usage = data.get("usage") or {}
        prompt = _count(usage.get("prompt_tokens"))
        completion = _count(usage.get("completion_tokens"))
        cached = _count((usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
        ttft_ms = (data.get("timings") or {}).get("ttft_ms")
        with self._lock:
            ended = self._ended
            ended.requests += 1
            ended.prompt_tokens += prompt
            ended.completion_tokens += completion
            ended.cached_tokens += cached
            if isinstance(ttft_ms, (int, float)) and ttft_ms >= 0:
                index = timeseries.ttft_index(ttft_ms)
                ended.ttft[index] = ended.ttft.get(index, 0) + 1
            if tenant_id is not None and prompt + completion:
                tenant = str(tenant_id)
                tokens = ended.tenant_tokens.get(tenant, 0) + prompt + completion
                ended.tenant_tokens[tenant] = tokens

    # -- its own thread ----------------------------------------------------------------------

    def run(self) -> None:
        while not self.lifecycle.wait_for({State.STOPPING, State.STOPPED}, self.interval_s):
            self.sample()

    def sample(self) -> bool:
        """Write what ended since the last sample and the gauges now; False: dropped."""
        with self._lock:
            taken, self._ended = self._ended, self._empty()
        snap = self.snapshot() or {}
        slots = snap.get("slots") or []
        taken.running = sum(1 for s in slots if s.get("state") != "idle")
        taken.waiting = len(snap.get("queue") or []) + len(snap.get("preempted") or [])
        rejected = Counter({str(k): int(v) for k, v in (snap.get("rejected") or {}).items()})
        taken.refused = {code: n for code, n in (rejected - self._rejected_before).items()}
        self._rejected_before = rejected
        now = self._clock()
        try:
            taken.queued = queue.waiting(self.redis, self.model)
            if timeseries.claim(self.redis, self.daemon_id, now):
                taken.limit_refusals = timeseries.limit_refusals(self.redis)
            pipe = self.redis.pipeline(transaction=False)
            timeseries.write(pipe, taken, now, self.retention_s)
            pipe.execute()
        except redis.RedisError as exc:
            self.outage.failed(exc)  # the first failure of an outage is logged
            self.dropped += 1
            return False
        self.outage.succeeded()
        return True


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
