"""Watched requests: cancelled once no reader has followed them for RESUME_GRACE_S.

The web keeps ``protocol.watch_key(id)`` alive while some reader follows a request queued
with ``Job.watched`` (inference/watch.py); the key expires RESUME_GRACE_S after the last
reader went away (a dropped connection, a killed web process). ``run`` is a thread: every
CHECK_INTERVAL_S it reads the keys of this daemon's live watched requests (one MGET) and
cancels (``core.cancel``) those whose key is gone. The grace is enforced here, not by a
timer in the web, so a client can come back through any web process, even one started
after the one it was reading from was killed.

A key counts as gone when checks CONFIRM_S apart (two or three) all find it missing, with
no failed check between: a Redis that restarted without it, or came back after the web's renewals
failed for longer than the grace, has it written again by the web's next renewal (within
a second) and cancels nothing. Jobs queued without ``watched`` are never looked at.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from wire import protocol

from ..core.lifecycle import State
from .context import DaemonContext

log = logging.getLogger(__name__)

CHECK_INTERVAL_S = 1.0
CONFIRM_S = 1.5  # a key missing this long (two checks) is gone


class Watch:
    """The live watched requests of one daemon and the thread that checks their keys."""

    def __init__(
        self,
        ctx: DaemonContext,
        cancel: Callable[[str], Any],
        is_live: Callable[[str], bool],
    ) -> None:
        """``cancel``: ends a request (``core.cancel``); ``is_live``: whether a request has
        not ended here yet (``EventWriter.is_live``): ended ones are forgotten."""
        self.redis = ctx.redis
        self.lifecycle = ctx.lifecycle
        self.cancel = cancel
        self.is_live = is_live
        self._missing_since: dict[str, float | None] = {}  # id -> first check without its key
        self._lock = threading.Lock()

    def started(self, job: protocol.Job) -> None:
        """The intake started ``job`` here: watch it if the web does."""
        if job.watched:
            with self._lock:
                self._missing_since.setdefault(job.id, None)

    def watched(self) -> list[str]:
        with self._lock:
            return list(self._missing_since)

    def check(self, now: float | None = None) -> list[str]:
        """One round: cancel the requests whose key is gone; their ids."""
        with self._lock:
            for request_id in [r for r in self._missing_since if not self.is_live(r)]:
                del self._missing_since[request_id]
            ids = list(self._missing_since)
        if not ids:
            return []
        found = self.redis.mget([protocol.watch_key(r) for r in ids])
        now = time.monotonic() if now is None else now
        gone = []
        with self._lock:
            for request_id, value in zip(ids, found, strict=True):
                if request_id not in self._missing_since:
                    continue
                since = self._missing_since[request_id]
                if value is not None:
                    self._missing_since[request_id] = None
                elif since is None:
                    self._missing_since[request_id] = now
                elif now - since >= CONFIRM_S:
                    del self._missing_since[request_id]
                    gone.append(request_id)
        for request_id in gone:
            log.info("request %s: no reader came back within the resume grace; cancelling",
                     request_id)
            self.cancel(request_id)
        return gone

    def _forget_misses(self) -> None:
        """A check failed: a key seen missing before it must be seen missing afresh."""
        with self._lock:
            self._missing_since = dict.fromkeys(self._missing_since)

    def run(self) -> None:
        while self.lifecycle.running:
            self.check_safely()
            self.lifecycle.wait_for({State.STOPPING, State.STOPPED}, CHECK_INTERVAL_S)

    def check_safely(self, now: float | None = None) -> list[str]:
        """``check``; a failed one cancels nothing and restarts every confirmation."""
        try:
            return self.check(now)
        except redis.RedisError:
            log.warning("checking the watch keys failed; retrying", exc_info=True)
        except Exception:  # a bug here must not stop the daemon's other work
            log.exception("checking the watch keys failed; retrying")
        self._forget_misses()
        return []
