"""What the Redis-facing parts of one daemon share: its connection, model, id and lifecycle.

``SchedulerDaemon`` builds one ``DaemonContext`` and hands it to each part (intake,
recovery, event writer, heartbeat, control, watch) with what is that part's own; the keys a
daemon's parts name on the wire follow from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from wire import protocol, queue

from ..core.lifecycle import Lifecycle


@dataclass(frozen=True)
class DaemonContext:
    """One daemon on the wire: ``redis`` (its client), ``model`` (the jobs it serves),
    ``daemon_id`` (its consumer name, heartbeat and running keys), ``lifecycle`` (its one
    state machine, which every thread reads to know when to stop)."""

    redis: redis.Redis
    model: str
    daemon_id: str
    lifecycle: Lifecycle = field(default_factory=Lifecycle)

    @property
    def jobs_stream(self) -> str:
        return protocol.jobs_stream(self.model)

    @property
    def running_key(self) -> str:
        return protocol.running_key(self.daemon_id)

    @property
    def load_key(self) -> str:
        return queue.load_key(self.model)
