"""The daemon's event writer against a real Redis, with no model: nothing buffered is lost
when a write fails, and a request's job entry is acknowledged with its end, whenever it ends."""

import time
import uuid

import pytest
import redis

from scheduler_daemon.core.state import FinishedEvent, RequestStats, TokenEvent
from scheduler_daemon.service import event_writer
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
    # idle for longer than an interval: a fresh grid; a flush a little early or late
    # keeps it
    assert next_slot(1.0, 2.0, interval) == 2.0 + interval
    assert next_slot(1.0, 0.99, interval) == 1.0 + interval
    assert next_slot(1.0, 1.01, interval) == 1.0 + interval


def flush_times(tick_ends: list[float], interval: float, early: float) -> list[float]:
    """When the writer flushes a stream's tokens: at the first tick end no more than
    ``early`` before its slot (a fresh grid at the first token, as after an idle spell)."""
    due, flushes = tick_ends[0], []
    for now in tick_ends:
        if now >= due - early:
            due = next_slot(due, now, interval)
            flushes.append(now)
    return flushes


def test_ticks_as_long_as_the_interval_never_double_a_gap():
    """A stream at 20 tokens/s with a 50 ms interval: every tick ends on the grid's own
    phase, so a tick a hair early (jitter) used to wait a whole tick, and the client saw a
    100 ms gap; a tick that ends a little before its slot now flushes it."""
    interval, jitter = 0.050, 0.002
    wobble = [((i * 7919) % 11 - 5) / 5 * jitter for i in range(400)]  # -2..+2 ms
    ticks = [i * interval + w for i, w in enumerate(wobble)]
    flushes = flush_times(ticks, interval, interval * event_writer.SLOT_EARLY)
    gaps = [b - a for a, b in zip(flushes, flushes[1:], strict=False)]
    assert len(flushes) == len(ticks)  # every tick's token in its own chunk
    assert max(gaps) <= interval + 2 * jitter + 1e-9
    # the old rule (a flush only at or past its slot) doubles gaps on these very ticks
    old = flush_times(ticks, interval, 0.0)
    assert max(b - a for a, b in zip(old, old[1:], strict=False)) > 1.5 * interval


def test_an_early_flush_writes_the_urgent_requests_alone():
    """A request's first text (or accepted, or end) goes at once, but it takes along only
    that request's events: the other streams' tokens wait for their slot, in order."""
    real = redis_conn()
    writer = EventWriter(DaemonContext(real, f"m-{uuid.uuid4().hex[:6]}", "d"),
                         stream_interval_s=1.0)
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    streams = [protocol.events_stream(a), protocol.events_stream(b)]
    try:
        writer.on_event(TokenEvent(a, "a1", 1, (1,)))  # a's first text: at once
        writer.flush()
        writer.on_event(TokenEvent(a, "a2", 1, (2,)))  # a's later token: its slot
        assert writer._flush_wait_s() > 0.5
        writer.on_event(TokenEvent(b, "b1", 1, (3,)))  # b's first text: at once, alone
        assert writer._flush_wait_s() == 0.0
        writer.flush()
        assert real.xlen(streams[0]) == 1 and real.xlen(streams[1]) == 1
        writer.on_event(TokenEvent(a, "a3", 1, (4,)))
        writer._next_due = time.monotonic()  # a's slot comes
        writer.flush()
        texts = [protocol.decode_event(f)[1]["text"] for _, f in real.xrange(streams[0])]
        assert texts == ["a1", "a2a3"]
    finally:
        real.delete(*streams)


def test_a_stream_ttl_is_renewed_by_its_start_its_end_and_seldom_between():
    real = redis_conn()
    writer = writer_on(real)
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    writer.track(request_id, "t", retention_s=600)
    try:
        writer.on_event(TokenEvent(request_id, "a", 1, (1,)))
        writer.flush()
        assert 590 < real.ttl(stream) <= 600
        real.expire(stream, 5000)
        writer.on_event(TokenEvent(request_id, "b", 1, (2,)))
        writer.flush()
        assert real.ttl(stream) > 4000  # a token's write alone: no EXPIRE
        writer.expire_renew_s = 0.0  # renewal due
        writer.on_event(TokenEvent(request_id, "c", 1, (3,)))
        writer.flush()
        assert 590 < real.ttl(stream) <= 600
        writer.expire_renew_s = 3600.0
        real.expire(stream, 5000)
        writer.on_event(finished(request_id))
        writer.flush()
        assert 590 < real.ttl(stream) <= 600  # the end: retention after the last event
    finally:
        real.delete(stream)


def test_the_writer_flushes_streamed_tokens_on_the_grid():
    writer = EventWriter(DaemonContext(redis_conn(), "m", "d"), stream_interval_s=1.0)
    request_id = uuid.uuid4().hex
    writer.on_event(TokenEvent(request_id, "a", 1, (1,)))  # the first text: at once
    assert writer._flush_wait_s() == 0.0
    with writer._cond:  # as flush() does, without Redis
        writer._buffer.items.clear()
        writer._buffer.urgent.clear()
    slot = time.monotonic() - 0.3  # the previous slot was 0.3 s ago, its flush just now
    writer._next_due = next_slot(slot, time.monotonic(), 1.0)
    writer.on_event(TokenEvent(request_id, "b", 1, (2,)))
    # due a second after the slot (less the early share), not a second after the flush
    assert 0.25 < writer._flush_wait_s() <= 0.7 - event_writer.SLOT_EARLY


def test_a_stopping_daemons_last_flush_writes_the_tokens_not_yet_due():
    """The daemon's last flush (after the grace, before it hands requests back) writes
    every buffered event, not only what is due: the next daemon continues a handed-back
    request from its stream, and tokens left in memory would be generated twice."""
    real = redis_conn()
    writer = EventWriter(DaemonContext(real, f"m-{uuid.uuid4().hex[:6]}", "d"),
                         stream_interval_s=60.0)
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    try:
        writer.on_event(TokenEvent(request_id, "a1", 1, (1,)))
        writer.flush()
        writer.on_event(TokenEvent(request_id, "a2", 1, (2,)))  # not due for a minute
        writer.flush()
        assert real.xlen(stream) == 1
        writer.flush(everything=True)
        texts = [protocol.decode_event(f)[1]["text"] for _, f in real.xrange(stream)]
        assert texts == ["a1", "a2"] and not writer._buffer.items
    finally:
        real.delete(stream)
