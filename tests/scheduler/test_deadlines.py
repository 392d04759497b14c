"""Deadlines with the fake engine: a request past its deadline ends with ``timeout`` wherever
it is (queued, prefilling, generating), its text so far sent and billed, its slot and KV
freed; one already past it when the daemon starts it is refused. The harness's clock moves
only when the scheduler reads it, so a test sets ``h.now`` past a deadline instead of
sleeping (nothing here passes or fails on wall time)."""

from __future__ import annotations

import time

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.job_input import submit_arguments
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import Request, SlotState, Status
from wire import protocol
from wire.errors import InvalidParameter, Refusal
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine


def req(rid: str, n_prompt: int, max_tokens: int = 1000, deadline: float | None = None) -> Request:
    return Request(id=rid, prompt_tokens=list(range(10, 10 + n_prompt)),
                   params=SamplingParams(max_tokens=max_tokens), deadline=deadline)


def steps_until(h, done, max_ticks: int = 200) -> None:
    for _ in range(max_ticks):
        if done():
            return
        h.step()
    raise AssertionError("hang guard: the condition never held")


def assert_timed_out(h, rid: str):
    end = h.finished(rid)
    assert end is not None, f"{rid} did not end"
    assert end.finish_reason == "error" and end.error["code"] == "timeout"
    return end


def test_a_generating_request_past_its_deadline_ends_with_its_text_and_frees_its_slot(harness):
    h = harness(FakeEngine(n_seq_max=1), cache_prompt=False)
    h.scheduler.submit(req("a", 4, deadline=h.now + 1.0))
    steps_until(h, lambda: len(h.text("a")) >= 3 * len("<1001>"))
    assert h.finished("a") is None
    sent = h.text("a")
    h.now += 1.0  # past a's deadline
    h.step()
    end = assert_timed_out(h, "a")
    assert h.text("a").startswith(sent)  # nothing taken back; the tail flushed
    assert end.stats.completion_tokens == h.text("a").count("<") > 0  # what it made is billed
    assert end.stats.prompt_tokens == 4
    slot = h.scheduler._slots[0]
    assert slot.state is SlotState.IDLE and slot.request is None
    assert h.engine.cells.get(0, 0) == 0  # its KV is gone, not kept as a cached prefix
    assert h.scheduler.counters["timeouts"] == 1
    # the one slot serves the next request
    h.scheduler.submit(req("b", 4, max_tokens=3))
    h.run()
    assert h.finished("b").finish_reason == "length"


def test_a_queued_request_expires_without_waiting_for_a_slot(harness):
    h = harness(FakeEngine(n_seq_max=1), cache_prompt=False)
    h.scheduler.submit(req("running", 4))  # holds the only slot, no deadline
    h.step()
    h.scheduler.submit(req("queued", 4, deadline=h.now + 1.0))
    h.step()
    assert h.scheduler.snapshot()["queue"][0]["request_id"] == "queued"
    h.now += 1.0
    plan = h.scheduler.schedule()
    h.scheduler.run(plan)
    assert "queued" in plan.cancelled  # ended before the batch was planned
    end = assert_timed_out(h, "queued")
    assert (end.stats.prompt_tokens, end.stats.completion_tokens) == (0, 0)  # nothing billed
    assert h.text("queued") == ""
    assert h.scheduler.snapshot()["queue"] == []
    assert h.finished("running") is None  # the others go on
    assert h.scheduler._slots[0].request.id == "running"


def test_a_prefilling_request_expires_between_chunks(harness):
    h = harness(FakeEngine(n_seq_max=2, n_batch=16), chunk_size=16, cache_prompt=False)
    h.scheduler.submit(req("long", 200, max_tokens=100, deadline=h.now + 1.0))
    h.step()
    h.step()
    assert h.scheduler._slots[0].state is SlotState.PREFILLING
    assert h.engine.cells[0] == 32
    h.now += 1.0
    h.step()
    end = assert_timed_out(h, "long")
    assert end.stats.completion_tokens == 0 and h.text("long") == ""
    assert h.scheduler._slots[0].state is SlotState.IDLE
    assert h.engine.cells[0] == 0
    assert not h.scheduler.has_work()


def test_requests_without_a_deadline_or_before_it_run_to_their_end(harness):
    h = harness(FakeEngine(n_seq_max=2), cache_prompt=False)
    h.scheduler.submit(req("none", 4, max_tokens=20))
    h.scheduler.submit(req("far", 4, max_tokens=20, deadline=h.now + 1e6))
    h.run()
    assert h.finished("none").finish_reason == "length"
    assert h.finished("far").finish_reason == "length"
    assert h.scheduler.counters["timeouts"] == 0


def _core(engine: FakeEngine) -> tuple[InferenceCore, list]:
    engine.n_vocab = 100_000
    core = InferenceCore(engine, SchedulerConfig(cache_prompt=False),
                         chat_template="{{ messages }}")
    events: list = []
    core.listeners.append(events.append)
    return core, events


def test_a_job_already_past_its_deadline_is_refused_before_it_is_queued():
    core, events = _core(FakeEngine())
    with pytest.raises(Refusal) as refused:
        core.enqueue(prompt=[1, 2, 3], request_id="late", deadline=time.time() - 0.01)
    assert refused.value.code == "timeout"
    assert core.scheduler.request_ids() == set() and events == []


def test_a_wall_clock_deadline_becomes_the_schedulers_own_clock():
    core, _ = _core(FakeEngine())
    before = time.monotonic()
    core.enqueue(prompt=[1, 2, 3], request_id="soon", deadline=time.time() + 30)
    state = core.scheduler._requests["soon"]
    assert before + 29 < state.deadline < time.monotonic() + 31
    core.enqueue(prompt=[1, 2, 3], request_id="never")
    assert core.scheduler._requests["never"].deadline is None
    assert core.scheduler._requests["never"].status is Status.WAITING


def _job(deadline) -> protocol.Job:
    return protocol.Job(id="j", kind="completion", model="m", tenant_id="1", cache_scope="1",
                        prompt="hi", deadline=deadline)


@pytest.mark.parametrize("deadline", ["soon", True, float("inf"), float("nan"), 10**400, [1]])
def test_a_deadline_of_the_wrong_wire_shape_is_refused_naming_it(deadline):
    with pytest.raises(InvalidParameter) as refused:
        submit_arguments(_job(deadline))
    assert refused.value.param == "deadline"


def test_the_wire_deadline_reaches_the_core():
    assert submit_arguments(_job(1_700_000_000))["deadline"] == 1_700_000_000.0
    assert submit_arguments(_job(None))["deadline"] is None
