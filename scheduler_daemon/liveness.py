"""The scheduler loop's progress, readable without its lock and from another process.

The loop marks every turn it completes (``LoopClock.mark``: two stores into shared memory,
no lock, no system call). Two readers that never wait on the loop:

- the supervisor (another process, ``supervisor.py``) maps the same file and kills a daemon
  whose loop has not completed a turn within ``TICK_DEADLINE_S``: a hang is a crash;
- the heartbeat (``heartbeat.py``) publishes the loop's age, and ``stuck`` past
  ``STUCK_AFTER_S``, so /v1/health and the admin show a stuck daemon as stuck, not gone.

A turn is one tick, one embeddings batch, or an idle wait of at most 0.25 s, so an idle loop
marks at least four times a second. Before the loop starts (the model loading) the clock is
unarmed, and after it stops (a drain) it is stopped: neither is a hang.

The file holds three 8-byte fields: the state (0 unarmed, 1 running, 2 stopped), the
turns completed, the monotonic time of the last mark (``time.monotonic()``: CLOCK_MONOTONIC,
one clock for every process of the machine). A reader reads the fields twice and keeps a
read only when both agree (a mark may land between two loads).
"""

from __future__ import annotations

import mmap
import os
import struct
import tempfile
import time
from pathlib import Path

_LAYOUT = struct.Struct("<QQd")  # state, turns, last mark (monotonic seconds)
UNARMED, RUNNING, STOPPED = 0, 1, 2
STUCK_AFTER_S = 5.0  # the heartbeat says "stuck" past this (the watchdog kills later)


class LoopClock:
    """The loop's marks in a small shared mapping (a file when another process reads it)."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        """``path``: an existing clock file (the supervisor's ``new_file``); None: an
        anonymous mapping, read in this process only."""
        self.path = Path(path) if path is not None else None
        if self.path is None:
            self._map = mmap.mmap(-1, _LAYOUT.size)
        else:
            with open(self.path, "r+b") as f:
                self._map = mmap.mmap(f.fileno(), _LAYOUT.size)
        self.turns = 0

    @staticmethod
    def new_file() -> Path:
        """A fresh, unarmed clock file (in /dev/shm when there is one); the caller deletes it."""
        shm = "/dev/shm"
        fd, name = tempfile.mkstemp(prefix="llm-loop-clock-",
                                    dir=shm if os.path.isdir(shm) else None)
        with os.fdopen(fd, "wb") as f:
            f.write(bytes(_LAYOUT.size))
        return Path(name)

    def mark(self) -> float:
        """The loop completed a turn (the loop thread only); returns the time marked."""
        self.turns += 1
        now = time.monotonic()
        _LAYOUT.pack_into(self._map, 0, RUNNING, self.turns, now)
        return now

    def stop(self) -> None:
        """The loop ended on purpose: no longer watched."""
        _LAYOUT.pack_into(self._map, 0, STOPPED, self.turns, time.monotonic())

    def reset(self) -> None:
        """Unarmed again (the supervisor, before it starts a new run)."""
        _LAYOUT.pack_into(self._map, 0, UNARMED, 0, 0.0)

    def read(self) -> tuple[int, int, float]:
        """(state, turns, last mark), consistent."""
        while True:
            first = _LAYOUT.unpack_from(self._map, 0)
            if first == _LAYOUT.unpack_from(self._map, 0):
                return first

    def stalled_s(self, now: float | None = None) -> float | None:
        """Seconds since the loop's last mark while it runs; None while unarmed or stopped."""
        state, _turns, at = self.read()
        if state != RUNNING:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - at)

    def close(self) -> None:
        self._map.close()
