"""Tokenize/detokenize jobs and the intake's room: they are answered one at a
time on the vocabulary thread (~1 s for 256 KiB), so they must not hold the room the intake
keeps for generation (N_PARALLEL + LOCAL_QUEUE); their own caps in flight refuse a burst,
per tenant (429 tenant_queue_full) and in all (503 queue_full), with Retry-After. A real
EventWriter and Redis, a fake core whose vocabulary answers wait for the test (pure
policy; the live tokenize tests are in tests/test_vocabulary_limits_e2e.py)."""

from __future__ import annotations

import threading
import uuid

from scheduler_daemon.core.lifecycle import Lifecycle, State
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.event_writer import EventWriter
from scheduler_daemon.service.intake import Intake
from tests.live_service import redis_conn, wait_until
from wire import errors, protocol


class Core:
    """Answers a tokenize once ``go`` is set (the vocabulary thread waits in it meanwhile)."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.answering = threading.Event()

    def loop_state(self) -> dict:
        return {"stuck": False}

    def vocabulary_answer(self, kind, prompt, params, messages=None, tools=None):
        self.answering.set()
        assert self.go.wait(30)
        return {"tokens": [1, 2]}, 2


def tokenize(tenant: str) -> protocol.Job:
    return protocol.Job(id=uuid.uuid4().hex, kind=protocol.TOKENIZE_KIND, model="m",
                        tenant_id=tenant, cache_scope=tenant, prompt="x" * 100,
                        params={"add_special": False, "with_pieces": False})


def setup(capacity: int = 8) -> tuple[Core, EventWriter, Intake, Lifecycle]:
    client = redis_conn()
    lifecycle = Lifecycle()
    lifecycle.move(State.SERVING)
    ctx = DaemonContext(client, "m", "d", lifecycle)
    writer = EventWriter(ctx)
    core = Core()
    intake = Intake(ctx, core, writer, capacity=capacity)
    return core, writer, intake, lifecycle


def start(intake: Intake, writer: EventWriter, job: protocol.Job) -> None:
    """What the preparer does for a tokenize job past its Redis checks."""
    writer.track(job.id, job.tenant_id)
    intake._answer_vocabulary(job, f"e-{job.id}")


def end_of(writer: EventWriter, job: protocol.Job) -> tuple[str, dict] | None:
    writer.flush()
    entries = writer.redis.xrange(protocol.events_stream(job.id))
    return protocol.decode_event(entries[-1][1]) if entries else None


def test_tokenize_jobs_in_flight_leave_generation_s_room_to_other_tenants():
    core, writer, intake, lifecycle = setup(capacity=8)
    try:
        burst = [tokenize("a") for _ in range(intake.vocab_tenant_jobs)]
        for job in burst[:2]:  # read, not yet started
            intake.prepare.put(f"e-{job.id}", job)
        assert intake.held() == 0 and intake.room() == 8
        for job in burst[2:]:  # started: one being answered, the rest queued for the thread
            start(intake, writer, job)
        assert core.answering.wait(10)
        assert intake.held() == 0 and intake.room() == 8
        chat = protocol.Job(id=uuid.uuid4().hex, kind="chat", model="m", tenant_id="b",
                            cache_scope="b", prompt="hi")
        intake.prepare.put("c", chat)
        assert intake.held() == 1
    finally:
        core.go.set()
        lifecycle.move(State.DRAINING)
        intake.join_vocabulary(10)


def test_a_tenant_s_tokenize_jobs_in_flight_are_capped():
    core, writer, intake, lifecycle = setup()
    intake.vocab_tenant_jobs, intake.vocab_jobs = 3, 5
    try:
        held = [tokenize("a") for _ in range(3)]
        for job in held:
            start(intake, writer, job)
        assert core.answering.wait(10)
        over = tokenize("a")
        start(intake, writer, over)
        kind, data = end_of(writer, over)
        assert kind == protocol.ERROR and data["code"] == errors.TENANT_QUEUE_FULL
        assert data["status"] == 429 and 1 <= data["retry_after_s"] <= 60
        assert data["max_queued"] == 3
        others = [tokenize("b"), tokenize("c")]  # another tenant's own share ...
        for job in others:
            start(intake, writer, job)
            assert end_of(writer, job) is None  # queued, not refused
        full = tokenize("d")  # ... until all tenants' jobs reach the total cap
        start(intake, writer, full)
        kind, data = end_of(writer, full)
        assert data["code"] == errors.QUEUE_FULL and data["status"] == 503
        assert 1 <= data["retry_after_s"] <= 60
        assert intake.rejected == {errors.TENANT_QUEUE_FULL: 1, errors.QUEUE_FULL: 1}
        core.go.set()  # answered: their ends written, the tenant's room is back
        for job in held + others:
            assert wait_until(lambda job=job: end_of(writer, job), 10)[0] == protocol.DONE
        assert wait_until(lambda: not intake.vocabulary_live(), 10)
        again = tokenize("a")
        start(intake, writer, again)
        assert wait_until(lambda: end_of(writer, again), 10)[0] == protocol.DONE
    finally:
        core.go.set()
        lifecycle.move(State.DRAINING)
        intake.join_vocabulary(10)
