"""The intake's count of jobs on their way into the core (``Intake.arriving``, read by the
scheduler's ``await_arrivals``): nothing once the daemon no longer serves. A draining intake
starts nothing more, so a count left over from its last read (or its prepare queue, which
goes back to Redis) would make every tick of the requests still finishing wait."""

from __future__ import annotations

from scheduler_daemon.core.lifecycle import Lifecycle, State
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.event_writer import EventWriter
from scheduler_daemon.service.intake import Intake
from tests.daemon.test_redis_reconnect import FakeCore
from tests.live_service import redis_conn


def test_a_draining_intake_has_nothing_on_its_way():
    lifecycle = Lifecycle()
    lifecycle.move(State.SERVING)
    ctx = DaemonContext(redis_conn(), "m", "d-arrivals", lifecycle)
    intake = Intake(ctx, FakeCore(), EventWriter(ctx))
    intake._looking = True  # its last read took jobs and it was taking again
    assert intake.arriving() == 1
    lifecycle.move(State.DRAINING)
    assert intake.arriving() == 0
