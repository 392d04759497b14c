"""The daemon's event writer against a real Redis, with no model: nothing buffered is lost
when a write fails, and a request's job entry is acknowledged with its end, whenever it ends."""

import time
import uuid

import pytest
import redis

from scheduler_daemon.core.state import FinishedEvent, RequestStats, TokenEvent
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.event_writer import EventWriter, next_slot
from tests.live_service import redis_conn
from wire import protocol


class FlakyRedis:
    """The test Redis, except that the next ``failures`` pipelines fail on execute."""

    def __init__(self, real: redis.Redis, failures: int) -> None:
        self.real, self.failures = real, failures

    def pipeline(self, transaction: bool = False):
        pipe = self.real.pipeline(transaction=transaction)
        if self.failures:
            self.failures -= 1

            def down():
                raise redis.ConnectionError("Redis went away")

            pipe.execute = down
        return pipe


def writer_on(client) -> EventWriter:
    return EventWriter(DaemonContext(client, f"m-{uuid.uuid4().hex[:6]}", "test-daemon"))


def finished(request_id: str) -> FinishedEvent:
    stats = RequestStats(4, 0, 2, 1.0, 2.0, 3.0, None, None)
    return FinishedEvent(request_id, "length", stats)


def test_a_failed_write_keeps_the_events_for_the_next_one():
    real = redis_conn()
    writer = writer_on(FlakyRedis(real, failures=1))
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    try:
        writer.on_event(TokenEvent(request_id, "Hel", 1, (11,)))
        with pytest.raises(redis.ConnectionError):
            writer.flush()
        assert real.xlen(stream) == 0
        writer.on_event(TokenEvent(request_id, "lo", 1, (12,)))
        writer.flush()
        [(_, fields)] = real.xrange(stream)
        assert protocol.decode_event(fields) == (
            protocol.TOKEN, {"text": "Hello", "n_tokens": 2, "ids": [11, 12]}
        )
    finally:
        real.delete(stream)


@pytest.mark.parametrize("ends_while_submitted", [False, True])
def test_the_job_entry_is_acknowledged_with_the_end_even_if_it_ends_while_held(
    ends_while_submitted,
):
    """A request can end before its ``accepted`` is queued (a cancel during submit, a reply
    of one token): its end is held with its other events and must still ack its entry."""
    real = redis_conn()
    writer = writer_on(real)
    real.xgroup_create(writer.jobs_stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    entry_id = real.xadd(writer.jobs_stream, {"job": "{}"}).decode()
    real.xreadgroup(protocol.JOBS_GROUP, "test-daemon", {writer.jobs_stream: ">"})
    request_id = uuid.uuid4().hex
    try:
        writer.hold(request_id)
        writer.on_event(TokenEvent(request_id, "Hi", 2))
        if ends_while_submitted:
            writer.on_event(finished(request_id))
        writer.accepted(request_id, entry_id, prompt_tokens=4)
        if not ends_while_submitted:
            writer.on_event(finished(request_id))
        writer.flush()
        kinds = [protocol.decode_event(f)[0] for _, f in real.xrange(
            protocol.events_stream(request_id))]
        assert kinds == ["accepted", "token", "done"]
        assert real.xpending(writer.jobs_stream, protocol.JOBS_GROUP)["pending"] == 0
    finally:
        real.delete(writer.jobs_stream, protocol.events_stream(request_id))


class BrokenHistory:
    """A history sink that breaks its promise never to raise (a bug, a database driver)."""

    def mark_running(self, request_id, prompt_tokens):
        raise RuntimeError("the database is gone")

    def mark_finished(self, request_id, finish_reason, usage, timings, error_code=""):
        raise RuntimeError("the database is gone")


def test_a_history_sink_that_raises_never_loses_a_requests_events():
    """The sink runs inside the flush, after the buffer was taken: an exception there used
    to drop every event of that flush (the request never ended; its slot leaked)."""
    real = redis_conn()
    writer = EventWriter(DaemonContext(real, f"m-{uuid.uuid4().hex[:6]}", "test-daemon"),
                         history=BrokenHistory())
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    try:
        writer.hold(request_id)
        writer.accepted(request_id, "0-1", prompt_tokens=4)
        writer.on_event(TokenEvent(request_id, "Hi", 1))
        writer.on_event(finished(request_id))
        writer.flush()
        kinds = [protocol.decode_event(f)[0] for _, f in real.xrange(stream)]
        assert kinds == ["accepted", "token", "done"]
    finally:
        real.delete(stream)


def test_flush_slots_keep_to_the_interval_s_grid():
    """Tokens come at tick ends, so a flush lands after its slot; the next slot is one
    interval after the slot, not after the flush (issue 15: timed from the flush, a client
    at 50 ms with 34 ms ticks got a chunk every ~62 ms)."""
    interval, tick = 0.050, 0.034
    due, now, flushes = 0.0, 0.0, []
    for n in range(1, 301):  # 300 ticks; a flush at the first tick end past its slot
        now = n * tick
        if now >= due:
            due = next_slot(due, now, interval)
            flushes.append(now)
    gaps = [b - a for a, b in zip(flushes, flushes[1:], strict=False)]
    assert abs(sum(gaps) / len(gaps) - interval) < 0.002  # the client's mean gap
    assert max(gaps) <= interval + tick  # never a whole tick more than the interval
    # idle for longer than an interval (or an early, urgent flush): a fresh grid
    assert next_slot(1.0, 2.0, interval) == 2.0 + interval
    assert next_slot(1.0, 0.99, interval) == 0.99 + interval
    assert next_slot(1.0, 1.01, interval) == 1.0 + interval


def test_the_writer_flushes_streamed_tokens_on_the_grid():
    writer = EventWriter(DaemonContext(redis_conn(), "m", "d"), stream_interval_s=1.0)
    request_id = uuid.uuid4().hex
    writer.on_event(TokenEvent(request_id, "a", 1, (1,)))  # the first text: at once
    assert writer._flush_wait_s() == 0.0
    with writer._cond:  # as flush() does, without Redis
        writer._buffer.items.clear()
        writer._buffer.urgent = False
    slot = time.monotonic() - 0.3  # the previous slot was 0.3 s ago, its flush just now
    writer._next_due = next_slot(slot, time.monotonic(), 1.0)
    writer.on_event(TokenEvent(request_id, "b", 1, (2,)))
    assert 0.5 < writer._flush_wait_s() <= 0.7  # due a second after the slot, not the flush
