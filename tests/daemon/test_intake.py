"""The daemon's parts without a model: the wire shape a job must have, the intake's answers
to jobs it cannot start, and the lifecycle an operator's drain moves (real Redis, a fake core)."""

from __future__ import annotations

import threading
import uuid

import pytest
import redis

from scheduler_daemon.core.chat import message_pairs
from scheduler_daemon.core.job_input import sampling_params, submit_arguments
from scheduler_daemon.core.lifecycle import Lifecycle, State
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.control import Control
from scheduler_daemon.service.event_writer import EventWriter
from scheduler_daemon.service.intake import Intake, job_fingerprint
from tests.live_service import redis_conn
from wire import protocol
from wire.errors import InvalidParameter

DEEP_GRAMMAR = "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000


def job(**fields) -> protocol.Job:
    return protocol.Job(
        id=fields.pop("id", uuid.uuid4().hex), kind=fields.pop("kind", "completion"), model="m",
        tenant_id=fields.pop("tenant_id", "1"), cache_scope=fields.pop("cache_scope", "1"),
        **fields,
    )


# -- the wire shape -----------------------------------------------------------------------------


def test_the_daemon_checks_the_wire_shape_and_names_the_field():
    cases = {
        "kind": job(kind="poem", prompt="x"),
        "messages": job(kind="chat", prompt="x"),
        "prompt": job(messages=[{"role": "user", "content": "hi"}]),
        "max_queued": job(prompt="x", max_queued="many"),
        "cache_scope": job(prompt="x", cache_scope=7),
        "session": job(prompt="x", session=["s"]),
        "cache_prompt": job(prompt="x", cache_prompt="yes"),
        "params": job(prompt="x", params=["temperature", 0]),
        "temperature": job(prompt="x", params={"temperature": "warm"}),
        "grammar": job(prompt="x", params={"grammar": 5}),
        "json_schema": job(prompt="x", params={"json_schema": [1]}),
    }
    for field, bad in cases.items():
        with pytest.raises(InvalidParameter) as refused:
            submit_arguments(bad)
        assert refused.value.param == field


def test_messages_must_have_the_shape_the_web_sends():
    assert message_pairs([{"role": "user", "content": "hi"}]) == [("user", "hi")]
    bad = {
        "messages": [],
        "messages[0].role": [{"role": "wizard", "content": "hi"}],
        "messages[1].content": [{"role": "user", "content": "hi"},
                                {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    for field, messages in bad.items():
        with pytest.raises(InvalidParameter) as refused:
            message_pairs(messages)
        assert refused.value.param == field


def test_grammar_bounds_are_left_to_the_engine_that_compiles_them():
    """The web checked them; the engine checks them once more where it compiles them
    (``LlamaEngine.grammar_for``), not the daemon's intake a second time."""
    params = sampling_params({"grammar": DEEP_GRAMMAR, "max_tokens": 4, "stop": "x"})
    assert params.grammar == DEEP_GRAMMAR and params.max_tokens == 4 and params.stop == ("x",)
    schema = {"type": "string", "maxLength": 100_000}
    assert sampling_params({"json_schema": schema}).json_schema == (
        '{"type":"string","maxLength":100000}'
    )


def test_a_chat_job_passes_its_messages_and_a_completion_its_prompt():
    chat = submit_arguments(job(kind="chat", messages=[{"role": "user", "content": "hi"}],
                                prompt="ignored"))
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and chat["prompt"] is None
    completion = submit_arguments(job(prompt=[1, 2, 3], max_queued=3, session="s"))
    assert completion["prompt"] == [1, 2, 3] and completion["messages"] is None
    assert (completion["max_queued"], completion["session"]) == (3, "s")


def test_a_fingerprint_ignores_ids_but_not_the_tenant_or_the_request():
    one, two = job(prompt="hello", tenant_id="A"), job(prompt="hello", tenant_id="A")
    assert one.id != two.id and job_fingerprint(one) == job_fingerprint(two)
    assert job_fingerprint(one) != job_fingerprint(job(prompt="hello", tenant_id="B"))
    two.params = {"max_tokens": 5}
    assert job_fingerprint(one) != job_fingerprint(two)


# -- the intake's answers -----------------------------------------------------------------------


class BrokenCore:
    """A core whose ``enqueue`` fails with a bug (not a refusal)."""

    listeners: list = []

    def enqueue(self, **kwargs):
        raise RuntimeError("a bug while starting")

    def cancel(self, request_id: str) -> bool:
        return False

    def loop_state(self) -> dict:
        return {"stuck": False}


@pytest.fixture
def intake():
    client = redis_conn()
    lifecycle = Lifecycle()
    ctx = DaemonContext(client, f"m-{uuid.uuid4().hex[:6]}", "test-daemon", lifecycle)
    intake = Intake(ctx, BrokenCore(), EventWriter(ctx))
    intake.ensure_group()
    yield intake
    client.delete(intake.jobs_stream, intake.running_key)


def start(intake: Intake, queued: protocol.Job) -> tuple[str, dict]:
    """Queue a job in the stream, read it as the intake would, start it, flush: its last event."""
    intake.redis.xadd(intake.jobs_stream, queued.encode())
    [(entry_id, fields)] = intake._read(1)  # noqa: SLF001 - one read, no thread
    intake.start_job_safely(entry_id.decode(), protocol.Job.decode(fields))
    intake.writer.flush()
    [(_, last)] = intake.redis.xrange(protocol.events_stream(queued.id))[-1:]
    intake.redis.delete(protocol.events_stream(queued.id))
    return protocol.decode_event(last)


def test_a_failure_while_starting_a_job_ends_it_alone_with_internal_error(intake):
    kind, data = start(intake, job(prompt="x"))
    assert kind == "error" and data["code"] == "internal_error" and data["status"] == 500
    assert intake.rejected["internal_error"] == 1
    assert intake.redis.xpending(intake.jobs_stream, protocol.JOBS_GROUP)["pending"] == 0
    assert not intake.redis.hlen(intake.running_key)  # its running record went with its end


def test_a_job_of_the_wrong_shape_is_refused_naming_the_field(intake):
    kind, data = start(intake, job(prompt="x", max_queued="many"))
    assert kind == "error" and data["code"] == "invalid_request_error"
    assert data["param"] == "max_queued" and data["status"] == 400
    assert intake.rejected["invalid_request_error"] == 1


class AcceptingCore:
    """A core that accepts every job and runs none (its requests stay live)."""

    listeners: list = []

    def __init__(self) -> None:
        self.enqueued: list[str] = []

    def enqueue(self, **kwargs):
        self.enqueued.append(kwargs["request_id"])
        return 3

    def loop_state(self) -> dict:
        return {"stuck": False}

    def cancel(self, request_id: str) -> bool:
        return False


def test_a_second_job_with_a_live_requests_id_leaves_that_request_alone(intake):
    intake.core = AcceptingCore()
    first = job(prompt="x")
    kind, data = start(intake, first)
    assert kind == "accepted"
    intake.redis.xadd(intake.jobs_stream, first.encode())  # the same id again (a rogue writer)
    [(entry_id, fields)] = intake._read(1)  # noqa: SLF001 - one read, no thread
    intake.start_job_safely(entry_id.decode(), protocol.Job.decode(fields))
    intake.writer.flush()
    assert intake.core.enqueued == [first.id]  # the duplicate never reached the core
    assert not intake.redis.exists(protocol.events_stream(first.id))  # nothing written for it
    assert intake.redis.hexists(intake.running_key, first.id)  # the live request's record stays
    assert intake.rejected["duplicate_request_id"] == 1
    pending = intake.redis.xpending_range(intake.jobs_stream, protocol.JOBS_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] != [entry_id.decode()]  # acknowledged


# -- the lifecycle -------------------------------------------------------------------------------


def test_the_lifecycle_moves_only_along_its_arrows():
    life = Lifecycle()
    assert not life.move(State.PAUSING)  # not serving yet
    assert life.move(State.SERVING) and life.taking_jobs
    assert life.move(State.PAUSING) and life.move(State.PAUSED) and life.taking_jobs
    assert life.move(State.DRAINING) and not life.taking_jobs and life.running
    assert not life.move(State.SERVING)  # a resume during shutdown changes nothing
    assert life.move(State.STOPPING) and not life.running
    assert life.move(State.STOPPED) and not life.move(State.SERVING)


def test_a_drain_command_pauses_the_intake_and_resume_reopens_it():
    client = redis_conn()
    lifecycle = Lifecycle()
    ctx = DaemonContext(client, f"m-{uuid.uuid4().hex[:6]}", "test-daemon", lifecycle)
    intake = Intake(ctx, BrokenCore(), EventWriter(ctx))
    intake.ensure_group()
    beats = []
    control = Control(ctx, BrokenCore(), lambda: beats.append(1))
    lifecycle.move(State.SERVING)
    reader = threading.Thread(target=intake.read_loop)
    reader.start()
    try:
        control.apply({"action": "drain"})
        assert lifecycle.state is State.PAUSED and beats == [1]
        queued = job(prompt="x")
        client.xadd(intake.jobs_stream, queued.encode())
        assert not lifecycle.wait_for({State.SERVING}, timeout=0.2)
        assert len(intake.prepare) == 0  # nothing read while paused
        control.apply({"action": "resume"})
        assert lifecycle.state is State.SERVING
        got = intake.prepare.get(timeout=30)
        assert got is not None and got[1].id == queued.id
    finally:
        lifecycle.move(State.DRAINING)
        reader.join(30)
        client.delete(intake.jobs_stream)
    assert not reader.is_alive()


class ReplyLost:
    """A Redis client whose next ``eval`` runs, then raises as if the connection broke
    before its reply came (the jobs a TAKE took are pending under the daemon)."""

    def __init__(self, client) -> None:
        self.client, self.armed = client, True

    def eval(self, *args):
        reply = self.client.eval(*args)
        if self.armed:
            self.armed = False
            raise redis.ConnectionError("connection lost before the reply")
        return reply

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_jobs_taken_by_a_take_whose_reply_was_lost_are_taken_by_the_next(intake):
    real = intake.redis
    jobs = [job(prompt="x") for _ in range(2)]
    for queued in jobs:
        real.xadd(intake.jobs_stream, queued.encode())
    intake.redis = ReplyLost(real)
    intake._outage.failed = lambda exc: 0  # noqa: SLF001 - no backoff sleep in the test
    try:
        assert intake._read(2) == []  # noqa: SLF001 - taken in Redis, the reply lost
        assert intake.redis.xpending(intake.jobs_stream, protocol.JOBS_GROUP)["pending"] == 2
        got = intake._read(2)  # noqa: SLF001
    finally:
        intake.redis = real
    assert sorted(protocol.Job.decode(fields).id for _, fields in got) == sorted(
        j.id for j in jobs)
