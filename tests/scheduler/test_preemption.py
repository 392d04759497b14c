"""Preemption over the fake engine: while another scope waits, a scope holding more than its
fair share of the slots gives one up; the preempted request resumes where it stopped.

Each rule has its test: only for another scope, only the scope over its share (two slots
more than the waiting one), the victim, the minimum run, the order of resumes, the
fallback to recompute, and ends while preempted. The fake sampler of seed s yields
1000 + 100 s + n for its n-th sample, so a stream that lost or repeated a sample shows it.
"""

from __future__ import annotations

from scheduler_daemon.core.plan import Phase
from scheduler_daemon.core.ram_cache import RamCache
from scheduler_daemon.core.state import Request, TokenEvent
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine

PROMPT = list(range(10, 18))  # 8 tokens


def req(rid: str, scope: str, max_tokens: int = 40, seed: int = 0, **params) -> Request:
    return Request(id=rid, prompt_tokens=list(PROMPT),
                   params=SamplingParams(max_tokens=max_tokens, seed=seed, **params),
                   cache_scope=scope)


def expected(seed: int, n: int) -> list[int]:
    return [1000 + 100 * seed + i for i in range(1, n + 1)]


def token_ids(h, rid: str) -> list[int]:
    return [t for e in h.events.get(rid, []) if isinstance(e, TokenEvent) for t in e.tokens]


def n_tokens(h, rid: str) -> int:
    return sum(e.n_tokens for e in h.events.get(rid, []) if isinstance(e, TokenEvent))


def preempted(h) -> list[str]:
    return [rid for plan in h.plans for rid in plan.preempted]


def resumed(h) -> list[str]:
    return [rid for plan in h.plans for rid in plan.resumed]


def tick_of(h, rid: str, kind: str) -> int:
    """The index of the first plan that lists ``rid`` under ``kind``."""
    return next(i for i, plan in enumerate(h.plans) if rid in getattr(plan, kind))


def four_of_a(h, max_tokens: int = 40, ticks: int = 10) -> None:
    for i in range(4):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=max_tokens, seed=i + 1))
    for _ in range(ticks):
        h.step()


def assert_whole(h, rid: str, seed: int, n: int) -> None:
    """The stream carries exactly the tokens of an undisturbed run, each once, in order."""
    assert token_ids(h, rid) == expected(seed, n)
    assert h.text(rid) == "".join(f"<{t}>" for t in expected(seed, n))
    assert h.finished(rid).stats.completion_tokens == n


def test_a_waiting_scope_takes_a_slot_from_the_scope_holding_all_of_them(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8)
    four_of_a(h)  # a0..a3 on slots 0..3, 10 tokens each
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    h.step()
    plan = h.plans[-1]
    assert plan.preempted == ["a3"] and plan.admitted == ["b0"]  # the latest arrival of A
    assert ("save", 3, 8 + 9) in h.engine.ops  # prompt + all but the last token, in KV
    assert token_ids(h, "b0") == [1901]  # b0's first token in the tick it was admitted
    h.run()
    assert h.finished("b0").finish_reason == "length"
    for i in range(4):
        assert_whole(h, f"a{i}", i + 1, 40)
    assert resumed(h) == ["a3"]
    assert ("restore", 3, 17) in h.engine.ops
    # after the restore only the last token sampled before the preemption is evaluated:
    # the same row a decode would have had
    back = tick_of(h, "a3", "resumed")
    row = next(p for p in h.plans[back].rows if p.request_id == "a3")
    assert (row.phase, row.row.tokens, row.row.pos0, row.row.logits) == (
        Phase.PREFILL, [1410], 17, True)
    # a3 was out for b0's four ticks and the tick that resumed it, no more
    assert back - tick_of(h, "b0", "admitted") == 4
    counters = h.scheduler.counters
    assert counters["preemptions"] == counters["resumes"] == counters["preempt_restores"] == 1
    assert counters["preempt_recomputes"] == 0
    assert h.scheduler.cache.ram.entries() == []  # the state was taken back


def test_no_preemption_when_only_the_same_scope_waits(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=1)
    for i in range(6):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=20, seed=i + 1))
    h.run()
    assert preempted(h) == [] and h.scheduler.counters["preemptions"] == 0
    for i in range(6):
        assert_whole(h, f"a{i}", i + 1, 20)


def test_only_a_scope_two_slots_over_the_waiting_one_gives_one_up(harness):
    h = harness(FakeEngine(n_ctx=4096, n_seq_max=3), preempt_min_tokens=4)
    h.scheduler.submit(req("a0", "A", max_tokens=60, seed=1))
    h.scheduler.submit(req("a1", "A", max_tokens=60, seed=2))
    h.scheduler.submit(req("b0", "B", max_tokens=60, seed=3))
    for _ in range(6):
        h.step()
    h.scheduler.submit(req("b1", "B", max_tokens=4, seed=4))  # B holds 1, A 2: even enough
    for _ in range(10):
        h.step()
    assert preempted(h) == [] and "b1" not in h.admitted()
    h.scheduler.submit(req("c0", "C", max_tokens=4, seed=5))  # C holds none, A two more
    h.step()
    assert h.plans[-1].preempted == ["a1"] and h.plans[-1].admitted == ["c0"]
    h.run()
    assert preempted(h) == ["a1"]  # b0 (B's one slot) never, nor anything for b1
    assert_whole(h, "a1", 2, 60)
    assert_whole(h, "b1", 4, 4)


def test_the_victim_is_of_the_scope_holding_the_most_slots(harness):
    h = harness(FakeEngine(n_ctx=4096, n_seq_max=6), preempt_min_tokens=4)
    for i in range(4):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=40, seed=i + 1))
    for i in range(2):  # B's arrive last, but B holds fewer slots
        h.scheduler.submit(req(f"b{i}", "B", max_tokens=40, seed=i + 5))
    for _ in range(6):
        h.step()
    h.scheduler.submit(req("c0", "C", max_tokens=4, seed=7))
    h.step()
    assert h.plans[-1].preempted == ["a3"]


def test_a_sequence_runs_its_minimum_before_it_can_be_preempted(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=12)
    four_of_a(h, ticks=3)  # 3 tokens each
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    while not preempted(h):
        h.step()
    assert n_tokens(h, "a3") == 12  # not before its 12th token, and at the first chance
    # the minimum counts again from a resume: once a3 is back, b1 takes a2's slot
    while "a3" not in resumed(h):
        h.step()
    h.scheduler.submit(req("b1", "B", max_tokens=4, seed=8))
    h.step()
    assert h.plans[-1].preempted == ["a2"]
    h.run()
    for i in range(4):
        assert_whole(h, f"a{i}", i + 1, 40)


def test_resumes_come_before_the_scopes_queued_requests_but_after_a_scope_with_fewer(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8)
    four_of_a(h)
    h.scheduler.submit(req("a4", "A", max_tokens=4, seed=5))  # queued behind A's four
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    h.scheduler.submit(req("b1", "B", max_tokens=30, seed=8))
    h.run()
    assert preempted(h)[:2] == ["a3", "a2"]  # b0, then b1 (B held one, A three)
    # b0 ends: its slot goes to b2... none here, so to A's oldest preemption, a3 (A and the
    # queued a4 tie: a resume goes first); a4 only once an A request has ended
    assert resumed(h)[0] == "a3"
    assert tick_of(h, "a3", "resumed") < tick_of(h, "a4", "admitted")
    for i in range(4):
        assert_whole(h, f"a{i}", i + 1, 40)
    assert_whole(h, "a4", 5, 4)


def test_a_waiting_scope_holding_fewer_slots_goes_before_a_resume(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8)
    four_of_a(h)
    h.scheduler.submit(req("b0", "B", max_tokens=3, seed=7))
    h.scheduler.submit(req("b1", "B", max_tokens=30, seed=8))
    h.step()
    h.step()  # a3 then a2 out: B holds two, A two
    assert preempted(h) == ["a3", "a2"]
    h.scheduler.submit(req("b2", "B", max_tokens=4, seed=9))
    while h.finished("b0") is None:
        h.step()
    h.step()  # b0's slot: B holds one, A two, so b2 before A's resumes
    assert h.plans[-1].admitted == ["b2"] and h.plans[-1].resumed == []
    h.run()
    for i in range(4):
        assert_whole(h, f"a{i}", i + 1, 40)


def _preempt_a3_and_finish(h) -> None:
    four_of_a(h)
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    h.step()
    assert preempted(h) == ["a3"]
    h.run()


def test_without_the_ram_tier_a_resume_recomputes_prompt_and_output(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8, ram_cache_bytes=0)
    _preempt_a3_and_finish(h)
    back = tick_of(h, "a3", "resumed")
    row = next(p for p in h.plans[back].rows if p.request_id == "a3")
    # the prompt and all ten tokens, the last one's logits picking the eleventh
    assert row.row.tokens == PROMPT + expected(4, 10) and row.row.pos0 == 0 and row.row.logits
    assert h.scheduler.counters["preempt_recomputes"] == 1
    assert h.scheduler.counters["preempt_recompute_tokens"] == 18
    for i in range(4):
        assert_whole(h, f"a{i}", i + 1, 40)


def test_a_state_larger_than_the_ram_budget_is_recomputed(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8, ram_cache_bytes=1000)
    _preempt_a3_and_finish(h)  # 17 cells x 100 bytes: over the budget
    assert h.scheduler.counters["preempt_unsaved"] == 1
    assert h.scheduler.counters["preempt_recomputes"] == 1
    assert not any(op[0] == "save" for op in h.engine.ops)
    assert_whole(h, "a3", 4, 40)


def test_a_failed_restore_falls_back_to_recompute(harness):
    engine = FakeEngine(n_ctx=4096)
    h = harness(engine, preempt_min_tokens=8)
    four_of_a(h)
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    h.step()
    engine.fail_restore = True
    h.run()
    assert h.scheduler.counters["preempt_restore_failures"] == 1
    assert_whole(h, "a3", 4, 40)


def test_a_partial_stop_string_carries_over_a_preemption(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=11)
    for i in range(3):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=40, seed=i + 1))
    h.scheduler.submit(req("a3", "A", max_tokens=40, seed=4, stop=["<1411><1412>"]))
    h.step()
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    while not preempted(h):
        h.step()
    assert h.plans[-1].preempted == ["a3"] and h.text("a3").endswith("<1410>")  # 11 made
    h.run()
    assert n_tokens(h, "a3") == 12
    done = h.finished("a3")
    assert done.finish_reason == "stop" and done.stop == "<1411><1412>"
    # "<1411>" was withheld across the preemption and never sent
    assert h.text("a3") == "".join(f"<{t}>" for t in expected(4, 10))


def test_a_preempted_request_cancelled_or_past_its_deadline_ends_once(harness):
    h = harness(FakeEngine(n_ctx=4096, n_seq_max=4), preempt_min_tokens=4)
    for i in range(4):
        h.scheduler.submit(req(f"a{i}", "A", max_tokens=60, seed=i + 1))
    for _ in range(6):
        h.step()
    h.scheduler.submit(req("b0", "B", max_tokens=40, seed=8))
    h.scheduler.submit(req("c0", "C", max_tokens=40, seed=9))
    h.step()
    h.step()
    assert preempted(h) == ["a3", "a2"]
    ram = h.scheduler.cache.ram
    assert sorted(e.owner for e in ram.entries()) == ["a2", "a3"]
    h.scheduler.cancel("a3")
    h.scheduler._requests["a2"].deadline = h.now  # past it at the next tick
    h.step()
    assert h.finished("a3").finish_reason == "cancelled"
    assert h.finished("a2").error["code"] == "timeout"
    assert ram.entries() == [] and ram.total_bytes == 0  # their saved states went
    h.run()
    assert resumed(h) == []
    for rid in ("a2", "a3"):
        ends = [e for e in h.events[rid] if not isinstance(e, TokenEvent)]
        assert len(ends) == 1  # what each made was sent, once
    assert token_ids(h, "a3") == expected(4, 6) and token_ids(h, "a2") == expected(3, 7)


def test_hand_back_drops_a_preempted_request_and_its_state(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8)
    four_of_a(h)
    h.scheduler.submit(req("b0", "B", max_tokens=40, seed=9))
    h.step()
    assert preempted(h) == ["a3"]
    assert "a3" not in h.scheduler.hand_back(waiting_only=True)  # it started: the grace's
    assert "a3" in h.scheduler.hand_back()
    assert h.finished("a3") is None and h.scheduler.cache.ram.total_bytes == 0
    h.run()
    assert resumed(h) == []


def test_a_requests_own_ram_entry_is_never_matched_or_evicted():
    ram = RamCache(budget_bytes=1000)
    own = ram.add("A", [1, 2, 3, 4], "state", 600, now=0.0, owner="a3")
    assert ram.lookup("A", [1, 2, 3, 4, 5], 4) == (None, 0)
    assert not ram.covers("A", [1, 2, 3])
    evicted, room = ram.make_room("A", [7, 8], 500)
    assert evicted == [] and not room  # the owned 600 bytes stay; 500 more do not fit
    assert ram.evict_scope("A") == 0
    assert ram.take_owned("a3") is own and ram.total_bytes == 0
    assert ram.take_owned("a3") is None


def test_the_snapshot_lists_a_preempted_request_until_it_resumes(harness):
    h = harness(FakeEngine(n_ctx=4096), preempt_min_tokens=8)
    four_of_a(h)
    h.scheduler.submit(req("b0", "B", max_tokens=4, seed=9))
    h.step()
    snap = h.scheduler.snapshot()
    assert [(p["request_id"], p["cache_scope"]) for p in snap["preempted"]] == [("a3", "A")]
    assert snap["preempted"][0]["output_tokens"] == 10
    assert "a3" not in [s["request_id"] for s in snap["slots"]]
    h.run()
    assert h.scheduler.snapshot()["preempted"] == []
