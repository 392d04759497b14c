"""Waiting for Redis to come back: the delays between tries, on both sides of the wire.

A lost connection is retried, never fatal: the daemon's threads and the web's readers wait
``FIRST_S`` after the first failure, doubling up to ``CAP_S`` (a Redis restart with AOF
takes about a second; the cap puts the first try after it within 2 s). A success resets
the count. No jitter: a restart is one event, and a few processes retrying every 2 s are
no thundering herd for Redis.
"""

from __future__ import annotations

import logging
import time

FIRST_S = 0.1
CAP_S = 2.0


class Backoff:
    """The delays of one caller's tries: ``failed()`` after each failure, ``succeeded()``
    after a success. With ``what`` and ``log``, the first failure of a run and the recovery
    are logged (once each: an outage is not a line per try). One per thread (or task)."""

    def __init__(self, what: str = "", log: logging.Logger | None = None,
                 first_s: float = FIRST_S, cap_s: float = CAP_S) -> None:
        self.what = what
        self.log = log
        self.first_s = first_s
        self.cap_s = cap_s
        self.failures = 0
        self.failing_since: float | None = None  # monotonic time of the first failure

    def failed(self, error: BaseException | None = None) -> float:
        """Count a failure; the seconds to wait before the next try."""
        if self.failing_since is None:
            self.failing_since = time.monotonic()
            if self.log is not None:
                self.log.error("%s failed (Redis: %s); retrying with backoff", self.what, error)
        delay = min(self.cap_s, self.first_s * 2 ** min(self.failures, 32))
        self.failures += 1
        return delay

    def succeeded(self) -> float | None:
        """Reset after a success; how long the failures lasted (None: there were none)."""
        if self.failing_since is None:
            return None
        lasted = time.monotonic() - self.failing_since
        if self.log is not None:
            self.log.warning("%s works again after %.1f s (%d failed tries)", self.what,
                             lasted, self.failures)
        self.failures, self.failing_since = 0, None
        return lasted

    def failing_for(self) -> float:
        """Seconds since the first of the current run of failures (0: none)."""
        return 0.0 if self.failing_since is None else time.monotonic() - self.failing_since
