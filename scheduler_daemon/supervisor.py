"""Keeps a scheduler daemon running: ``manage.py run_scheduler --supervise``.

A native crash (a llama.cpp bug that validation missed) kills the daemon process, and
Python cannot catch it. The supervisor runs the daemon as a child process under one daemon
id and starts it again when it dies (a signal or a non-zero exit), after a back-off that
grows while it keeps dying quickly. The new run recovers what the old one had read
(``Recovery.reclaim_own``); a job that was running at two deaths is quarantined.

A clean exit (status 0: SIGTERM/SIGINT handled, or a drain) ends the supervisor too.
SIGTERM/SIGINT sent to the supervisor go to the child, which drains and exits.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger("scheduler_daemon.supervisor")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a run this long resets the back-off


def supervise(argv: Sequence[str], sleep=time.sleep) -> int:
    """Run ``argv`` until it exits cleanly or we are told to stop; returns its last status."""
    stopping = False
    child: subprocess.Popen | None = None

    def forward(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    backoff = BACKOFF_FIRST_S
    restarts = 0
    while True:
        started = time.monotonic()
        child = subprocess.Popen(list(argv))
        status = _wait(child)
        if stopping or status == 0:
            return status
        ran_s = time.monotonic() - started
        if ran_s >= STABLE_AFTER_S:
            backoff = BACKOFF_FIRST_S
        restarts += 1
        log.error(
            "the scheduler daemon died (%s) after %.1f s; restart %d in %.1f s",
            _describe(status), ran_s, restarts, backoff,
        )
        sleep(backoff)
        backoff = min(BACKOFF_MAX_S, backoff * 2)
        if stopping:
            return status


def _wait(child: subprocess.Popen) -> int:
    while True:
        try:
            return child.wait()
        except InterruptedError:  # pragma: no cover - PEP 475 retries for us
            continue


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"
