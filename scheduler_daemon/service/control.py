"""Messages in that act on work already here: cancels, and an operator's commands.

Two threads, both until the lifecycle reaches ``STOPPING``:

- cancels: pub/sub on ``llm:cancel`` -> ``core.cancel(id)``; a cancel inside a long prefill
  aborts the decode in flight (docs/scheduler.md). The durable cancel flag is the intake's
  to check before a job starts.
- commands: ``llm:control:<daemon id>`` (``wire.protocol.CONTROL_ACTIONS``): ``drain``
  pauses the intake (``lifecycle``: SERVING -> PAUSING -> PAUSED), ``resume`` reopens it,
  ``evict_scope`` drops one tenant's cached prefixes, ``unload_adapter`` unloads a deleted
  adapter once no request holds it. A bad command is logged and ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import redis

from wire import protocol
from wire.backoff import Backoff

from ..core.inference import InferenceCore
from ..core.lifecycle import State
from .context import DaemonContext
from .recovery import as_text

log = logging.getLogger(__name__)

DRAIN_WAIT_S = 10.0  # how long a drain command waits for the intake's read under way


class Control:
    """Cancels and operator commands for one daemon."""

    def __init__(
        self,
        ctx: DaemonContext,
        core: InferenceCore,
        on_change: Callable[[], None],
    ) -> None:
        """``on_change``: called after a command took effect (a heartbeat: the admin sees it)."""
        self.core = core
        self.redis = ctx.redis
        self.daemon_id = ctx.daemon_id
        self.lifecycle = ctx.lifecycle
        self.on_change = on_change
        self.on_evict_scope: Callable[[str], None] | None = None  # told the scope evicted
        # Commands are read from where the stream ends now, before any thread starts: one
        # sent once the daemon is up (its snapshot published) is never missed, as it was
        # with "$" taken at the loop's first read; a former run's commands are not replayed.
        self._commands_from = self._stream_end()

    def _stream_end(self) -> str:
        """The id of the control stream's last entry ("0-0": empty; "$" when Redis does not
        answer: from the loop's first read on)."""
        try:
            newest = self.redis.xrevrange(protocol.control_stream(self.daemon_id), count=1)
        except redis.RedisError:
            return "$"
        return as_text(newest[0][0]) if newest else "0-0"

    def cancel_loop(self) -> None:
        outage = Backoff("listening for cancels", log)
        pubsub = None
        try:
            while self.lifecycle.running:
                try:
                    if pubsub is None:
                        pubsub = self._subscribe()
                        outage.succeeded()
                    message = pubsub.get_message(timeout=0.5)
                except redis.RedisError as exc:
                    # Redis away (a restart): subscribe afresh once it answers again
                    if pubsub is not None:
                        pubsub.close()
                        pubsub = None
                    self.lifecycle.wait_for({State.STOPPING, State.STOPPED}, outage.failed(exc))
                    continue
                if message and message["type"] == "message":
                    self.core.cancel(as_text(message["data"]))
        finally:
            if pubsub is not None:
                pubsub.close()

    def _subscribe(self) -> redis.client.PubSub:
        """A subscription to the cancel channel, then the durable cancel flags of the requests
        here: a cancel published while this daemon was not subscribed (Redis restarting) is
        never delivered again, but its flag stays."""
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            pubsub.subscribe(protocol.CANCEL_CHANNEL)
            ids = list(self.core.scheduler.request_ids())
            if ids:
                pipe = self.redis.pipeline(transaction=False)
                for request_id in ids:
                    pipe.exists(protocol.cancel_key(request_id))
                for request_id, flagged in zip(ids, pipe.execute(), strict=True):
                    if flagged:
                        self.core.cancel(request_id)
        except BaseException:
            pubsub.close()
            raise
        return pubsub

    def command_loop(self) -> None:
        stream, last = protocol.control_stream(self.daemon_id), self._commands_from
        outage = Backoff("reading control commands", log)
        while self.lifecycle.running:
            try:
                reply = self.redis.xread({stream: last}, block=500)
                outage.succeeded()
            except redis.RedisError as exc:
                self.lifecycle.wait_for({State.STOPPING, State.STOPPED}, outage.failed(exc))
                continue
            for _name, entries in reply or []:
                for entry_id, fields in entries:
                    last = as_text(entry_id)
                    try:
                        self.apply(protocol.decode_command(fields))
                    except Exception:  # an operator's bad command must never stop the daemon
                        log.exception("ignoring a control command that failed")

    def apply(self, command: dict[str, Any]) -> None:
        """Carry out one operator command."""
        action = command["action"]
        log.warning("operator command: %s", command)
        if action == "drain":
            if self.lifecycle.move(State.PAUSING):
                # a read already blocking may still deliver: "draining" is published once
                # the intake is idle (PAUSED)
                self.lifecycle.wait_for({State.PAUSED, State.DRAINING}, DRAIN_WAIT_S)
        elif action == "resume":
            self.lifecycle.move(State.SERVING)
        elif action == "unload_adapter":
            self.core.adapters.delete(str(command["adapter"]))
            self.core.scheduler.wake()  # unloaded at the next tick if no request holds it
        elif action == "evict_scope":
            evicted = self.core.scheduler.evict_scope(str(command["scope"]))
            if self.on_evict_scope is not None:
                self.on_evict_scope(str(command["scope"]))
            log.warning("evicted %s cached prefix entries of scope %s", evicted, command["scope"])
        else:
            raise ValueError(f"unknown control action {action!r}")
        self.on_change()
