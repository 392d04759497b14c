"""The scheduler daemon: one model's jobs served from Redis by an ``InferenceCore``.

Assembles the parts and owns the one lifecycle (``lifecycle.py``: STARTING -> SERVING <->
PAUSING/PAUSED -> DRAINING -> STOPPING -> STOPPED). Threads, besides the core's loop:

- ``intake.py``: the reader (jobs stream -> prepare queue, dead daemons' jobs recovered via
  ``recovery.py``) and the preparer (prepare queue -> core, round-robin by tenant);
- ``control.py``: cancels (pub/sub) and operator commands (drain, resume, evict a scope);
- ``event_writer.py``: events out, one pipeline per flush, history rows, the request log;
- ``heartbeat.py``: the snapshot every second;
- ``watch.py``: watched requests nobody follows any more cancelled after the resume grace;
- ``timeseries.py``: the service's time series (the admin's overview), a sample per interval.

``telemetry.py`` hooks into the core (ticks, KV pressure, the prefix cache, ends) and logs
its events as JSON lines.

The wire (keys, message shapes) is ``wire/protocol.py``; docs/daemon.md tells the story.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis

from wire import protocol, queue, timeseries

from ..core.inference import InferenceCore
from ..core.lifecycle import State
from .context import DaemonContext
from .control import Control
from .event_writer import EventWriter
from .heartbeat import Heartbeat
from .history import HistorySink
from .intake import Intake
from .telemetry import Telemetry
from .timeseries import Sampler
from .watch import Watch

log = logging.getLogger(__name__)

THREAD_JOIN_S = 10.0


class SchedulerDaemon:
    """Serves one model's jobs from Redis; ``start()``, then ``stop(grace_s)`` once."""

    def __init__(
        self,
        core: InferenceCore,
        client: redis.Redis,
        model: str,
        daemon_id: str | None = None,
        config_info: dict[str, Any] | None = None,
        stream_interval_s: float = 0.0,
        history: HistorySink | None = None,
        capacity: int | None = None,
        queue_allowance: tuple[int, int] | None = None,
        run_info: dict[str, Any] | None = None,
        telemetry_tick_s: float = 1.0,
        timeseries_interval_s: float = timeseries.DEFAULT_INTERVAL_S,
        timeseries_retention_s: int = timeseries.DEFAULT_RETENTION_S,
    ) -> None:
        """``history``: where request rows are closed (``run_scheduler`` gives
        ``inference.history.DatabaseHistory``; the daemon never imports the web's models).
        ``stream_interval_s``: see ``EventWriter``. ``capacity``: the jobs it holds at most
        (its slots plus its local queue; default: ``intake.PREPARE_QUEUE_MAX``).
        ``queue_allowance``: what it adds to the web's gate (MAX_QUEUE, MAX_QUEUE_PER_TENANT;
        default: the core's queue caps). ``run_info``: what the supervisor said of this run
        (restarts, how the last run ended), published in the snapshot.
        ``telemetry_tick_s``: at most one ``tick`` telemetry line per this many seconds.
        ``timeseries_interval_s``: a time series sample per this many seconds (0: none),
        kept ``timeseries_retention_s`` (wire/timeseries.py)."""
        self.core = core
        self.redis = client
        self.model = model
        self.daemon_id = daemon_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ctx = ctx = DaemonContext(client, model, self.daemon_id)
        self.lifecycle = ctx.lifecycle
        self.telemetry = Telemetry(self.daemon_id, model, telemetry_tick_s,
                                   cache_entries=self._cache_entries)
        self.writer = EventWriter(ctx, history, stream_interval_s, self.telemetry)
        self.telemetry.tenant_of = self.writer.tenant_of
        self.intake = Intake(
            ctx, core, self.writer, **({} if capacity is None else {"capacity": capacity})
        )
        self.heartbeat = Heartbeat(
            ctx, core, self.intake.rejected, config_info,
            fleet=self.fleet_entry, intake=self.intake, run_info=run_info,
        )
        self.sampler = (Sampler(ctx, lambda: self.heartbeat.last, timeseries_interval_s,
                                timeseries_retention_s) if timeseries_interval_s > 0 else None)
        if self.sampler is not None:
            self.telemetry.end_listeners.append(self.sampler.request_end)
        self.control = Control(ctx, core, self.heartbeat.beat)
        self.control.on_evict_scope = self.intake.forget_tenant
        self.watch = Watch(ctx, core.cancel, self.writer.is_live)
        self.intake.started.append(self.watch.started)
        self.intake.feed(core.scheduler)  # a burst's first tick waits for the burst's jobs
        config = core.scheduler.config
        self.queue_allowance = queue_allowance or (
            config.max_queue,
            config.max_queue if config.max_queue_per_scope is None else config.max_queue_per_scope)
        self._threads: dict[str, threading.Thread] = {}
        core.listeners.append(self.writer.on_event)
        core.tick_listeners.append(lambda _stats: self.writer.wake())
        self._hook_telemetry()

    def _hook_telemetry(self) -> None:
        scheduler, telemetry = self.core.scheduler, self.telemetry
        scheduler.on_cache_event = telemetry.on_cache_event
        scheduler.on_kv_pressure = telemetry.on_kv_pressure
        self.core.listeners.append(telemetry.on_event)
        self.core.tick_listeners.append(
            lambda stats: telemetry.on_tick(stats, scheduler.last_plan))

    def _cache_entries(self, tier: str) -> int | None:
        """A tier's entry count, read without its lock (any thread: a length is atomic)."""
        cache = self.core.scheduler.cache
        if tier == "ram":
            return len(cache.ram) if cache.ram is not None else None
        if tier == "disk":
            return len(cache.disk.index) if cache.disk is not None else None
        return None

    @property
    def state(self) -> State:
        return self.lifecycle.state

    def start(self) -> None:
        """STARTING -> SERVING: the consumer group, the adapters deleted so far (never
        loaded here), a first heartbeat, this id's own pending jobs recovered, then the
        threads."""
        self.intake.ensure_group()
        self.redis.delete(protocol.gone_key(self.daemon_id))  # back under this id
        for adapter_id in self.redis.zrange(protocol.DELETED_ADAPTERS, 0, -1):  # while down
            self.core.adapters.delete(protocol.as_text(adapter_id))
        self.heartbeat.beat()
        self.intake.recovery.reclaim_own()
        self.lifecycle.move(State.SERVING)
        self._spawn("intake", self.intake.read_loop)
        self._spawn("prepare", self.intake.prepare_loop)
        self._spawn("cancels", self.control.cancel_loop)
        self._spawn("control", self.control.command_loop)
        self._spawn("writer", self.writer.run)
        self._spawn("heartbeat", self.heartbeat.run)
        self._spawn("watch", self.watch.run)
        if self.sampler is not None:
            self._spawn("timeseries", self.sampler.run)
        log.info("daemon %s serving model %r", self.daemon_id, self.model)

    def stop(self, grace_s: float) -> None:
        """DRAINING: stop taking jobs (unread ones stay in the stream for the next daemon;
        read ones not started stay pending under this id), hand back at once the requests
        still waiting for a slot, let those in flight finish for ``grace_s``, then hand back
        the rest (another daemon continues them: nothing queued is cancelled by a restart).
        STOPPING: the threads end, every last event is written, the handed-back jobs lose
        their running record (no crash to count), the heartbeat key goes. STOPPED."""
        if not self.lifecycle.move(State.DRAINING):
            return  # stopping already
        self._join("intake", "prepare")
        handed_back = self.core.stop(grace_s, hand_back=True)
        if handed_back:
            log.warning("handing back %d requests to the jobs stream", len(handed_back))
        self.lifecycle.move(State.STOPPING)
        self.writer.wake(force=True)
        self._join("cancels", "control", "writer", "heartbeat", "watch", "timeseries")
        self.writer.flush(everything=True)  # the held tokens too: nothing stays in memory
        self.writer.handed_back(handed_back)
        if self.sampler is not None:
            self.sampler.sample()  # the last ends counted (Redis away: dropped)
        self.heartbeat.remove()
        self.lifecycle.move(State.STOPPED)
        log.info("daemon %s stopped", self.daemon_id)

    @property
    def healthy(self) -> bool:
        """Whether every thread that should run in this state still does (a thread that
        died: ``run_scheduler`` shuts down)."""
        ended_by_drain = () if self.lifecycle.taking_jobs else ("intake", "prepare")
        return all(t.is_alive() for n, t in self._threads.items() if n not in ended_by_drain)

    def snapshot(self) -> dict[str, Any]:
        return self.heartbeat.snapshot()

    def fleet_entry(self) -> queue.FleetEntry:
        """What the web's queue gate counts of this daemon (wire/queue.py)."""
        max_queue, per_tenant = self.queue_allowance
        return queue.FleetEntry(
            at=time.time(),
            taking=self.lifecycle.state is State.SERVING and not self.core.loop_state()["stuck"],
            max_queue=max_queue, max_queue_per_tenant=per_tenant,
            drain_per_s=round(self.intake.drain_per_s(), 3), capacity=self.intake.capacity,
            held=self.intake.held())

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        thread = threading.Thread(target=target, name=f"daemon-{name}", daemon=True)
        thread.start()
        self._threads[name] = thread

    def _join(self, *names: str) -> None:
        for name in names:
            thread = self._threads.get(name)
            if thread is not None:
                thread.join(timeout=THREAD_JOIN_S)
