"""Prefix cache policy over the fake engine: tiers, scopes, slot choice, sessions, RAM budget."""

from __future__ import annotations

from scheduler_daemon.core.ram_cache import RamCache
from scheduler_daemon.core.state import Request
from wire.sampling import SamplingParams

from .fake_engine import STATE_HEADER_BYTES, FakeEngine

SYSTEM = list(range(100, 160))  # a 60-token shared system prompt


def toks(*parts: int | list[int], n: int = 0) -> list[int]:
    out: list[int] = []
    for p in parts:
        out += p if isinstance(p, list) else [p]
    return out + list(range(5000, 5000 + n))


def user(k: int, n: int = 20) -> list[int]:
    return list(range(1000 * k, 1000 * k + n))


def req(rid: str, prompt: list[int], scope: str = "a", max_tokens: int = 2, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, seed=kw.pop("seed", 0), **kw.pop("params", {}))
    return Request(id=rid, prompt_tokens=prompt, params=params, cache_scope=scope, **kw)


def run_one(h, request: Request):
    h.scheduler.submit(request)
    h.run()
    return h.finished(request.id)


def slot_of(h, request_id: str) -> int:
    """The slot a request was placed on (recorded by ``placed``)."""
    return h.placed[request_id]


def placed(h) -> dict[str, int]:
    assign = h.scheduler._assign
    h.placed = {}

    def record(job, slot):
        h.placed[job.id] = slot.seq_id
        assign(job, slot)

    h.scheduler._assign = record
    return h.placed


def hit_tokens(h, tier: str) -> int:
    return h.scheduler.counters[f"cache_hit_tokens_{tier}"]


def fill_slots(h, scope: str = "other", n: int = 4) -> None:
    """Occupy every slot at once with unrelated prompts of another scope."""
    for i in range(n):
        h.scheduler.submit(req(f"fill-{scope}-{i}-{len(h.events)}", user(50 + i), scope=scope))
    h.run()


# -- every tier: the scope that made it hits, another scope misses ----------------------


def test_same_slot_tier_hits_for_its_scope_only(harness):
    h = harness(FakeEngine(n_seq_max=1))
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    assert run_one(h, req("a2", toks(SYSTEM, user(2)))).stats.cached_tokens == 60
    assert hit_tokens(h, "slot") == 60
    assert run_one(h, req("b1", toks(SYSTEM, user(2)), scope="b")).stats.cached_tokens == 0


def test_cross_slot_tier_copies_from_a_generating_slot_for_its_scope_only(harness):
    engine = FakeEngine()
    h = harness(engine)
    h.scheduler.submit(req("a1", toks(SYSTEM, user(1)), max_tokens=50))
    h.scheduler.step()
    h.scheduler.step()  # a1 is generating on slot 0, its KV growing
    h.scheduler.submit(req("a2", toks(SYSTEM, user(2))))
    h.scheduler.submit(req("b1", toks(SYSTEM, user(2)), scope="b"))
    h.scheduler.step()  # b1 first (its scope holds fewer slots): slot 1; a2: slot 2
    assert ("copy", 0, 2, 0, 60) in engine.ops  # positions [0, 60) of slot 0 into slot 2
    assert not any(op[0] == "copy" and op[2] == 1 for op in engine.ops)  # never into b's slot
    snap = h.scheduler.snapshot()["slots"]
    assert snap[2]["cached_tokens"] == 60 and snap[2]["kv_tokens"] == 80  # copied, then prefilled
    h.run()
    assert h.finished("a2").stats.cached_tokens == 60 and hit_tokens(h, "cross_slot") == 60
    assert h.finished("b1").stats.cached_tokens == 0
    assert h.finished("a1").stats.completion_tokens == 50  # the source carried on undisturbed


def test_ram_tier_restores_for_its_scope_only(harness):
    engine = FakeEngine()
    h = harness(engine)
    run_one(h, req("a1", toks(SYSTEM, user(1))))  # slot 0 holds 81 tokens of scope a
    fill_slots(h)  # four at once: slot 0 is reused too, so a's prefix goes to RAM first
    assert ("save", 0, 81) in engine.ops
    done = run_one(h, req("a2", toks(SYSTEM, user(1), user(3))))
    assert done.stats.cached_tokens == 80 and hit_tokens(h, "ram") == 80
    assert any(op[0] == "restore" and op[2] == 81 for op in engine.ops)
    assert h.scheduler.counters["ram_restore_tokens"] == 80
    assert run_one(h, req("b1", toks(SYSTEM, user(1), user(3)), scope="b")).stats.cached_tokens == 0


def test_a_source_whose_window_is_gone_is_not_copied(harness):
    engine = FakeEngine()
    h = harness(engine)
    h.scheduler.submit(req("a1", toks(SYSTEM, user(1)), max_tokens=50))
    h.scheduler.step()
    engine.window_lost.add(0)  # as if a sliding window had let go of slot 0's early cells
    done = run_one(h, req("a2", toks(SYSTEM, user(2))))
    assert done.stats.cached_tokens == 0 and not any(op[0] == "copy" for op in engine.ops)


def test_hit_tokens_per_tier_add_up_to_the_cached_tokens(harness):
    h = harness(FakeEngine())
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    run_one(h, req("a2", toks(SYSTEM, user(1), user(2))))
    fill_slots(h)
    run_one(h, req("a3", toks(SYSTEM, user(1), user(2), user(3))))
    counters = h.scheduler.counters
    by_tier = sum(counters[f"cache_hit_tokens_{t}"] for t in ("slot", "cross_slot", "ram"))
    assert by_tier == counters["cached_tokens"]
    assert counters["cache_lookups"] == 7


def test_cache_prompt_false_neither_uses_nor_leaves_a_cache(harness):
    engine = FakeEngine(n_seq_max=1)
    h = harness(engine)
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    assert run_one(h, req("a2", toks(SYSTEM, user(1)), cache_prompt=False)).stats.cached_tokens == 0
    assert ("save", 0, 81) in engine.ops  # a1's prefix was kept in RAM before a2 wiped the slot
    assert engine.cells[0] == 0 and h.scheduler.snapshot()["slots"][0]["cache_scope"] is None
    h2 = harness(FakeEngine(n_seq_max=1), cache_prompt=False)  # off by default, on per request
    run_one(h2, req("a1", toks(SYSTEM, user(1)), cache_prompt=True))
    done = run_one(h2, req("a2", toks(SYSTEM, user(2)), cache_prompt=True))
    assert done.stats.cached_tokens == 60
    assert run_one(h2, req("a3", toks(SYSTEM, user(2)))).stats.cached_tokens == 0


# -- slot choice --------------------------------------------------------------------------


def test_slot_with_the_longest_prefix_wins_above_ten_percent_else_empty_then_lru(harness):
    h = harness(FakeEngine(), cross_slot=False, ram_cache_bytes=0)
    where = placed(h)
    run_one(h, req("s1", toks(SYSTEM, user(1))))
    run_one(h, req("s2", toks(user(7), user(8))))
    assert (slot_of(h, "s1"), slot_of(h, "s2")) == (0, 1)  # empty slots first
    run_one(h, req("s3", toks(SYSTEM, user(2))))
    assert where["s3"] == 0  # 60 of 80 tokens cached there
    run_one(h, req("s4", toks(SYSTEM[:5], user(9), n=60)))  # 5 of 85: not > 10%
    assert where["s4"] == 2
    run_one(h, req("s5", toks(user(11))))
    run_one(h, req("s6", toks(user(12))))  # no empty slot left: the least recently used
    assert (where["s5"], where["s6"]) == (3, 1)


def test_prefill_of_a_shared_prefix_happens_once_per_scope(harness):
    engine = FakeEngine(n_batch=512)
    h = harness(engine, chunk_size=512)
    h.scheduler.submit(req("a1", toks(SYSTEM, user(1))))
    h.scheduler.submit(req("a2", toks(SYSTEM, user(2))))  # arrives together: nothing cached yet
    h.scheduler.submit(req("b1", toks(SYSTEM, user(2)), scope="b"))
    h.scheduler.step()
    first = {r.seq_id: len(r.tokens) for r in engine.calls[-1]}
    # round-robin admission: a1 slot 0, b1 slot 1 (scope b's turn), a2 slot 2;
    # a2 waits for a1's prefill; b1 never waits on another scope
    assert first == {0: 80, 1: 80}
    h.run()
    assert ("copy", 0, 2, 0, 60) in engine.ops
    assert h.finished("a2").stats.cached_tokens == 60 and h.finished("b1").stats.cached_tokens == 0
    prefilled = sum(len(r.tokens) for call in engine.calls for r in call if len(r.tokens) > 1)
    assert prefilled == 80 + 20 + 80


# -- sessions -----------------------------------------------------------------------------


def test_session_turns_land_on_their_slot_while_it_is_free(harness):
    h = harness(FakeEngine(), cross_slot=False)
    where = placed(h)
    run_one(h, req("t1", toks(SYSTEM, user(1)), session="s"))
    run_one(h, req("x1", toks(SYSTEM, user(1), user(2))))  # a longer match of slot 0, no session
    run_one(h, req("t2", toks(user(30)), session="s"))  # shares nothing with it: pinned anyway
    assert where["t1"] == where["t2"] != where["x1"]
    run_one(h, req("t3", toks(user(30)), scope="b", session="s"))  # a session name is per scope
    assert where["t3"] != where["t1"]


def test_a_queued_session_request_goes_first_onto_its_free_slot(harness):
    h = harness(FakeEngine(n_seq_max=2))
    where = placed(h)
    h.scheduler.submit(req("t1", toks(SYSTEM, user(1)), session="s", max_tokens=3))
    h.scheduler.submit(req("long", toks(user(40)), max_tokens=20))
    h.scheduler.step()
    h.scheduler.submit(req("head", toks(user(41))))  # queued first...
    h.scheduler.submit(req("t2", toks(SYSTEM, user(1), user(2)), session="s"))  # ...then a turn
    while h.finished("t1") is None:
        h.scheduler.step()
    h.scheduler.step()  # t1's slot is free: t2 takes it ahead of head
    assert where["t2"] == where["t1"] and "head" not in where
    assert h.scheduler.counters["session_bypasses"] == 1
    h.run()
    assert h.finished("t2").stats.cached_tokens == 80
    assert h.finished("head").finish_reason == "length"


def test_session_bypasses_are_bounded_so_the_head_is_not_starved(harness):
    h = harness(FakeEngine(n_seq_max=1), session_max_bypass=2)
    order = []
    h.scheduler._emit = lambda e: order.append(e.request_id) if hasattr(e, "stats") else None
    run_one(h, req("t0", toks(SYSTEM, user(0)), session="s"))
    h.scheduler.submit(req("head", toks(user(40))))
    for turn in range(1, 5):
        h.scheduler.submit(req(f"t{turn}", toks(SYSTEM, user(turn)), session="s"))
    h.run()
    assert order[:3] == ["t0", "t1", "t2"] and order[3] == "head"  # two bypasses, then the head


def test_a_session_request_does_not_jump_past_the_kv_budget(harness):
    h = harness(FakeEngine(n_ctx=256, n_seq_max=2), kv_block_tokens=64)
    where = placed(h)
    run_one(h, req("t1", toks(SYSTEM, user(1)), session="s"))
    h.scheduler.submit(req("long", toks(user(40)), max_tokens=60))  # 2 of 4 blocks
    h.scheduler.step()
    h.scheduler.submit(req("head", toks(user(41)), max_tokens=60))  # 2 blocks: waits for them
    t2 = req("t2", toks(SYSTEM, user(1), user(2)), session="s", max_tokens=60)  # 3 blocks
    h.scheduler.submit(t2)
    h.scheduler.step()
    assert "t2" not in where and "head" in where  # t2 did not fit the budget, head did
    h.run()


# -- RAM budget ---------------------------------------------------------------------------


def entry_bytes(n_tokens: int) -> int:
    return STATE_HEADER_BYTES + 100 * n_tokens


def test_ram_eviction_keeps_the_total_within_budget(harness):
    budget = 2 * entry_bytes(82) + 50  # two of 82 tokens (81 + one generated) fit, not three
    h = harness(FakeEngine(n_seq_max=1), ram_cache_bytes=budget)
    totals = []
    ram = h.scheduler.cache.ram
    h.scheduler.on_cache_event = lambda e: totals.append((e.kind, ram.total_bytes))
    for k in range(1, 6):
        run_one(h, req(f"a{k}", toks(user(k), n=61)))  # all different: each one evicts the last
    counters = h.scheduler.counters
    assert counters["ram_save"] == 4 and counters["ram_evict"] == 2
    assert max(t for _, t in totals) <= budget
    snap = h.scheduler.snapshot()["cache"]
    assert snap["ram_entries"] == 2 and snap["ram_bytes"] == 2 * entry_bytes(82)
    assert [e["tokens"] for e in snap["entries"] if e["tier"] == "ram"] == [82, 82]


def test_an_entry_larger_than_the_budget_is_never_stored(harness):
    engine = FakeEngine(n_seq_max=1)
    h = harness(engine, ram_cache_bytes=entry_bytes(81) - 1)
    events = []
    h.scheduler.on_cache_event = events.append
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    run_one(h, req("b1", toks(user(9))))
    assert not any(op[0] == "save" for op in engine.ops)  # sized first, never copied out
    assert [(e.kind, e.n_tokens, e.size_bytes) for e in events] == [("reject", 81, entry_bytes(81))]
    assert h.scheduler.snapshot()["cache"]["ram_bytes"] == 0


def test_one_scope_cannot_evict_another_beyond_its_share(harness):
    budget = 4 * entry_bytes(82)
    h = harness(FakeEngine(n_seq_max=1), ram_cache_bytes=budget, ram_tenant_share=0.5)
    run_one(h, req("b1", toks(user(90), n=61), scope="b"))
    for k in range(1, 7):  # scope a saves five 81-token prefixes: it may hold two
        run_one(h, req(f"a{k}", toks(user(k), n=61)))
    ram = h.scheduler.cache.ram
    assert ram.scope_bytes("b") == entry_bytes(82)  # b's entry survived a's churn
    assert ram.scope_bytes("a") <= budget // 2
    assert ram.total_bytes <= budget


def test_a_lone_tenant_may_fill_the_cache_and_gives_back_past_its_share_once_another_comes():
    ram = RamCache(1000, tenant_share=0.5)
    for i in range(4):  # alone: the whole budget
        assert ram.fits("flood", 250)
        evicted, room = ram.make_room("flood", [i], 250)
        assert room and not evicted
        ram.add("flood", [i], object(), 250, now=float(i))
    assert ram.scope_bytes("flood") == 1000
    evicted, room = ram.make_room("warm", [100], 250)  # another tenant: the global LRU goes
    assert room and [e.tokens for e in evicted] == [[0]]
    ram.add("warm", [100], object(), 250, now=10.0)
    for i in range(4, 10):  # the flood goes on: now past its share it evicts its own
        evicted, room = ram.make_room("flood", [i], 250)
        assert room and all(e.cache_scope == "flood" for e in evicted)
        ram.add("flood", [i], object(), 250, now=float(i + 10))
        assert ram.scope_bytes("flood") <= 500
    assert ram.lookup("warm", [100, 1], limit=1)[1] == 1  # the warm conversation survived
    assert not ram.fits("flood", 600)  # past its share, while warm holds entries


def test_ram_cache_keeps_one_entry_per_prefix_chain():
    ram = RamCache(10_000)
    ram.make_room("a", [1, 2, 3], 100)
    first = ram.add("a", [1, 2, 3], object(), 100, now=1.0)
    evicted, room = ram.make_room("a", [1, 2, 3, 4, 5], 150)
    assert evicted == [first] and room  # the longer state serves every lookup the shorter did
    ram.add("a", [1, 2, 3, 4, 5], object(), 150, now=2.0)
    assert ram.lookup("a", [1, 2, 3, 9], limit=3)[1] == 3
    assert ram.lookup("b", [1, 2, 3, 9], limit=3) == (None, 0)
    swa = RamCache(10_000, partial_max_tokens=4)  # a sliding window of 4: longer states only whole
    swa.add("a", [1, 2, 3, 4, 5], object(), 150, now=1.0)
    assert swa.lookup("a", [1, 2, 3, 9], limit=3)[1] == 0
    assert swa.lookup("a", [1, 2, 3, 4, 5, 6], limit=5)[1] == 5


def test_a_failed_restore_falls_back_to_a_full_prefill(harness):
    engine = FakeEngine()
    h = harness(engine)
    run_one(h, req("a1", toks(SYSTEM, user(1))))
    fill_slots(h)
    engine.fail_restore = True
    done = run_one(h, req("a2", toks(SYSTEM, user(1), user(3))))
    assert done.stats.cached_tokens == 0 and done.finish_reason == "length"
    assert h.scheduler.counters["ram_restore_failures"] == 1


def test_kv_pressure_saves_idle_prefixes_to_ram_before_purging(harness):
    engine = FakeEngine(n_ctx=256, kv_cells=100)
    h = harness(engine, kv_budget_tokens=1024, kv_block_tokens=16)
    run_one(h, req("a1", toks(SYSTEM, n=1), max_tokens=1))
    run_one(h, req("b1", toks(user(7), n=10), max_tokens=20, scope="b"))  # needs a's cells
    assert ("save", 0, 61) in engine.ops and engine.cells[0] == 0
    done = run_one(h, req("a2", toks(SYSTEM, user(2))))
    assert done.stats.cached_tokens == 60 and hit_tokens(h, "ram") == 60


# -- events and the admin listing -----------------------------------------------------------


def test_prefix_instability_is_logged_counted_and_published(harness, caplog):
    h = harness(FakeEngine(n_seq_max=1))
    events = []
    h.scheduler.on_cache_event = events.append
    run_one(h, req("a1", toks(SYSTEM, user(1), user(2))))  # 100 tokens cached
    run_one(h, req("a2", toks(SYSTEM, user(1), user(2), user(3))))  # a continuation: fine
    assert not any(e.kind == "prefix_instability" for e in events)
    run_one(h, req("a3", toks(SYSTEM[:30], user(4))))  # keeps 30 of 121: rewritten history
    unstable = [e for e in events if e.kind == "prefix_instability"]
    assert [(e.request_id, e.n_tokens, e.history_tokens) for e in unstable] == [("a3", 30, 121)]
    assert h.scheduler.counters["prefix_instability"] == 1
    assert "prefix instability" in caplog.text


def test_snapshot_lists_cache_entries_without_tokens(harness):
    h = harness(FakeEngine())
    run_one(h, req("a1", toks(SYSTEM, user(1)), scope="tenant-7"))
    run_one(h, req("a2", toks(SYSTEM, user(2)), scope="tenant-7"))
    fill_slots(h)
    cache = h.scheduler.snapshot()["cache"]
    assert cache["ram_entries"] >= 1 and cache["ram_bytes"] > 0
    ram = [e for e in cache["entries"] if e["tier"] == "ram" and e["cache_scope"] == "tenant-7"]
    assert ram and set(ram[0]) == {
        "tier",
        "slot",
        "cache_scope",
        "tokens",
        "bytes",
        "age_ms",
        "hits",
    }
    slots = [e for e in cache["entries"] if e["tier"] == "slot"]
    assert len(slots) == 4 and all(e["bytes"] == e["tokens"] * 100 for e in slots)
    text = repr(h.scheduler.snapshot())
    assert "1000, 1001" not in text and "[100, 101" not in text


def test_evict_scope_forgets_only_that_scope_in_idle_slots(harness):
    from scheduler_daemon.core.state import Request
    from wire.sampling import SamplingParams

    h = harness()
    for rid, scope in (("a", "t1"), ("b", "t2")):
        h.scheduler.submit(
            Request(
                id=rid,
                prompt_tokens=list(range(10, 50)) if scope == "t1" else list(range(60, 100)),
                params=SamplingParams(max_tokens=2),
                cache_scope=scope,
            )
        )
    h.run()
    scopes = lambda: {e["cache_scope"] for e in h.scheduler.snapshot()["cache"]["entries"]}  # noqa: E731
    assert scopes() == {"t1", "t2"}
    assert h.scheduler.evict_scope("t1") == 1
    assert scopes() == {"t2"}
