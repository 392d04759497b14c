"""Each tick's plan (``Scheduler.schedule()`` -> ``TickPlan``), inspected before it is decoded."""

from __future__ import annotations

from scheduler_daemon.core.plan import Phase
from scheduler_daemon.core.state import Request
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine


def req(rid: str, prompt: list[int] | int, max_tokens: int = 8, scope: str = "A",
        **kw) -> Request:
    tokens = list(range(10, 10 + prompt)) if isinstance(prompt, int) else prompt
    return Request(id=rid, prompt_tokens=tokens, params=SamplingParams(max_tokens=max_tokens),
                   cache_scope=scope, **kw)


def two_decoders(h) -> None:
    """a and b generating (short prompts, long replies); no prefix cache in play."""
    h.scheduler.submit(req("a", 4, max_tokens=100, cache_prompt=False))
    h.scheduler.submit(req("b", 4, max_tokens=100, cache_prompt=False))
    h.step()
    assert h.scheduler.last_plan.decoding() == []  # both were prefilling


def test_a_long_prefill_beside_two_decoders_gets_chunk_sized_pieces_after_them(harness):
    h = harness(FakeEngine(n_batch=64), chunk_size=16, cache_prompt=False)
    two_decoders(h)
    h.scheduler.submit(req("c", 100, max_tokens=4))
    chunks = []
    while True:
        plan = h.scheduler.schedule()
        assert plan.token_budget == 64
        prefill = [r for r in plan.rows if r.phase is Phase.PREFILL]
        if not prefill:
            assert plan.decoding() == ["a", "b", "c"]  # c's prompt is in: it generates
            break
        assert [r.phase for r in plan.rows[:2]] == [Phase.DECODE, Phase.DECODE]
        assert plan.decoding() == ["a", "b"]  # the decoders lead, one token each
        assert all(r.n_tokens == 1 and r.row.logits for r in plan.rows[:2])
        [row] = prefill
        chunks.append(row.n_tokens)
        assert row.row.logits == (sum(chunks) == 100)  # logits only on the prompt's last token
        stats = h.scheduler.run(plan)
        assert (stats.decode_tokens, stats.prefill_tokens) == (2, row.n_tokens)
    assert chunks == [16, 16, 16, 16, 16, 16, 4]  # CHUNK_SIZE pieces, then the rest
    h.scheduler.run(plan)


def test_the_token_budget_bounds_the_chunk_after_the_decode_rows(harness):
    h = harness(FakeEngine(n_batch=12), chunk_size=16, cache_prompt=False)
    two_decoders(h)
    h.scheduler.submit(req("c", 100, max_tokens=4))
    plan = h.scheduler.schedule()
    assert plan.decoding() == ["a", "b"] and plan.prefill_chunks() == {"c": 10}
    assert plan.n_tokens == 12 and [r.row for r in plan.rows] == plan.batch
    h.scheduler.run(plan)


def test_a_plan_says_what_was_cancelled_and_admitted_at_its_start(harness):
    h = harness(FakeEngine(n_seq_max=1), cache_prompt=False)
    h.scheduler.submit(req("a", 8))
    h.scheduler.submit(req("b", 8))
    h.scheduler.cancel("a")
    plan = h.scheduler.schedule()
    assert (plan.cancelled, plan.admitted) == (["a"], ["b"])
    assert plan.prefill_chunks() == {"b": 8} and plan.decoding() == []
    assert [(r.request_id, r.seq_id) for r in plan.rows] == [("b", 0)]
    h.scheduler.run(plan)
    assert h.finished("a").finish_reason == "cancelled"


def test_a_prefill_another_row_computes_is_deferred_not_planned(harness):
    shared = list(range(100, 160))
    h = harness(FakeEngine(n_batch=512), chunk_size=512)
    h.scheduler.submit(req("a1", shared + [1, 2, 3]))
    h.scheduler.submit(req("a2", shared + [4, 5, 6]))
    plan = h.scheduler.schedule()
    assert plan.admitted == ["a1", "a2"] and plan.deferred == ["a2"]
    assert plan.prefill_chunks() == {"a1": 63}
    h.scheduler.run(plan)
    h.run()
    assert h.finished("a2").stats.cached_tokens == 60


def test_under_kv_pressure_the_plan_decoded_is_a_smaller_one(harness):
    engine = FakeEngine(n_batch=64, kv_cells=40)
    h = harness(engine, chunk_size=64, cache_prompt=False, kv_budget_tokens=1024)
    h.scheduler.submit(req("a", 48, max_tokens=2))
    first = h.scheduler.schedule()
    assert first.prefill_chunks() == {"a": 48}
    h.scheduler.run(first)
    decoded = h.scheduler.last_plan
    assert decoded is not first and decoded.token_budget == 24
    assert decoded.prefill_chunks() == {"a": 24} and decoded.tick == first.tick
    assert h.ticks[-1].kv_retries == 1
