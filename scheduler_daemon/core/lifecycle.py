"""The daemon's one lifecycle: a state every thread reads, changed only along the arrows.

::

    STARTING --start()--> SERVING --drain--> PAUSING --intake idle--> PAUSED
                             ^                  |                        |
                             +-----resume-------+-----------resume-------+

    STARTING | SERVING | PAUSING | PAUSED --stop()--> DRAINING --core stopped--> STOPPING
    STOPPING --threads joined, last flush--> STOPPED

- ``STARTING``: the consumer group is made, a first heartbeat goes out, the jobs this
  daemon id left pending in an earlier run are recovered. No thread runs yet.
- ``SERVING``: the intake reads jobs; everything runs.
- ``PAUSING``: an operator's ``drain`` (``wire.protocol`` control action): the intake stops
  reading once the read under way returns (it may still deliver jobs, which start).
- ``PAUSED``: the intake reads nothing; jobs stay in the stream for other daemons, work in
  flight goes on, reclaiming dead daemons' jobs goes on. Published as ``"draining": true``.
  ``resume`` goes back to ``SERVING``.
- ``DRAINING``: shutting down. The intake and the preparer have stopped (jobs read but not
  started stay pending under this id: the next daemon reclaims them); requests still
  waiting for a slot are handed back at once, those in flight finish within the grace
  period, then the rest are handed back too (the next daemon continues them). Events are
  still written, cancels and control commands still heard.
- ``STOPPING``: the core has stopped; the writer, heartbeat, cancel and control threads end,
  the last events are written, the heartbeat key is deleted.
- ``STOPPED``: nothing runs.

The operator's drain is a state, not a flag beside the lifecycle: it is the intake's only
difference, and a shutdown overrides it (``stop()`` leaves ``PAUSED`` for ``DRAINING``
like it leaves ``SERVING``).
"""

from __future__ import annotations

import logging
import threading
from enum import IntEnum

log = logging.getLogger(__name__)


class State(IntEnum):
    """Ordered: every state from DRAINING on is a shutdown."""

    STARTING = 0
    SERVING = 1
    PAUSING = 2
    PAUSED = 3
    DRAINING = 4
    STOPPING = 5
    STOPPED = 6


_NEXT: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.SERVING, State.DRAINING}),
    State.SERVING: frozenset({State.PAUSING, State.DRAINING}),
    State.PAUSING: frozenset({State.PAUSED, State.SERVING, State.DRAINING}),
    State.PAUSED: frozenset({State.SERVING, State.DRAINING}),
    State.DRAINING: frozenset({State.STOPPING}),
    State.STOPPING: frozenset({State.STOPPED}),
    State.STOPPED: frozenset(),
}

TAKING_JOBS = frozenset({State.SERVING, State.PAUSING, State.PAUSED})  # intake, preparer


class Lifecycle:
    """The current ``State``; safe to read and change from any thread."""

    def __init__(self) -> None:
        self._state = State.STARTING
        self._changed = threading.Condition()

    @property
    def state(self) -> State:
        return self._state

    @property
    def taking_jobs(self) -> bool:
        """Whether the intake and the preparer run (they end at ``DRAINING``)."""
        return self._state in TAKING_JOBS

    @property
    def running(self) -> bool:
        """Whether the writer, heartbeat, cancel and control threads run (until ``STOPPING``)."""
        return self._state < State.STOPPING

    def move(self, to: State) -> bool:
        """Go to ``to`` if the current state has an arrow there; False (nothing changes)
        otherwise, e.g. ``resume`` while shutting down."""
        with self._changed:
            if to not in _NEXT[self._state]:
                log.info("lifecycle: no way from %s to %s", self._state.name, to.name)
                return False
            log.info("lifecycle: %s -> %s", self._state.name, to.name)
            self._state = to
            self._changed.notify_all()
            return True

    def wait_for(self, states: frozenset[State] | set[State], timeout: float) -> bool:
        """Block until the state is one of ``states`` (True) or ``timeout`` passes (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: self._state in states, timeout)
