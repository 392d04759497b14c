"""The daemon's threads across a Redis outage, without a model: each one waits for Redis with
backoff and carries on when it is back, never ending (a thread that ends stops the daemon:
``SchedulerDaemon.healthy``). Each test starts and stops a redis-server of its own
(tests/live_service.RedisServer); the full daemon is tests/chaos/test_redis_restart.py."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import pytest
import redis

from scheduler_daemon.core.lifecycle import Lifecycle, State
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.control import Control
from scheduler_daemon.service.event_writer import EventWriter
from scheduler_daemon.service.heartbeat import Heartbeat
from scheduler_daemon.service.intake import Intake
from scheduler_daemon.service.recovery import Recovery
from tests.daemon.test_recovery import NoWriter, until_claimable
from tests.live_service import RedisServer, redis_conn, wait_until
from wire import protocol

OUTAGE_S = 1.5  # long enough for several failed tries of every thread


class FakeScheduler:
    def __init__(self) -> None:
        self.live: set[str] = set()

    def request_ids(self) -> set[str]:
        return set(self.live)


class FakeCore:
    """What the threads ask of the core: cancels, its requests, a snapshot, enqueue."""

    listeners: list = []

    def __init__(self) -> None:
        self.scheduler = FakeScheduler()
        self.cancelled: list[str] = []
        self.enqueued: list[str] = []

    def cancel(self, request_id: str) -> bool:
        self.cancelled.append(request_id)
        return True

    def snapshot(self) -> dict:
        return {}

    def loop_state(self) -> dict:
        return {"stuck": False}

    def enqueue(self, **kwargs) -> int:
        self.enqueued.append(kwargs["request_id"])
        return 3


@pytest.fixture
def server(tmp_path):
    server = RedisServer(tmp_path)  # not started: each test says when Redis is up
    yield server
    server.close()


def daemon_client(server: RedisServer) -> redis.Redis:
    """A client like run_scheduler's."""
    return redis.Redis.from_url(server.url, socket_timeout=5, health_check_interval=30)


def run(target: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def serving() -> Lifecycle:
    lifecycle = Lifecycle()
    lifecycle.move(State.SERVING)
    return lifecycle


def stop(lifecycle: Lifecycle, *threads: threading.Thread) -> None:
    lifecycle.move(State.DRAINING)
    lifecycle.move(State.STOPPING)
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


def test_cancels_are_heard_again_after_redis_comes_back_and_none_is_lost_meanwhile(server):
    core, lifecycle = FakeCore(), serving()
    core.scheduler.live = {"running-here", "also-here"}
    server.start()
    server.client().set(protocol.cancel_key("running-here"), 1)  # its publish went unheard
    server.stop()
    ctx = DaemonContext(daemon_client(server), "m", "d1", lifecycle)
    control = Control(ctx, core, lambda: None)
    thread = run(control.cancel_loop)
    time.sleep(OUTAGE_S)  # Redis down when the loop starts: it waits, it does not end
    assert thread.is_alive()
    server.start()  # the AOF kept the flag
    wait_until(lambda: core.cancelled == ["running-here"])  # read from its flag on subscribe
    server.restart(down_s=OUTAGE_S)
    client = server.client()
    wait_until(lambda: client.publish(protocol.CANCEL_CHANNEL, "also-here"), timeout_s=15)
    wait_until(lambda: "also-here" in core.cancelled)
    assert thread.is_alive()
    stop(lifecycle, thread)


def test_the_heartbeat_is_published_again_after_an_outage_longer_than_its_ttl(server):
    server.start()
    lifecycle = serving()
    beat = Heartbeat(DaemonContext(daemon_client(server), "m", "d1", lifecycle), FakeCore(),
                     rejected={})
    thread = run(beat.run)
    client = server.client()
    wait_until(lambda: client.exists(protocol.daemon_key("d1")))
    server.restart(down_s=protocol.HEARTBEAT_TTL_S + 1)  # the key expires meanwhile
    assert thread.is_alive()
    wait_until(lambda: client.exists(protocol.daemon_key("d1")), timeout_s=15)
    stop(lifecycle, thread)


def test_the_intake_reads_again_and_recreates_its_group_when_redis_comes_back_empty(server):
    lifecycle = serving()
    ctx = DaemonContext(daemon_client(server), "m", "d1", lifecycle)
    intake = Intake(ctx, FakeCore(), EventWriter(ctx))
    thread = run(intake.read_loop)
    time.sleep(OUTAGE_S)
    assert thread.is_alive()
    server.start()  # a Redis without the stream or its group (its data lost)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    wait_until(lambda: server.client().exists(protocol.jobs_stream("m")), timeout_s=15)
    server.client().xadd(protocol.jobs_stream("m"), job.encode())
    taken = wait_until(lambda: intake.prepare.get(timeout=0.1), timeout_s=15)
    assert taken[1].id == job.id
    stop(lifecycle, thread)


def test_a_job_whose_start_meets_an_outage_waits_for_redis_instead_of_failing(server):
    server.start()
    core, lifecycle = FakeCore(), serving()
    ctx = DaemonContext(daemon_client(server), "m", "d1", lifecycle)
    writer = EventWriter(ctx)
    intake = Intake(ctx, core, writer)
    intake.ensure_group()
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    server.client().xadd(intake.jobs_stream, job.encode())
    [(entry_id, fields)] = intake._read(1)  # noqa: SLF001 - one read, no thread
    server.stop()
    starting = run(lambda: intake.start_job_safely(entry_id.decode(), job))
    time.sleep(OUTAGE_S)
    assert starting.is_alive() and not core.enqueued  # waiting: not failed, not started
    server.start()
    starting.join(15)
    assert core.enqueued == [job.id]
    assert not intake.rejected  # no internal_error for a Redis outage
    writer.flush()
    kinds = [protocol.decode_event(f)[0]
             for _, f in server.client().xrange(protocol.events_stream(job.id))]
    assert kinds == ["accepted"]


def test_events_buffered_during_an_outage_are_written_once_when_redis_is_back(server):
    server.start()
    lifecycle = serving()
    writer = EventWriter(DaemonContext(daemon_client(server), "m", "d1", lifecycle))
    thread = run(writer.run)
    server.stop()
    request_id = uuid.uuid4().hex
    writer.terminal(request_id, "0-1", protocol.ERROR, {"code": "x", "message": "y"})
    time.sleep(OUTAGE_S)  # the writer's flushes fail meanwhile
    assert thread.is_alive()
    server.start()
    stream = protocol.events_stream(request_id)
    wait_until(lambda: server.client().exists(stream), timeout_s=15)
    stop(lifecycle, thread)  # the writer is done: what it wrote is all there is
    assert [protocol.decode_event(f)[0] for _, f in server.client().xrange(stream)] == ["error"]


def test_a_consumer_that_reads_is_not_reclaimed_though_its_heartbeat_key_is_gone():
    """After an outage longer than HEARTBEAT_TTL_S a live daemon's key is gone for a moment;
    its pending jobs stay its own while it keeps reading."""
    client = redis_conn()
    model = f"m-{uuid.uuid4().hex[:6]}"
    stream = protocol.jobs_stream(model)
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    client.xreadgroup(protocol.JOBS_GROUP, "live-daemon", {stream: ">"})  # it runs the job
    served: list[str] = []
    other = Recovery(DaemonContext(client, model, "other"), NoWriter(),
                     lambda _e, j, _t: served.append(j.id), None)
    try:
        until_claimable(client, stream)  # its entry is claimable by idle time
        client.xreadgroup(protocol.JOBS_GROUP, "live-daemon", {stream: ">"})  # still reading
        assert other.reclaim_dead() == 0
        assert served == []
        assert other.reclaim_dead(dead_idle_ms=0) == 1  # the rule, not the entry, kept it
        assert served == [job.id]
    finally:
        client.delete(stream)


def test_a_daemon_that_stopped_cleanly_is_reclaimed_without_the_idle_wait():
    """A SIGTERM'd daemon leaves its gone key: its handed-back jobs need not wait until its
    consumer looks idle (the rule above is for daemons that may still be alive)."""
    client = redis_conn()
    model = f"m-{uuid.uuid4().hex[:6]}"
    stream = protocol.jobs_stream(model)
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    name = f"stopped-{uuid.uuid4().hex[:6]}"
    client.xreadgroup(protocol.JOBS_GROUP, name, {stream: ">"})
    served: list[str] = []
    other = Recovery(DaemonContext(client, model, "other"), NoWriter(),
                     lambda _e, j, _t: served.append(j.id), None)
    try:
        until_claimable(client, stream)  # claimable by idle time, not dead by the rule
        assert other.reclaim_dead() == 0
        client.set(protocol.gone_key(name), 1, ex=60)
        assert other.reclaim_dead() == 1
        assert served == [job.id]
    finally:
        client.delete(stream, protocol.gone_key(name))
