"""A burst's first tick (``Scheduler.await_arrivals``): requests the intake has taken and not
yet submitted are waited for while free slots would stay empty, so a burst is prefilled in
one batch, as llama-server's first batch holds all of its slots."""

from __future__ import annotations

import threading
import time

from .fake_engine import FakeEngine
from .test_plan import req


class Intake:
    """Stands in for the daemon's intake: ``count`` jobs taken together, submitted one by one
    by a preparer thread ``gap_s`` apart (its Redis checks and tokenizing)."""

    def __init__(self, scheduler, count: int, gap_s: float) -> None:
        self.scheduler = scheduler
        self.pending = count
        self.gap_s = gap_s
        self.first = threading.Event()
        scheduler.arrivals = lambda: self.pending

    def prepare(self) -> None:
        for i in range(self.pending):
            if i:
                time.sleep(self.gap_s)
            self.scheduler.submit(req(f"r{i}", 40 + i, cache_prompt=False))
            self.pending -= 1
            self.first.set()

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.prepare)
        thread.start()
        self.first.wait(5)
        return thread


def test_a_burst_of_four_taken_together_is_prefilled_in_the_same_first_tick(harness):
    h = harness(FakeEngine(n_batch=512), cache_prompt=False)
    preparer = Intake(h.scheduler, 4, gap_s=0.005).start()
    h.step()  # the loop wakes at the first submit, as the daemon's does
    preparer.join()
    plan = h.plans[0]
    assert plan.admitted == ["r0", "r1", "r2", "r3"]
    assert plan.prefill_chunks() == {"r0": 40, "r1": 41, "r2": 42, "r3": 43}
    assert h.scheduler.counters["arrival_waits"] == 1
    h.run()
    assert all(h.finished(f"r{i}").finish_reason == "length" for i in range(4))


def test_a_request_alone_waits_for_nothing(harness):
    h = harness(FakeEngine(), cache_prompt=False)
    h.scheduler.arrivals = lambda: 0
    h.scheduler.submit(req("a", 8))
    assert h.scheduler.await_arrivals() < 0.01
    h.step()
    assert h.plans[0].admitted == ["a"] and h.scheduler.counters["arrival_waits"] == 0


def test_the_wait_is_bounded_and_ends_when_the_queue_fills_the_free_slots(harness):
    h = harness(FakeEngine(n_seq_max=2), cache_prompt=False, arrival_wait_s=0.03)
    h.scheduler.arrivals = lambda: 1  # an arrival that never comes (a job refused, say)
    h.scheduler.submit(req("a", 8))
    t0 = time.monotonic()
    h.step()
    assert 0.02 <= time.monotonic() - t0 < 1.0  # the harness's clock: 1 ms a reading
    assert h.plans[0].admitted == ["a"]
    assert h.scheduler.counters["arrival_wait_timeouts"] == 1
    h.scheduler.submit(req("b", 8))  # the last free slot is b's: nothing to wait for
    assert h.scheduler.await_arrivals() < 0.01
    h.step()
    assert h.plans[1].admitted == ["b"]
    h.run()


# -- one prompt finished per tick (PREFILL_PROMPTS_PER_TICK=1, the daemon's default) ----------


def test_a_burst_finishes_one_prompt_a_tick_oldest_first_beside_the_earlier_decodes(harness):
    h = harness(FakeEngine(n_batch=512), cache_prompt=False, prompts_per_tick=1)
    for i in (0, 1, 2, 3):
        h.scheduler.submit(req(f"r{i}", 40 + i, max_tokens=8))
    for tick in range(4):
        h.step()
        plan = h.plans[-1]
        assert plan.prefill_chunks() == {f"r{tick}": 40 + tick}  # the oldest waiting prompt
        assert plan.decoding() == [f"r{i}" for i in range(tick)]  # the earlier ones decode
    assert h.plans[0].admitted == ["r0", "r1", "r2", "r3"]  # all hold slots from the start
    h.step()  # each first token came one tick after the previous one, not all at the 4th
    assert h.plans[-1].decoding() == ["r0", "r1", "r2", "r3"]
    h.run()
    assert all(h.finished(f"r{i}").finish_reason == "length" for i in range(4))


def test_chunks_that_do_not_finish_a_prompt_are_not_limited(harness):
    h = harness(FakeEngine(n_batch=64), chunk_size=16, cache_prompt=False, prompts_per_tick=1)
    h.scheduler.submit(req("long", 100, max_tokens=4))
    h.scheduler.submit(req("s1", 10, max_tokens=4))
    h.scheduler.submit(req("s2", 12, max_tokens=4))
    h.step()
    # the long prompt's chunk and the older short one's whole prompt; s2 waits its turn
    assert h.plans[0].prefill_chunks() == {"long": 16, "s1": 10}
    h.step()
    assert h.plans[1].prefill_chunks() == {"long": 16, "s2": 12}
    assert h.plans[1].decoding() == ["s1"]
    h.run()


def test_under_the_limit_a_tick_does_not_wait_for_arrivals(harness):
    h = harness(FakeEngine(), cache_prompt=False, prompts_per_tick=1)
    h.scheduler.arrivals = lambda: 3  # the rest of a burst, on its way
    h.scheduler.submit(req("a", 8))
    assert h.scheduler.await_arrivals() < 0.01  # the tick could not finish theirs anyway
    h.step()
    assert h.plans[0].prefill_chunks() == {"a": 8}
    h.run()


def test_a_tick_with_a_running_stream_never_waits_for_arrivals(harness):
    """Only a burst's first tick waits: one tenant's jobs always on their way (a steady
    flow of tiny requests being tokenized) must not slow another's running stream."""
    h = harness(FakeEngine(n_seq_max=4), cache_prompt=False, arrival_wait_s=0.05)
    h.scheduler.arrivals = lambda: 0
    h.scheduler.submit(req("a", 8, max_tokens=6))
    h.step()  # a prefilled: it decodes from now on
    h.scheduler.arrivals = lambda: 2  # always something on its way, slots free
    assert h.scheduler.await_arrivals() < 0.01
    assert h.scheduler.counters["arrival_wait_timeouts"] == 0
