"""``SchedulerConfig.idle_slots_to_ram`` (IDLE_SLOTS_TO_RAM): an admission moves the other
idle slots' prefixes to the RAM tier and frees their cells before its prefill, so that the
prefill attends over the running slots only (llama.cpp's unified KV spans every used cell);
a returning conversation restores its prefix from RAM instead. Fake engine: the policy's
rules; its served effect: docs/performance.md."""

from __future__ import annotations

import pytest

from .fake_engine import FakeEngine
from .test_prefix_cache_policy import SYSTEM, hit_tokens, req, run_one, toks, user


def cells_at_each_decode(engine: FakeEngine) -> list[dict[int, int]]:
    seen: list[dict[int, int]] = []
    engine.on_decode = lambda rows: seen.append(dict(engine.cells))
    return seen


@pytest.mark.parametrize("policy", [True, False])
def test_a_prefill_runs_with_the_idle_prefixes_in_ram_and_their_cells_free(harness, policy):
    engine = FakeEngine(n_seq_max=4)  # three slots and the park
    h = harness(engine, park_seq=True, idle_slots_to_ram=policy)
    a1 = run_one(h, req("a1", toks(SYSTEM, user(1)), scope="a"))
    c1 = run_one(h, req("c1", toks(user(5), n=60), scope="c"))
    assert a1.finish_reason == c1.finish_reason == "length"
    seen = cells_at_each_decode(engine)
    h.scheduler.submit(req("b1", toks(user(8)), scope="b"))
    h.step()  # b1's prefill
    b1_seq = next(s.seq_id for s in h.scheduler._slots if s.request is not None)
    others = {seq: n for seq, n in seen[0].items() if seq != b1_seq and n}
    saved = sorted(op[2] for op in engine.ops if op[0] == "save")
    if policy:
        assert others == {}  # a1's and c1's cells freed before b1 decoded
        assert saved == [81, 81]  # both prefixes in RAM first
        assert h.scheduler.counters["idle_slots_cleared"] == 2
    else:
        assert sorted(others.values()) == [81, 81] and saved == []
    h.run()
    a2 = run_one(h, req("a2", toks(SYSTEM, user(1), user(3)), scope="a"))
    assert a2.stats.cached_tokens == 80  # a returning conversation is a hit either way:
    assert hit_tokens(h, "ram") == (80 if policy else 0)  # from RAM, or from its slot


def test_a_running_slot_keeps_its_cells_and_finishes(harness):
    engine = FakeEngine(n_seq_max=4)
    h = harness(engine, park_seq=True, idle_slots_to_ram=True)
    h.scheduler.submit(req("g1", toks(user(2), n=40), scope="a", max_tokens=20))
    h.step()
    h.step()  # g1 generating
    h.scheduler.submit(req("b1", toks(user(8)), scope="b"))
    h.step()
    assert not [op for op in engine.ops if op[0] == "save"]  # nothing idle to move
    h.run()
    assert h.finished("g1").finish_reason == "length"
    assert h.finished("g1").stats.completion_tokens == 20


def test_the_admitted_slot_own_prefix_goes_to_the_park_as_before(harness):
    engine = FakeEngine(n_seq_max=4)
    h = harness(engine, park_seq=True, idle_slots_to_ram=True)
    run_one(h, req("a1", toks(SYSTEM, user(1)), scope="a"))
    # same scope and system prompt: a2 lands on a1's slot and keeps the shared 60 tokens;
    # the rest of a1's history is parked and saved after the tick, the policy adds nothing
    done = run_one(h, req("a2", toks(SYSTEM, user(4)), scope="a"))
    assert done.stats.cached_tokens == 60 and hit_tokens(h, "slot") == 60
    assert [op for op in engine.ops if op[0] == "save"] == [("save", 3, 81)]  # the park's
    assert h.scheduler.counters["idle_slots_cleared"] == 0


def test_without_the_ram_tier_idle_prefixes_stay(harness):
    engine = FakeEngine(n_seq_max=4)
    h = harness(engine, park_seq=True, idle_slots_to_ram=True, ram_cache_bytes=0)
    run_one(h, req("a1", toks(SYSTEM, user(1)), scope="a"))
    run_one(h, req("b1", toks(user(8)), scope="b"))
    a2 = run_one(h, req("a2", toks(SYSTEM, user(1), user(3)), scope="a"))
    assert a2.stats.cached_tokens == 80 and hit_tokens(h, "slot") == 80
