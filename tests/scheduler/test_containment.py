"""One request's failure is that request's alone (policy, fake engine; the real daemon's
tests are in tests/daemon/test_blast_radius.py)."""

from __future__ import annotations

import time

import pytest

from scheduler_daemon.core.engine_api import GrammarEnded, RowFailed
from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import Request
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine, FakeSampler


def req(rid: str, scope: str = "A", n_prompt: int = 8, max_tokens: int = 6, seed: int = 0,
        **kw) -> Request:
    return Request(
        id=rid,
        prompt_tokens=list(range(10, 10 + n_prompt)),
        params=SamplingParams(max_tokens=max_tokens, seed=seed),
        cache_scope=scope,
        cache_prompt=False,
        **kw,
    )


class Raising(FakeSampler):
    """Fails on its ``fail_at``-th sample with ``error``."""

    def __init__(self, engine, params, fail_at: int, error: Exception) -> None:
        super().__init__(engine, params)
        self.fail_at, self.error = fail_at, error

    def sample(self, batch_index: int) -> int:
        token = super().sample(batch_index)
        if self.n == self.fail_at:
            raise self.error
        return token


def faulty_engine(**faults: tuple[int, Exception]) -> FakeEngine:
    """A fake engine whose samplers for the given seeds ("s<seed>") fail."""
    engine = FakeEngine(n_seq_max=4)
    make = engine.new_sampler

    def new_sampler(params: SamplingParams):
        fault = faults.get(f"s{params.seed}")
        if fault is None:
            return make(params)
        sampler = Raising(engine, params, *fault)
        engine.samplers.append(sampler)
        return sampler

    engine.new_sampler = new_sampler
    return engine


@pytest.mark.parametrize("error", [RowFailed("no token"), ValueError("bug"), UnicodeDecodeError(
    "utf-8", b"\xff", 0, 1, "bad")])
def test_a_sampler_failure_fails_that_request_alone(harness, error):
    h = harness(faulty_engine(s7=(3, error)))
    h.scheduler.submit(req("bad", seed=7))
    h.scheduler.submit(req("good", seed=1))
    h.run()
    bad, good = h.finished("bad"), h.finished("good")
    assert bad.finish_reason == "error" and bad.error["code"] == "engine_error"
    assert good.finish_reason == "length" and good.stats.completion_tokens == 6
    assert h.scheduler.counters["request_failures"] == 1
    assert h.scheduler.snapshot()["kv"]["blocks_used"] == 0
    assert all(s["state"] == "idle" for s in h.scheduler.snapshot()["slots"])
    assert h.engine.samplers[0].closed


def test_a_complete_grammar_ends_the_request_with_stop(harness):
    h = harness(faulty_engine(s7=(2, GrammarEnded())))
    h.scheduler.submit(req("g", seed=7))
    h.run()
    done = h.finished("g")
    assert done.finish_reason == "stop" and done.error is None
    assert done.stats.completion_tokens == 1


def test_a_failing_text_decoder_fails_that_request_alone(harness):
    engine = FakeEngine()
    token_bytes = engine.token_bytes
    engine.scripts = {5: [1001, 666, 1002]}

    def failing(token: int) -> bytes:
        if token == 666:
            raise RuntimeError("detokenizer bug")
        return token_bytes(token)

    engine.token_bytes = failing
    h = harness(engine)
    h.scheduler.submit(req("bad", seed=5))
    h.scheduler.submit(req("good", seed=1))
    h.run()
    assert h.finished("bad").finish_reason == "error"
    assert h.finished("good").finish_reason == "length"


def test_a_failing_finish_still_ends_the_request_and_frees_the_slot(harness):
    h = harness(faulty_engine(s7=(2, RowFailed("x"))))
    h.scheduler.submit(req("bad", seed=7))
    h.scheduler.submit(req("good", seed=1))
    state = h.scheduler._requests["bad"]  # noqa: SLF001 - its text decoder is the fault
    state.text = BrokenFlush(state.text)
    h.run()
    assert h.finished("bad").finish_reason == "error"
    assert h.finished("good").finish_reason == "length"
    assert h.scheduler.snapshot()["kv"]["blocks_used"] == 0


class BrokenFlush:
    """A text stream whose final flush fails."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def flush(self) -> str:
        raise RuntimeError("flush bug")


def _core_with(engine: FakeEngine) -> tuple[InferenceCore, dict[str, list]]:
    engine.n_vocab = 100_000
    core = InferenceCore(engine, SchedulerConfig(), chat_template="{{ messages }}")
    events: dict[str, list] = {}
    core.listeners.append(lambda e: events.setdefault(e.request_id, []).append(e))
    return core, events


def _wait(check, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "hang guard"
        time.sleep(0.01)


def test_a_tick_that_raises_fails_its_batch_not_every_request():
    engine = FakeEngine(n_seq_max=1)
    core, events = _core_with(engine)
    decode = engine.decode
    calls = {"n": 0}

    def flaky(rows, abortable=False):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("a bug in this tick")
        return decode(rows, abortable)

    engine.decode = flaky
    core.start()
    try:
        first = core.submit(prompt=[5, 6, 7], params=SamplingParams(max_tokens=4))
        second = core.submit(prompt=[5, 6, 8], params=SamplingParams(max_tokens=4))
        assert first.result(timeout=10).finished.finish_reason == "error"
        assert second.result(timeout=10).finished.finish_reason == "length"
        assert core.scheduler.counters["tick_failures"] == 1
    finally:
        core.stop(grace_s=1)


def test_ticks_that_keep_failing_with_no_request_to_blame_fail_everything():
    engine = FakeEngine(n_seq_max=1)
    core, _ = _core_with(engine)
    core.scheduler.fail_tick = lambda exc: 0  # as if no request were in the failing batch
    engine.decode = lambda rows, abortable=False: (_ for _ in ()).throw(RuntimeError("dead"))
    core.start()
    try:
        handle = core.submit(prompt=[5, 6, 7], params=SamplingParams(max_tokens=4))
        assert handle.result(timeout=10).finished.finish_reason == "error"
    finally:
        core.stop(grace_s=1)


def test_prompt_bytes_are_capped_before_anything_tokenizes_them():
    engine = FakeEngine()
    core, _ = _core_with(engine)
    core.max_prompt_bytes = 10
    with pytest.raises(Refusal) as refused:
        core.submit(prompt="é" * 6)  # 12 bytes
    assert refused.value.param == "prompt" and "10" in refused.value.message
    with pytest.raises(Refusal) as refused:
        core.submit(messages=[{"role": "user", "content": "x" * 11}])
    assert refused.value.param == "messages"


def test_a_scopes_waiting_jobs_are_capped(harness):
    h = harness(FakeEngine(n_seq_max=1), max_queue=10, max_queue_per_scope=2)
    h.scheduler.submit(req("a0"))
    h.scheduler.step()  # a0 takes the only slot
    h.scheduler.submit(req("a1"))
    h.scheduler.submit(req("a2"))
    with pytest.raises(Refusal) as refused:
        h.scheduler.submit(req("a3"))
    assert refused.value.code == "tenant_queue_full"
    h.scheduler.submit(req("b0", scope="B"))  # another tenant still gets in
    with pytest.raises(Refusal):
        h.scheduler.submit(req("a4", max_queued=1))  # a tenant's own cap wins
    h.scheduler.submit(req("b1", scope="B", max_queued=5))
    h.run()
    assert {r for r in ("a0", "a1", "a2", "b0", "b1") if h.finished(r).finish_reason == "length"} \
        == {"a0", "a1", "a2", "b0", "b1"}


def test_one_scope_cannot_reserve_more_than_its_kv_share(harness):
    engine = FakeEngine(n_ctx=1024, n_seq_max=4)
    h = harness(engine, kv_block_tokens=64, kv_scope_share=0.5)
    assert h.scheduler.max_request_tokens == 512
    with pytest.raises(Refusal) as refused:
        h.scheduler.submit(req("huge", n_prompt=8, max_tokens=600))
    assert refused.value.code == "device_memory_budget_exceeded"
    h.scheduler.submit(req("a0", n_prompt=8, max_tokens=400))  # 7 of A's 8 blocks
    h.scheduler.submit(req("a1", n_prompt=8, max_tokens=100))  # would take A past its share
    h.scheduler.submit(req("b0", scope="B", n_prompt=8, max_tokens=4))
    h.scheduler.step()
    running = {s["request_id"] for s in h.scheduler.snapshot()["slots"]} - {None}
    assert running == {"a0", "b0"}  # a1 waits for A's own blocks; B is not locked out
    h.run()
    assert h.finished("a1").finish_reason == "length"


def test_a_request_cancelled_while_waiting_is_billed_nothing(harness):
    h = harness(FakeEngine(n_seq_max=1))
    h.scheduler.submit(req("a0"))
    h.scheduler.submit(req("a1", n_prompt=50))
    h.scheduler.step()
    h.scheduler.cancel("a1")
    h.run()
    stats = h.finished("a1").stats
    assert h.finished("a1").finish_reason == "cancelled"
    assert stats.prompt_tokens == 0 and stats.completion_tokens == 0
    assert h.finished("a0").stats.prompt_tokens == 8
