"""Keeps a scheduler daemon running: ``manage.py run_scheduler --supervise``.

A native crash (a llama.cpp bug that validation missed) kills the daemon process, and
Python cannot catch it. The supervisor runs the daemon as a child process under one daemon
id and starts it again when it dies (a signal or a non-zero exit), after a back-off that
grows while it keeps dying quickly. The new run recovers what the old one had read
(``Recovery.reclaim_own``); a job that was running at two deaths is quarantined.

A hang is a crash too. The child's loop marks each turn it completes in a clock file the
supervisor made (``liveness.LoopClock``; its path in ``LOOP_CLOCK_FILE``); the supervisor
reads it twice a second and kills the child (SIGKILL) when its loop has not completed a turn
for ``tick_deadline_s`` (TICK_DEADLINE_S), then restarts it like any other death. Nothing of
this depends on the child's threads or locks: a native call that never returns is caught.

The child learns how many times it was restarted and why the last run ended
(``DAEMON_RESTARTS``, ``DAEMON_LAST_EXIT``); its snapshot publishes them.

A clean exit (status 0: SIGTERM/SIGINT handled, or a drain) ends the supervisor too.
SIGTERM/SIGINT sent to the supervisor go to the child, which drains and exits.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..core.liveness import LoopClock

log = logging.getLogger("scheduler_daemon.service.supervisor")

BACKOFF_FIRST_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0  # a run this long resets the back-off
POLL_S = 0.5  # how often the watchdog reads the child's loop clock


@dataclass(slots=True)
class Exit:
    """How one run of the child ended."""

    status: int  # Popen's returncode (negative: a signal)
    hung_s: float | None = None  # killed by the watchdog after its loop stalled this long

    def describe(self) -> str:
        if self.hung_s is not None:
            return f"hung: no loop turn for {self.hung_s:.1f} s, killed"
        return _describe(self.status)


@dataclass(slots=True, frozen=True)
class Deadlines:
    """When the watchdog kills (0: never)."""

    turn_s: float = 0.0  # a loop turn, or a job's native call off the loop
    sampler_s: float = 0.0  # one request's sampler call (priced grammars: milliseconds)

    def overdue(self, clock: LoopClock) -> float | None:
        """How long the overdue call has run, if one is past its deadline."""
        for deadline, ran in ((self.turn_s, clock.stalled_s()), (self.turn_s, clock.calling_s()),
                              (self.sampler_s, clock.sampling_s())):
            if deadline > 0 and ran is not None and ran > deadline:
                return ran
        return None


def supervise(argv: Sequence[str], sleep=time.sleep, tick_deadline_s: float = 0.0,
              env: dict[str, str] | None = None, sampler_deadline_s: float = 0.0) -> int:
    """Run ``argv`` until it exits cleanly or we are told to stop; returns its last status.
    ``tick_deadline_s`` > 0: kill a child whose loop has not completed a turn that long (or
    whose native call for a job off the loop has not returned); ``sampler_deadline_s`` > 0:
    one whose loop has been in one request's sampler that long."""
    clock_path = LoopClock.new_file()
    try:
        return _supervise(argv, sleep, Deadlines(tick_deadline_s, sampler_deadline_s),
                          env or dict(os.environ), clock_path)
    finally:
        clock_path.unlink(missing_ok=True)


def _supervise(argv: Sequence[str], sleep, deadlines: Deadlines, env: dict[str, str],
               clock_path: os.PathLike[str]) -> int:
    stopping = False
    child: subprocess.Popen | None = None
    clock = LoopClock(clock_path)
    last_exit = ""

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
        clock.reset()
        child = subprocess.Popen(list(argv), env={
            **env, "LOOP_CLOCK_FILE": str(clock_path), "DAEMON_RESTARTS": str(restarts),
            "DAEMON_LAST_EXIT": last_exit})
        ended = _wait(child, clock, deadlines, lambda: stopping)
        status = ended.status
        if stopping or status == 0:
            return status
        ran_s = time.monotonic() - started
        if ran_s >= STABLE_AFTER_S:
            backoff = BACKOFF_FIRST_S
        restarts += 1
        last_exit = ended.describe()
        log.error(
            "the scheduler daemon died (%s) after %.1f s; restart %d in %.1f s",
            last_exit, ran_s, restarts, backoff,
        )
        sleep(backoff)
        backoff = min(BACKOFF_MAX_S, backoff * 2)
        if stopping:
            return status


def _wait(child: subprocess.Popen, clock: LoopClock, deadlines: Deadlines, stopping) -> Exit:
    """Wait for the child to end; kill it first if a call stalls past its deadline (not
    while it is being stopped: a drain's last turns are its own business)."""
    while True:
        try:
            return Exit(child.wait(timeout=POLL_S))
        except subprocess.TimeoutExpired:
            pass
        stalled = deadlines.overdue(clock)
        if stalled is not None and not stopping():
            log.error("the scheduler daemon (pid %d) has not completed a loop turn (a sampler "
                      "call, a call into llama.cpp for a job) for %.1f s (TICK_DEADLINE_S %.1f, "
                      "SAMPLER_DEADLINE_S %.1f): killing it", child.pid, stalled,
                      deadlines.turn_s, deadlines.sampler_s)
            child.kill()
            return Exit(child.wait(), hung_s=stalled)


def _describe(status: int) -> str:
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"
