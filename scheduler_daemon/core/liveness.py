"""The scheduler loop's progress, readable without its lock and from another process.

The loop marks every turn it completes (``LoopClock.mark``: two stores into shared memory,
no lock, no system call). Two readers that never wait on the loop:

- the supervisor (another process, ``supervisor.py``) maps the same file and kills a daemon
  whose loop has not completed a turn within ``TICK_DEADLINE_S``: a hang is a crash;
- the heartbeat (``heartbeat.py``) publishes the loop's age, and ``stuck`` past a quarter of
  the deadline, so /v1/health and the admin show a stuck daemon as stuck, not gone.

A turn is one tick, one embeddings batch, or an idle wait of at most 0.25 s, so an idle loop
marks at least four times a second. Before the loop starts (the model loading) the clock is
unarmed, and after it stops (a drain) it is stopped: neither is a hang.

The other threads that call into llama.cpp for a job (the preparer: template, tokenizer,
grammar compile; the vocabulary thread) say so too (``LoopClock.calling``): the clock keeps
when the oldest such call began, and the watchdog kills a daemon whose call has run past the
deadline as well (that thread starts every job: stuck, it stops the daemon for everyone).

A sampler call (one request's next token: its grammar, its sampling chain) is marked too:
priced grammars keep it to milliseconds, so the watchdog gives it a deadline of its own,
much shorter than a turn's (``SAMPLER_DEADLINE_S``).

The file holds five 8-byte fields: the state (0 unarmed, 1 running, 2 stopped), the turns
completed, the monotonic time of the last mark, that of the oldest native call under way
off the loop (0: none) and that of the sampler call under way (0: none). Times are
``time.monotonic()``: CLOCK_MONOTONIC, one clock for every process of the machine. A reader
reads the fields twice and keeps a read only when both agree (a mark may land between two
loads).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

# state, turns, last mark, oldest call off the loop (or 0), the loop's sampler call (or 0)
_LAYOUT = struct.Struct("<QQddd")
_LOOP = struct.Struct("<QQd")  # the loop thread's part, written by it alone
_CALL = struct.Struct("<d")  # the other threads' part (under _calls_lock), at _LOOP.size
_SAMPLE = struct.Struct("<d")  # the loop's, at _SAMPLE_AT
_SAMPLE_AT = _LOOP.size + _CALL.size
UNARMED, RUNNING, STOPPED = 0, 1, 2
STUCK_AFTER_S = 30.0  # "stuck" past this (run_scheduler: a quarter of TICK_DEADLINE_S)


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
        self._calls: dict[int, tuple[float, str | None]] = {}  # thread -> (since, job id)
        self._calls_lock = threading.Lock()

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
        _LOOP.pack_into(self._map, 0, RUNNING, self.turns, now)
        return now

    def stop(self) -> None:
        """The loop ended on purpose: no longer watched."""
        _LOOP.pack_into(self._map, 0, STOPPED, self.turns, time.monotonic())

    def reset(self) -> None:
        """Unarmed again (the supervisor, before it starts a new run)."""
        _LAYOUT.pack_into(self._map, 0, UNARMED, 0, 0.0, 0.0, 0.0)

    def sampling(self, started: bool) -> None:
        """The loop enters (or leaves) one request's sampler: a call that costs milliseconds
        when the grammar is priced right, so one that runs long is a hang sooner than a
        turn is (the watchdog's sampler deadline)."""
        _SAMPLE.pack_into(self._map, _SAMPLE_AT, time.monotonic() if started else 0.0)

    @contextlib.contextmanager
    def calling(self, job_id: str | None = None) -> Iterator[None]:
        """Around a call into llama.cpp off the loop thread (one job's template, tokenizer,
        grammar): watched like a loop turn. ``job_id``: the job it works for, if one."""
        me = threading.get_ident()
        with self._calls_lock:
            self._calls[me] = (time.monotonic(), job_id)
            self._write_oldest_call()
        try:
            yield
        finally:
            with self._calls_lock:
                self._calls.pop(me, None)
                self._write_oldest_call()

    def _write_oldest_call(self) -> None:
        oldest = min((since for since, _ in self._calls.values()), default=0.0)
        _CALL.pack_into(self._map, _LOOP.size, oldest)

    def oldest_call_job(self) -> str | None:
        """The job of the oldest native call off the loop under way (this process only)."""
        with self._calls_lock:
            return min(self._calls.values(), key=lambda c: c[0], default=(0.0, None))[1]

    def read(self) -> tuple[int, int, float, float, float]:
        """(state, turns, last mark, oldest call off the loop, the sampler call), consistent."""
        while True:
            first = _LAYOUT.unpack_from(self._map, 0)
            if first == _LAYOUT.unpack_from(self._map, 0):
                return first

    def stalled_s(self, now: float | None = None) -> float | None:
        """Seconds since the loop's last mark while it runs; None while unarmed or stopped."""
        return self._age(2, now)

    def calling_s(self, now: float | None = None) -> float | None:
        """Seconds the oldest native call off the loop has run; None when none runs (or the
        loop is not running)."""
        return self._age(3, now)

    def sampling_s(self, now: float | None = None) -> float | None:
        """Seconds the loop has been in one request's sampler; None when it is not."""
        return self._age(4, now)

    def _age(self, field: int, now: float | None) -> float | None:
        """Seconds since the time in ``field`` of ``read()``, while the loop runs and the
        field is set (the last mark always is)."""
        fields = self.read()
        since = fields[field]
        if fields[0] != RUNNING or since == 0.0:
            return None
        return max(0.0, (time.monotonic() if now is None else now) - since)

    def close(self) -> None:
        self._map.close()
