"""The daemon's published state: a snapshot every second, with a TTL that says it is alive.

``llm:daemon:<id>`` holds the snapshot JSON for ``HEARTBEAT_TTL_S`` (a missing key is a dead
daemon: others reclaim its jobs), ``llm:daemons`` scores the id by its last beat. The web
reads them for /v1/health, /v1/models, the admin and /metrics. Never any prompt text.
``llm:fleet:<model>`` holds, per daemon, what the web's queue gate counts (wire/queue.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from wire import protocol, queue
from wire.backoff import Backoff
from wire.protocol import as_text

from ..core.affinity import SUMMARY_TTL_S
from ..core.inference import InferenceCore
from ..core.lifecycle import State
from .context import DaemonContext
from .intake import Intake

log = logging.getLogger(__name__)

PRUNE_EVERY_BEATS = 60
FLEET_ENTRY_MAX_AGE_S = 600.0


class Heartbeat:
    """Builds and publishes the snapshot (``run`` is its thread, until ``STOPPING``)."""

    def __init__(
        self,
        ctx: DaemonContext,
        core: InferenceCore,
        rejected: Counter[str],
        config_info: dict[str, Any] | None = None,
        fleet: Callable[[], queue.FleetEntry] | None = None,
        intake: Intake | None = None,
        run_info: dict[str, Any] | None = None,
    ) -> None:
        """``rejected``: the intake's count of jobs answered with an error before starting.
        ``fleet``: this daemon's entry in the model's fleet hash, built at each beat;
        ``intake``: whose affinity summary it keeps alive and whose counts it shows."""
        self.core = core
        self.redis = ctx.redis
        self.model = ctx.model
        self.daemon_id = ctx.daemon_id
        self.lifecycle = ctx.lifecycle
        self.rejected = rejected
        self.config_info = config_info or {}
        self.run_info = run_info or {}
        self.started_at = time.time()
        self.running_key = ctx.running_key
        self.fleet = fleet
        self.intake = intake
        self.fleet_key = queue.fleet_key(ctx.model)
        self.load_key = ctx.load_key
        self._beats = 0
        self._hang_recorded: str | None = None  # the request this run's hang record names
        self.last: dict[str, Any] | None = None  # the last snapshot built (any thread reads it)

    def snapshot(self) -> dict[str, Any]:
        """The state published for the admin, /v1/health and /metrics (no prompt text)."""
        return {
            "daemon_id": self.daemon_id,
            "model": self.model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
            "config": self.config_info,
            "state": self.lifecycle.state.name.lower(),
            "draining": self.lifecycle.state is State.PAUSED,  # the operator's drain, in effect
            "rejected": dict(self.rejected),
            **self.run_info,
            **self.core.snapshot(),
            **self._fleet_info(),
        }

    def _fleet_info(self) -> dict[str, Any]:
        """The fleet's view of this daemon: what the gate counts, jobs taken per tenant, the
        affinity summary's size per tenant (counts only)."""
        if self.fleet is None or self.intake is None:
            return {}
        return {"fleet": {**json.loads(self.fleet().encode()),
                          "taken_by_tenant": dict(self.intake.taken_by_tenant),
                          "affinity_entries": self.intake.summary.by_tenant()}}

    def beat(self) -> None:
        """Publish the snapshot now; keep this daemon's running record alive."""
        snap = self.last = self.snapshot()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(
            protocol.daemon_key(self.daemon_id),
            json.dumps(snap),
            px=int(protocol.HEARTBEAT_TTL_S * 1000),
        )
        pipe.zadd(protocol.DAEMONS_ZSET, {self.daemon_id: snap["heartbeat_at"]})
        pipe.zremrangebyscore(protocol.DAEMONS_ZSET, 0, snap["heartbeat_at"] - 3600)
        pipe.expire(self.running_key, protocol.RUNNING_TTL_S)
        self._record_hang(pipe, (snap.get("loop") or {}).get("stuck_on"))
        if self.fleet is not None:
            entry = self.fleet()
            pipe.hset(self.fleet_key, self.daemon_id, entry.encode())
            pipe.hset(self.load_key, self.daemon_id, entry.held)  # the live count, corrected
        resync = self._beats % PRUNE_EVERY_BEATS == 0
        if self.intake is not None:
            summary = self.intake.summary_key
            # the loaded adapters' heads (routing prefers this daemon for their jobs), and
            # no more those of adapters unloaded here
            heads = self.core.adapters.routes()
            unrouted = [h for h in self.core.adapters.take_unrouted() if h not in heads]
            if unrouted:
                pipe.srem(summary, *unrouted)
            if resync:  # the whole summary again now and then (a write lost to an outage)
                pipe.delete(summary)
                held = self.intake.summary.all()
                if held:
                    pipe.sadd(summary, *held)
            if heads:
                pipe.sadd(summary, *heads)
            pipe.expire(summary, SUMMARY_TTL_S)
        pipe.execute()
        self._beats += 1
        if self.fleet is not None and resync:
            self._prune_fleet(snap["heartbeat_at"])

    def _record_hang(self, pipe: Any, stuck_on: str | None) -> None:
        """While the loop is stuck in one request's sampler, name it for this run's recovery
        (the watchdog's kill is that request's death, not its neighbours'); gone once the
        loop turns again."""
        if self.intake is None or stuck_on == self._hang_recorded:
            return
        key = protocol.hang_key(self.daemon_id, self.intake.recovery.run_id)
        if stuck_on:
            pipe.set(key, stuck_on, ex=protocol.DEATHS_TTL_S)
        else:
            pipe.delete(key)
        self._hang_recorded = stuck_on

    def _prune_fleet(self, now: float) -> None:
        """Drop the fleet entries of daemons that died without a goodbye (the web's gate
        ignores them already; this keeps the hash bounded)."""
        stale = []
        for daemon_id, raw in self.redis.hgetall(self.fleet_key).items():
            try:
                at = float(json.loads(raw)["at"])
            except (ValueError, KeyError, TypeError):
                at = 0.0
            if now - at > FLEET_ENTRY_MAX_AGE_S:
                stale.append(daemon_id)
        for daemon_id in stale:
            queue.drain_back(self.redis, self.model, as_text(daemon_id), leave=True)

    def run(self) -> None:
        # Redis away: retried with backoff, but never slower than the usual interval (a
        # daemon must beat within a second of Redis coming back, or it looks dead)
        outage = Backoff("publishing the heartbeat", log)
        while self.lifecycle.running:
            wait_s = protocol.HEARTBEAT_INTERVAL_S
            try:
                self.beat()
                outage.succeeded()
            except redis.RedisError as exc:
                wait_s = min(wait_s, outage.failed(exc))
            except Exception:  # a bug in a snapshot must not silence the daemon for good
                log.exception("building the heartbeat failed; retrying")
            self.lifecycle.wait_for({State.STOPPING, State.STOPPED}, wait_s)

    def remove(self) -> None:
        """On the way out: this daemon is gone at once (no wait for the TTL)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(protocol.daemon_key(self.daemon_id))
        pipe.zrem(protocol.DAEMONS_ZSET, self.daemon_id)
        if self.intake is not None:
            pipe.delete(self.intake.summary_key)
        pipe.set(protocol.gone_key(self.daemon_id), 1, ex=protocol.GONE_TTL_S)
        pipe.execute()
        # What was routed here and not taken goes to the others, in one step with the fleet
        # and load entries' removal: if this never runs (Redis away, killed here), the entry
        # stays listed, goes stale, and the others' TAKE and pruning drain it back.
        moved = queue.drain_back(self.redis, self.model, self.daemon_id, leave=True)
        if moved:
            log.warning("moved %d jobs routed here back to the shared queue", moved)
        if not self.redis.hlen(self.running_key):
            self.redis.delete(self.running_key)
