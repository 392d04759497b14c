"""Fair admission across tenants (cache scopes): round-robin in front of each scope's FIFO."""

from __future__ import annotations

from scheduler_daemon.core.state import Request
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine


def req(rid: str, scope: str, n_prompt: int = 8, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, seed=0)
    return Request(
        id=rid,
        prompt_tokens=list(range(10, 10 + n_prompt)),
        params=params,
        cache_scope=scope,
        cache_prompt=False,
    )


def run_recording_admissions(h, max_ticks: int = 5000) -> list[str]:
    """Run to the end; the request ids in the order they were given a slot (the plans')."""
    h.run(max_ticks)
    return h.admitted()


def test_one_tenants_burst_does_not_starve_another(harness):
    h = harness(FakeEngine(n_seq_max=2), max_queue=64)
    for i in range(40):
        h.scheduler.submit(req(f"a{i}", "A"))
    h.scheduler.submit(req("b0", "B"))
    order = run_recording_admissions(h)
    assert len(order) == 41
    assert order.index("b0") <= 2  # within the first admissions, not after A's 40
    assert [r for r in order if r.startswith("a")] == [f"a{i}" for i in range(40)]  # A's own order


def test_turns_alternate_between_tenants_and_keep_each_fifo(harness):
    h = harness(FakeEngine(n_seq_max=1), max_queue=64)
    for i in range(4):
        h.scheduler.submit(req(f"a{i}", "A"))
    for i in range(2):
        h.scheduler.submit(req(f"b{i}", "B"))
    h.scheduler.submit(req("c0", "C"))
    order = run_recording_admissions(h)
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_cancelled_queued_job_leaves_the_turns_consistent(harness):
    h = harness(FakeEngine(n_seq_max=1), max_queue=64)
    h.scheduler.submit(req("a0", "A", max_tokens=8))
    h.scheduler.step()  # a0 holds the only slot
    h.scheduler.submit(req("b0", "B"))
    h.scheduler.submit(req("a1", "A"))
    h.scheduler.cancel("b0")
    h.run()
    assert h.finished("b0").finish_reason == "cancelled"
    assert h.finished("a1").finish_reason == "length"
    assert h.scheduler.snapshot()["queue"] == []


def test_a_single_tenant_is_still_strict_fifo(harness):
    h = harness(FakeEngine(n_seq_max=2), max_queue=64)
    for i in range(10):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=1 + (i % 3)))
    order = run_recording_admissions(h)
    assert order == [f"a{i}" for i in range(10)]
