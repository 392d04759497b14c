"""Scheduler policy with a fake engine: batches, admission, cancellation, KV pressure."""

from __future__ import annotations

import pytest

from scheduler_daemon.core.state import Request, SlotState
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .fake_engine import EOG, FakeEngine


def req(rid: str, n_prompt: int, max_tokens: int = 8, seed: int = 0, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, seed=seed, **kw.pop("params", {}))
    return Request(id=rid, prompt_tokens=list(range(10, 10 + n_prompt)), params=params, **kw)


def rows_of(call):
    return [(r.seq_id, len(r.tokens), r.logits) for r in call]


# -- batch building -------------------------------------------------------------------


def test_decode_rows_come_first_then_prefill_chunks_within_budget(harness):
    # identical prompts: no prefix cache here, or c would adopt b's prefill
    # (that is test_prefix_cache_policy's subject)
    h = harness(FakeEngine(n_batch=40), chunk_size=16, cache_prompt=False)
    h.scheduler.submit(req("a", 4, max_tokens=50))
    h.scheduler.step()  # a prefilled and sampled its first token
    h.scheduler.submit(req("b", 100))
    h.scheduler.submit(req("c", 100))
    h.scheduler.step()
    call = h.engine.calls[-1]
    assert rows_of(call)[0] == (0, 1, True)  # a's decode token leads the batch
    assert [len(r.tokens) for r in call[1:]] == [16, 16]  # one chunk each, chunk_size bound
    assert not any(r.logits for r in call[1:])  # no logits mid-prompt
    assert sum(len(r.tokens) for r in call) <= 40


def test_prefill_chunks_rotate_round_robin_when_budget_is_short(harness):
    h = harness(
        FakeEngine(n_batch=17), chunk_size=16, cache_prompt=False
    )  # identical prompts, see above
    h.scheduler.submit(req("a", 4, max_tokens=100))
    h.scheduler.step()
    h.scheduler.submit(req("b", 64))
    h.scheduler.submit(req("c", 64))
    first_chunk_owner = []
    for _ in range(6):
        h.scheduler.step()
        call = h.engine.calls[-1]
        assert rows_of(call)[0] == (0, 1, True)  # the in-flight decode is never held back
        assert sum(len(r.tokens) for r in call) <= 17
        first_chunk_owner.append(call[1].seq_id)
    assert first_chunk_owner == [1, 2, 1, 2, 1, 2]


def test_long_prompt_delays_decodes_by_at_most_one_chunk_per_tick(harness):
    h = harness(FakeEngine(n_batch=256), chunk_size=32)
    h.scheduler.submit(req("a", 4, max_tokens=200))
    h.scheduler.step()
    h.scheduler.submit(req("long", 200))
    generated_before = len(h.text("a"))
    for _ in range(7):  # 200 tokens = 7 chunks of <= 32
        h.scheduler.step()
        prefill = [r for r in h.engine.calls[-1] if r.seq_id == 1]
        assert len(prefill) == 1 and len(prefill[0].tokens) <= 32
    assert len(h.text("a")) > generated_before  # a kept generating every tick
    assert h.scheduler.snapshot()["slots"][1]["state"] == "generating"


def test_logits_requested_only_for_the_last_prompt_token(harness):
    h = harness(FakeEngine(n_batch=64), chunk_size=16)
    h.scheduler.submit(req("a", 40, max_tokens=1))
    h.run()
    flags = [r.logits for call in h.engine.calls for r in call]
    assert flags == [False, False, True]
    assert h.finished("a").finish_reason == "length"


# -- admission ------------------------------------------------------------------------


def test_queue_full_refuses_at_once_and_changes_nothing(harness):
    h = harness(FakeEngine(n_seq_max=1), max_queue=2)
    h.scheduler.submit(req("a", 4))
    h.scheduler.submit(req("b", 4))
    with pytest.raises(Refusal) as err:
        h.scheduler.submit(req("c", 4))
    assert err.value.code == "queue_full"
    assert [q["request_id"] for q in h.scheduler.snapshot()["queue"]] == ["a", "b"]
    h.run()
    assert h.finished("a") and h.finished("b") and "c" not in h.events


def test_context_length_exceeded_names_the_numbers(harness):
    h = harness(FakeEngine(n_ctx=512))
    with pytest.raises(Refusal) as err:
        h.scheduler.submit(req("a", 500, max_tokens=100))
    assert err.value.code == "context_length_exceeded"
    assert err.value.details == {"prompt_tokens": 500, "max_tokens": 100, "limit": 512,
                                 "kv_bytes_per_token": 100, "estimated_bytes": 60_000,
                                 "limit_bytes": 51_200}
    with pytest.raises(Refusal) as err:
        h.scheduler.submit(req("b", 600, max_tokens=None))
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert not h.scheduler.has_work()


def test_empty_prompt_is_refused(harness):
    h = harness()
    with pytest.raises(Refusal) as err:
        h.scheduler.submit(req("a", 0))
    assert err.value.code == "empty_prompt"


def test_default_max_tokens_is_bounded_by_the_context(harness):
    h = harness(FakeEngine(n_ctx=512), default_max_tokens=400)
    h.scheduler.submit(req("a", 300, max_tokens=None))
    assert h.scheduler.snapshot()["queue"][0]["max_tokens"] == 212


def test_block_budget_is_strict_fifo_so_nobody_starves(harness):
    # 4 blocks of 16 tokens; "big" requests need 3 blocks, "small" needs 1.
    h = harness(FakeEngine(n_ctx=64), kv_block_tokens=16)
    h.scheduler.submit(req("big1", 16, max_tokens=32))
    h.scheduler.submit(req("big2", 16, max_tokens=32))
    h.scheduler.submit(req("small", 4, max_tokens=4))
    h.scheduler.step()
    snap = h.scheduler.snapshot()
    assert snap["kv"]["blocks_used"] == 3
    # small fits in the free block and a slot is free, but it may not overtake big2
    assert [q["request_id"] for q in snap["queue"]] == ["big2", "small"]
    while h.finished("big1") is None:
        assert "small" in [q["request_id"] for q in h.scheduler.snapshot()["queue"]]
        h.scheduler.step()
    h.run()
    assert h.finished("small").stats.queue_ms >= h.finished("big2").stats.queue_ms
    assert all(h.finished(r).finish_reason == "length" for r in ("big1", "big2", "small"))
    assert h.scheduler.snapshot()["kv"]["blocks_used"] == 0


def test_duplicate_request_id_is_refused(harness):
    h = harness()
    h.scheduler.submit(req("a", 4))
    with pytest.raises(Refusal) as err:
        h.scheduler.submit(req("a", 4))
    assert err.value.code == "duplicate_request_id"


# -- finishing --------------------------------------------------------------------------


def test_eog_token_ends_with_stop_and_is_not_output(harness):
    engine = FakeEngine()
    engine.scripts[7] = [101, 102, EOG, 103]
    h = harness(engine)
    h.scheduler.submit(req("a", 4, max_tokens=10, seed=7))
    h.run()
    done = h.finished("a")
    assert (done.finish_reason, done.stop, done.stats.completion_tokens) == ("stop", None, 2)
    assert h.text("a") == "<101><102>"


def test_stop_string_split_across_tokens_never_reaches_the_client(harness):
    engine = FakeEngine()
    engine.scripts[7] = [101, 102, 103, 104]  # "<101><102><103><104>"
    h = harness(engine)
    h.scheduler.submit(req("a", 4, max_tokens=10, seed=7, params={"stop": ("2><10",)}))
    h.run()
    assert h.text("a") == "<101><10"
    assert h.finished("a").finish_reason == "stop" and h.finished("a").stop == "2><10"


def test_finished_slot_keeps_its_prefix_for_the_same_scope_only(harness):
    h = harness(FakeEngine(n_seq_max=1))
    h.scheduler.submit(req("a", 40, max_tokens=2, cache_scope="t1"))
    h.run()
    h.scheduler.submit(req("b", 40, max_tokens=2, cache_scope="t2"))
    h.run()
    assert h.finished("b").stats.cached_tokens == 0
    h.scheduler.submit(req("c", 40, max_tokens=2, cache_scope="t2"))
    h.run()
    assert h.finished("c").stats.cached_tokens == 39  # the last prompt token is re-evaluated


# -- cancellation -------------------------------------------------------------------------


def test_cancel_while_queued(harness):
    h = harness(FakeEngine(n_seq_max=1))
    h.scheduler.submit(req("a", 4, max_tokens=20))
    h.scheduler.submit(req("b", 4))
    h.scheduler.step()
    assert h.scheduler.cancel("b")
    h.scheduler.step()
    assert h.finished("b").finish_reason == "cancelled"
    assert h.finished("b").stats.completion_tokens == 0
    assert h.scheduler.snapshot()["queue"] == []
    assert not any(s.seed == 0 and s.seen for s in h.engine.samplers[1:])


def test_cancel_mid_prefill_frees_slot_and_blocks(harness):
    h = harness(FakeEngine(n_batch=256), chunk_size=16)
    h.scheduler.submit(req("a", 100))
    h.scheduler.step()
    assert h.scheduler.snapshot()["slots"][0]["state"] == "prefilling"
    h.scheduler.cancel("a")
    h.scheduler.step()
    done = h.finished("a")
    assert done.finish_reason == "cancelled" and done.stats.ttft_ms is None
    snap = h.scheduler.snapshot()
    assert snap["slots"][0]["state"] == "idle" and snap["kv"]["blocks_used"] == 0
    assert h.engine.samplers[0].closed


def test_cancel_while_decoding_returns_partial_text(harness):
    h = harness()
    h.scheduler.submit(req("a", 4, max_tokens=100, seed=3))
    for _ in range(5):
        h.scheduler.step()
    h.scheduler.cancel("a")
    h.scheduler.step()
    done = h.finished("a")
    assert done.finish_reason == "cancelled" and done.stats.completion_tokens == 5
    assert h.text("a") == "".join(f"<{1300 + i}>" for i in range(1, 6))


def test_cancel_during_a_long_decode_aborts_and_rolls_back(harness):
    engine = FakeEngine(n_batch=512)
    h = harness(
        engine, chunk_size=512, abort_min_tokens=64, cache_prompt=False
    )  # no prefix adoption
    h.scheduler.submit(req("other", 4, max_tokens=50, seed=1))
    h.scheduler.step()
    kv_before = {seq: n for seq, n in engine.cells.items() if n}
    h.scheduler.submit(req("long", 300))
    engine.on_decode = lambda rows: (
        h.scheduler.cancel("long") if any(r.seq_id == 1 for r in rows) else None
    )
    h.scheduler.step()  # aborted mid-decode
    after = {seq: n for seq, n in engine.cells.items() if n}
    assert after == kv_before  # both rows rolled back, positions stay consistent
    assert h.finished("long") is None
    engine.on_decode = None
    h.run()
    assert h.finished("long").finish_reason == "cancelled"
    assert h.finished("other").finish_reason == "length"
    assert h.finished("other").stats.completion_tokens == 50


# -- KV pressure --------------------------------------------------------------------------


def test_kv_pressure_purges_idle_cached_prefixes_first(harness):
    engine = FakeEngine(n_ctx=256, kv_cells=100)
    h = harness(engine, kv_budget_tokens=1024, kv_block_tokens=16)
    h.scheduler.submit(req("a", 60, max_tokens=1, cache_scope="t"))
    h.run()
    assert engine.cells[0] == 60  # a's prompt stays cached in slot 0
    h.scheduler.submit(req("b", 30, max_tokens=20, cache_scope="u"))
    h.run()
    assert h.finished("b").finish_reason == "length"
    assert engine.cells[0] == 0
    assert h.scheduler.counters["kv_pressure"] >= 1


def test_kv_pressure_halves_the_batch_then_carries_on(harness):
    engine = FakeEngine(n_ctx=1024, n_batch=64, kv_cells=30)
    h = harness(engine, chunk_size=32, kv_budget_tokens=1024, kv_block_tokens=16)
    h.scheduler.submit(req("a", 4, max_tokens=8))
    h.scheduler.step()
    h.scheduler.submit(req("b", 40, max_tokens=2))
    h.scheduler.step()
    sizes = [sum(len(r.tokens) for r in call) for call in engine.calls[1:]]
    assert sizes == [33, 16]  # 4 + 33 > 30 cells: halved to 16 tokens, which fit
    assert rows_of(engine.calls[-1])[0] == (0, 1, True)  # the decode row still leads
    assert h.scheduler.counters["kv_pressure"] == 1


def test_a_sequence_that_cannot_fit_alone_fails_alone(harness):
    engine = FakeEngine(n_ctx=1024, kv_cells=150)
    h = harness(engine, kv_budget_tokens=4096, kv_block_tokens=16)
    for rid in ("s1", "s2"):
        h.scheduler.submit(req(rid, 10, max_tokens=30, params={"ignore_eos": True}))
    h.scheduler.submit(req("huge", 60, max_tokens=500, params={"ignore_eos": True}))
    h.run()
    assert h.finished("huge").finish_reason == "error"
    assert h.finished("huge").error["code"] == "context_full"
    assert (
        h.finished("s1").finish_reason == "length"
        and h.finished("s1").stats.completion_tokens == 30
    )
    assert (
        h.finished("s2").finish_reason == "length"
        and h.finished("s2").stats.completion_tokens == 30
    )
    assert all(s["state"] == "idle" for s in h.scheduler.snapshot()["slots"])


# -- rows keyed by request ------------------------------------------------------------------


def test_rows_stay_keyed_by_request_when_others_leave(harness):
    engine = FakeEngine()
    h = harness(engine)
    for i, rid in enumerate(("a", "b", "c")):
        h.scheduler.submit(req(rid, 4 + i, max_tokens=12, seed=i + 1))
    for _ in range(4):
        h.scheduler.step()
    h.scheduler.cancel("b")  # b leaves from the middle of the batch
    h.run()
    for rid in ("a", "c"):
        seed = 1 if rid == "a" else 3
        assert h.text(rid) == "".join(f"<{1000 + seed * 100 + n}>" for n in range(1, 13))
    for sampler in (engine.samplers[0], engine.samplers[2]):
        seqs = {seq for seq, _ in sampler.seen}
        positions = [pos for _, pos in sampler.seen]
        assert len(seqs) == 1  # every sample came from this request's own row
        assert positions == list(range(positions[0], positions[0] + len(positions)))
    assert h.finished("b").finish_reason == "cancelled"


def test_snapshot_has_no_text(harness):
    h = harness()
    h.scheduler.submit(req("a", 4, max_tokens=20, cache_scope="tenant-9"))
    h.scheduler.step()
    snap = h.scheduler.snapshot()
    assert snap["slots"][0] == {
        "id": 0,
        "state": "generating",
        "request_id": "a",
        "cache_scope": "tenant-9",
        "kv_tokens": 4,
        "prompt_tokens": 4,
        "cached_tokens": 0,
        "generated_tokens": 1,
    }
    assert "<" not in repr(snap)  # generated pieces look like <1001>


def test_tick_stats_are_reported(harness):
    h = harness()
    h.scheduler.submit(req("a", 4, max_tokens=3))
    h.run()
    first = h.ticks[0]
    assert (first.batch_tokens, first.prefill_tokens, first.decode_tokens, first.active_slots) == (
        4,
        4,
        0,
        1,
    )
    assert [t.decode_tokens for t in h.ticks[1:]] == [1, 1]
    stats = h.finished("a").stats
    assert stats.prompt_tokens == 4 and stats.completion_tokens == 3 and stats.ttft_ms > 0
    assert SlotState.IDLE.value == h.scheduler.snapshot()["slots"][0]["state"]
