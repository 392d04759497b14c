"""The prefix cache's park (``SchedulerConfig.park_seq``): an admission that evicts a slot's
prefix does not pay its RAM save before its own prefill; the state is parked in the
engine's last sequence and saved after the tick's decode, or first under KV pressure."""

from __future__ import annotations

import threading

import pytest

from scheduler_daemon.core.scheduler import Scheduler, SchedulerConfig

from .fake_engine import FakeEngine
from .test_prefix_cache_policy import SYSTEM, hit_tokens, req, run_one, toks, user


def saves(engine: FakeEngine) -> list[tuple]:
    return [op for op in engine.ops if op[0] == "save"]


def saves_before_each_decode(engine: FakeEngine) -> list[int]:
    """For every decode call: how many saves had been made when it started."""
    seen: list[int] = []
    engine.on_decode = lambda rows: seen.append(len(saves(engine)))
    return seen


@pytest.mark.parametrize("park", [True, False])
def test_the_evicted_prefix_is_saved_after_the_new_prompt_decodes_only_with_a_park(
        harness, park):
    engine = FakeEngine(n_seq_max=2 if park else 1)  # one slot (and the park)
    h = harness(engine, park_seq=park)
    run_one(h, req("a1", toks(SYSTEM, user(1))))  # 80 tokens + 1 generated on the slot
    seen = saves_before_each_decode(engine)
    h.scheduler.submit(req("b1", toks(user(9))))  # another prompt: a1's prefix is evicted
    h.step()
    if park:
        assert ("copy", 0, 1, 0, 81) in engine.ops  # shared with the park, not serialized
        assert seen == [0]  # b1's prefill ran before any save
        assert saves(engine) == [("save", 1, 81)]  # saved from the park after that decode
        assert engine.cells.get(1, 0) == 0  # and the park emptied
    else:
        assert seen == [1] and saves(engine) == [("save", 0, 81)]  # paid before b1's prefill
    h.run()
    done = run_one(h, req("a2", toks(SYSTEM, user(1), user(3))))
    assert done.stats.cached_tokens == 80 and hit_tokens(h, "ram") == 80


def test_kv_pressure_saves_the_parked_state_and_frees_its_cells_first(harness):
    engine = FakeEngine(n_ctx=256, kv_cells=100, n_seq_max=2)
    h = harness(engine, park_seq=True, kv_budget_tokens=1024, kv_block_tokens=16)
    run_one(h, req("a1", toks(SYSTEM, n=1), max_tokens=1))  # 61 cells
    seen = saves_before_each_decode(engine)
    # b1's 50 tokens do not fit beside the parked 61: the park is saved and freed, then b1 runs
    done = run_one(h, req("b1", toks(user(7), n=30), max_tokens=2, scope="b"))
    assert done.finish_reason == "length"
    assert seen[:2] == [0, 1]  # the first decode failed (KV full), the retry followed the save
    assert saves(engine) == [("save", 1, 61)] and engine.cells.get(1, 0) == 0
    assert h.scheduler.counters["kv_pressure"] == 1
    again = run_one(h, req("a2", toks(SYSTEM, user(2))))
    assert again.stats.cached_tokens == 60 and hit_tokens(h, "ram") == 60


def test_two_evictions_in_one_tick_park_one_and_save_the_other(harness):
    engine = FakeEngine(n_seq_max=3)  # two slots and the park
    h = harness(engine, park_seq=True)
    h.scheduler.submit(req("a1", toks(SYSTEM, user(1)), scope="a"))
    h.scheduler.submit(req("c1", toks(user(5), n=60), scope="c"))
    h.run()
    h.scheduler.submit(req("b1", toks(user(8)), scope="b"))
    h.scheduler.submit(req("b2", toks(user(9)), scope="b"))
    h.step()  # both admitted in one tick: the second eviction settles the first one's park
    assert sorted(op[2] for op in saves(engine)) == [81, 81]
    assert {op[1] for op in saves(engine)} == {2}  # both from the park
    assert engine.cells.get(2, 0) == 0 and not h.scheduler.cache.parked
    h.run()
    a2 = run_one(h, req("a2", toks(SYSTEM, user(1), user(3)), scope="a"))
    c2 = run_one(h, req("c2", toks(user(5), n=60) + user(4), scope="c"))
    assert a2.stats.cached_tokens == c2.stats.cached_tokens == 80


def test_a_park_needs_a_sequence_besides_it():
    with pytest.raises(ValueError):
        Scheduler(FakeEngine(n_seq_max=1), SchedulerConfig(park_seq=True), lambda e: None)


def test_the_slots_are_the_sequences_before_the_park(harness):
    h = harness(FakeEngine(n_seq_max=5), park_seq=True)
    assert [s["id"] for s in h.scheduler.snapshot()["slots"]] == [0, 1, 2, 3]
    assert h.scheduler.cache.park_seq == 4


def test_a_scope_evicted_while_its_state_is_parked_is_not_saved(harness):
    engine = FakeEngine(n_seq_max=2)
    h = harness(engine, park_seq=True)
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    evicted = []
    # the operator's evict_scope arrives during b1's decode, after a1's prefix was parked
    engine.on_decode = lambda rows: evicted.append(h.scheduler.evict_scope("a"))
    h.scheduler.submit(req("b1", toks(user(9)), scope="b"))
    h.step()
    assert evicted == [0] and saves(engine) == [] and engine.cells.get(1, 0) == 0
    h.run()
    assert run_one(h, req("a2", toks(SYSTEM, user(1), user(3)))).stats.cached_tokens == 0


def test_cells_forgotten_off_the_loop_thread_go_before_the_next_tick_not_during_a_decode(
        harness):
    engine = FakeEngine(n_seq_max=3)
    h = harness(engine, park_seq=True)
    run_one(h, req("a1", toks(SYSTEM, user(1)), scope="a"))  # slot 0 holds a's prefix
    slot = next(s for s in h.scheduler.snapshot()["slots"] if s["id"] == 0)
    assert slot["state"] == "idle" and engine.cells[0] == 81
    removed_during_decode = []

    def operator_evicts(rows):  # the control thread, while the loop thread decodes
        before = dict(engine.cells)
        t = threading.Thread(target=h.scheduler.evict_scope, args=("a",))
        t.start()
        t.join()
        removed_during_decode.append(engine.cells != before)

    engine.on_decode = operator_evicts
    h.scheduler.submit(req("b1", toks(user(9), n=30), scope="b"))
    h.step()
    assert removed_during_decode == [False]  # no cell changed under the decode
    engine.on_decode = None
    h.run()  # the next tick removes them first
    assert engine.cells.get(0, 0) == 0
    again = run_one(h, req("a2", toks(SYSTEM, user(1), user(3)), scope="a"))
    assert again.stats.cached_tokens == 0
