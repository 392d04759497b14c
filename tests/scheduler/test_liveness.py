"""The loop's liveness is readable while the loop is stuck, and nothing that reads it waits.

A fake engine whose decode never returns stands in for a native call that hangs (outside the
scheduler's lock, as ``llama_decode`` runs), and a loop that holds the scheduler's lock for
good stands in for a sampler that hangs (sampling runs under it). The real hang, with the
supervisor's watchdog killing the daemon, is tests/daemon/test_watchdog.py.
"""

from __future__ import annotations

import threading
import time

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.liveness import RUNNING, STOPPED, UNARMED, LoopClock
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import FinishedEvent, Request
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine, FakeSampler


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def in_thread(fn, timeout_s: float = 5.0):
    """Run ``fn`` on another thread; its result, or an assertion error if it blocks."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{fn} blocked"
    return out[0]


def watched_core(engine: FakeEngine) -> InferenceCore:
    """A core over ``engine`` that says "stuck" after 0.3 s."""
    core = InferenceCore(engine, SchedulerConfig(chunk_size=64), chat_template="{{ messages }}")
    core.stuck_after_s = 0.3
    return core


def make_core() -> tuple[InferenceCore, FakeEngine, list[FinishedEvent]]:
    engine = FakeEngine()
    core = watched_core(engine)
    ends: list[FinishedEvent] = []
    core.listeners.append(lambda e: ends.append(e) if isinstance(e, FinishedEvent) else None)
    return core, engine, ends


def submit(core: InferenceCore, request_id: str, max_tokens: int = 50) -> None:
    core.scheduler.submit(Request(id=request_id, prompt_tokens=[1, 2, 3, 4],
                                  params=SamplingParams(max_tokens=max_tokens)))


def test_the_clock_is_unarmed_then_running_then_stopped(tmp_path):
    path = LoopClock.new_file()
    try:
        writer, reader = LoopClock(path), LoopClock(path)  # two mappings of one file
        assert reader.read()[0] == UNARMED and reader.stalled_s() is None
        writer.mark()
        writer.mark()
        state, turns, _, _, _ = reader.read()
        assert (state, turns) == (RUNNING, 2) and reader.stalled_s() < 5
        assert reader.calling_s() is None
        entered, leave = threading.Event(), threading.Event()

        def other_call() -> None:
            with writer.calling():
                entered.set()
                leave.wait()

        with writer.calling():  # a native call off the loop
            assert 0 <= reader.calling_s() < 5
            first = reader.read()[3]
            other = threading.Thread(target=other_call)
            other.start()
            entered.wait()
            assert reader.read()[3] == first  # the oldest call counts
        assert reader.read()[3] > first  # the first ended: the other one is the oldest now
        leave.set()
        other.join()
        assert reader.calling_s() is None
        assert reader.stalled_s(now=time.monotonic() + 100) > 99
        writer.stop()
        assert reader.read()[0] == STOPPED and reader.stalled_s() is None
        writer.reset()
        assert reader.read() == (UNARMED, 0, 0.0, 0.0, 0.0)
    finally:
        path.unlink()


def test_an_idle_loop_keeps_marking_and_a_stopped_one_is_not_watched():
    core, _, _ = make_core()
    core.start()
    try:
        wait_until(lambda: core.loop_state()["turns"] >= 3)  # idle waits are turns too
        state = core.loop_state()
        assert state["running"] and not state["stuck"]
    finally:
        core.stop(grace_s=1)
    state = core.loop_state()
    assert (state["stalled_s"], state["stuck"], state["running"]) == (None, False, False)
    assert 0 < state["longest_turn_s"] < 5  # idle turns wait 0.25 s at most


def test_a_decode_that_never_returns_shows_as_stuck_and_nothing_waits_for_it():
    core, engine, ends = make_core()
    release = threading.Event()
    engine.on_decode = lambda rows: release.wait()
    core.start()
    try:
        submit(core, "a")
        wait_until(lambda: core.loop_state()["stuck"])
        snap = in_thread(core.snapshot)
        assert snap["loop"]["stuck"] and snap["loop"]["stalled_s"] >= 0.3
        assert in_thread(lambda: core.cancel("a")) is True
        release.set()  # the call returns after all: the loop goes on, the cancel applies
        wait_until(lambda: [e.request_id for e in ends] == ["a"])
        assert ends[0].finish_reason == "cancelled"
        wait_until(lambda: not core.loop_state()["stuck"])
    finally:
        release.set()
        core.stop(grace_s=1)


def test_a_loop_stuck_holding_the_lock_still_gives_a_snapshot_and_takes_cancels():
    core, engine, ends = make_core()
    hold, release = threading.Event(), threading.Event()

    def stuck_under_the_lock(_stats) -> None:  # as a sampler that never returns would be
        if hold.is_set():
            with core.scheduler.lock:
                release.wait()

    core.tick_listeners.append(stuck_under_the_lock)
    core.start()
    try:
        # a decode takes a moment outside the lock, as a real one does (a loop of instant
        # decodes can keep the snapshot from the lock past its wait)
        engine.on_decode = lambda rows: time.sleep(0.001)
        submit(core, "a", max_tokens=1000)
        wait_until(lambda: core.snapshot()["slots"][0]["state"] == "generating")
        hold.set()
        wait_until(lambda: core.loop_state()["stuck"])
        wait_until(lambda: core.scheduler.lock.acquire(blocking=False) is False)
        snap = in_thread(core.snapshot)
        assert snap["stale"] is True and snap["loop"]["stuck"]
        assert snap["slots"][0]["state"] == "generating"  # the last state it could read
        assert in_thread(lambda: core.cancel("a")) is True  # deferred: the lock is taken
        assert ends == []
        hold.clear()
        release.set()
        wait_until(lambda: [e.request_id for e in ends] == ["a"])
        assert ends[0].finish_reason == "cancelled"  # the deferred cancel applied
        assert "stale" not in core.snapshot()
    finally:
        hold.clear()
        release.set()
        core.stop(grace_s=1)


class StuckSampler(FakeSampler):
    """A sampler that never returns (until released), as llama.cpp's over a bad grammar."""

    release = threading.Event()

    def sample(self, batch_index: int) -> int:
        if self.seed == 7:
            self.release.wait()
        return super().sample(batch_index)


class StuckSamplerEngine(FakeEngine):
    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        sampler = StuckSampler(self, params)
        self.samplers.append(sampler)
        return sampler


def test_a_loop_stuck_in_one_requests_sampler_names_that_request():
    engine = StuckSamplerEngine()
    core = watched_core(engine)
    ends: list[FinishedEvent] = []
    core.listeners.append(lambda e: ends.append(e) if isinstance(e, FinishedEvent) else None)
    StuckSampler.release.clear()
    core.start()
    try:
        core.scheduler.submit(Request(id="innocent", prompt_tokens=[1, 2, 3],
                                      params=SamplingParams(max_tokens=500, seed=1)))
        core.scheduler.submit(Request(id="guilty#0", prompt_tokens=[4, 5, 6],
                                      params=SamplingParams(max_tokens=5, seed=7)))
        wait_until(lambda: core.loop_state()["stuck"])
        assert in_thread(core.loop_state)["stuck_on"] == "guilty"  # the job, not the choice
        wait_until(lambda: core.clock.sampling_s() > 0.3)  # the sampler deadline's clock runs
        StuckSampler.release.set()
        wait_until(lambda: not core.loop_state()["stuck"])
        assert core.loop_state()["stuck_on"] is None
        # the innocent request samples on after the release: once both are done, no sampling
        wait_until(lambda: sorted(e.request_id for e in ends) == ["guilty#0", "innocent"])
        assert in_thread(lambda: core.scheduler.sampling) is None
        assert core.clock.sampling_s() is None
    finally:
        StuckSampler.release.set()
        core.stop(grace_s=0)


class StuckTokenizerEngine(FakeEngine):
    release = threading.Event()

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        self.release.wait()
        return [1, 2]


def test_a_native_call_for_a_job_off_the_loop_that_does_not_return_shows_as_stuck():
    """The preparer's (or the vocabulary thread's) calls into llama.cpp are watched too."""
    engine = StuckTokenizerEngine()
    core = watched_core(engine)
    StuckTokenizerEngine.release.clear()
    core.start()
    caller = threading.Thread(target=lambda: core.vocabulary_answer(
        "tokenize", "some text", {"add_special": True, "with_pieces": False}), daemon=True)
    try:
        caller.start()
        wait_until(lambda: core.loop_state()["stuck"])
        state = core.loop_state()
        assert state["calling_s"] >= 0.3 and state["stalled_s"] < 0.3  # the loop itself turns
        StuckTokenizerEngine.release.set()
        caller.join(5)
        wait_until(lambda: not core.loop_state()["stuck"])
        assert core.loop_state()["calling_s"] is None
    finally:
        StuckTokenizerEngine.release.set()
        core.stop(grace_s=0)


class CancelWhilePlanning(FakeEngine):
    """Another thread cancels ``victim`` while the loop plans a tick (holding the lock): at the
    KV removal the plan makes to give a new admission a slot another scope's prefix held."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.cancel = None
        self.answers: list = []

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        if self.cancel is not None:
            cancel, self.cancel = self.cancel, None
            other = threading.Thread(target=lambda: self.answers.append(cancel()))
            other.start()
            other.join()
        return super().kv_remove(seq_id, p0, p1)


def test_a_cancel_deferred_while_a_plan_is_made_aborts_that_plans_decode(harness):
    engine = CancelWhilePlanning(n_ctx=4096, n_seq_max=2)
    h = harness(engine, abort_min_tokens=1, chunk_size=64)
    prompt = list(range(10, 20))
    h.scheduler.submit(Request(id="z", prompt_tokens=prompt, cache_scope="z",
                               params=SamplingParams(max_tokens=2)))
    h.run()  # z's prefix stays cached in its slot
    h.scheduler.submit(Request(id="a", prompt_tokens=prompt, params=SamplingParams(max_tokens=99)))
    for _ in range(3):
        h.step()
    assert h.scheduler.counters["aborted_decodes"] == 0
    engine.cancel = lambda: h.scheduler.cancel("a", block=False)
    h.scheduler.submit(Request(id="b", prompt_tokens=list(range(30, 40)),
                               params=SamplingParams(max_tokens=3), cache_scope="b"))
    h.step()  # b takes z's slot: z's cells go during the plan, and a is cancelled then
    assert engine.answers == [None]  # the lock was taken: deferred, not known
    assert h.scheduler.counters["aborted_decodes"] == 1  # that tick's decode did not run
    h.run()
    assert h.finished("a").finish_reason == "cancelled"
    assert h.finished("b").finish_reason == "length"


def test_a_stuck_call_off_the_loop_blames_its_job_not_the_request_the_loop_samples():
    engine = StuckTokenizerEngine()
    engine.n_vocab = 100_000
    core = watched_core(engine)
    StuckTokenizerEngine.release.clear()
    core.start()
    try:
        core.scheduler.submit(Request(id="busy", prompt_tokens=[1, 2, 3],
                                      params=SamplingParams(max_tokens=1000)))
        caller = threading.Thread(target=lambda: core.enqueue(prompt="some text",
                                                              request_id="prep-1"), daemon=True)
        caller.start()
        wait_until(lambda: core.loop_state()["stuck"])
        state = core.loop_state()
        assert state["stuck_on"] == "prep-1" and state["stalled_s"] < 0.3
        StuckTokenizerEngine.release.set()
        caller.join(5)
        wait_until(lambda: core.loop_state()["stuck_on"] is None)
    finally:
        StuckTokenizerEngine.release.set()
        core.stop(grace_s=0)
