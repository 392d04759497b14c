"""A request that can never fit is refused priced in KV bytes: ``context_length_exceeded``
past ``n_ctx``, ``device_memory_budget_exceeded`` past what one request may reserve of the KV
block budget; ``estimated_bytes`` = ``kv_bytes_per_token`` x (prompt + max_tokens) and
``limit_bytes`` = ``kv_bytes_per_token`` x the limit in tokens. The policy on the fake engine;
the numbers on the real Gemma engine."""

from __future__ import annotations

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import Request
from wire import errors
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .fake_engine import FakeEngine


def req(rid: str, n_prompt: int, max_tokens: int | None) -> Request:
    return Request(id=rid, prompt_tokens=list(range(1, n_prompt + 1)),
                   params=SamplingParams(max_tokens=max_tokens))


def refusal(h, n_prompt: int, max_tokens: int | None) -> Refusal:
    with pytest.raises(Refusal) as refused:
        h.scheduler.submit(req("r", n_prompt, max_tokens))
    assert not h.scheduler.has_work()  # nothing was queued
    return refused.value


def test_a_tenant_share_refusal_is_its_own_code_priced_in_kv_bytes(harness):
    # n_ctx 1024 in 16 blocks of 64; one scope may reserve 8 blocks: 512 tokens
    h = harness(FakeEngine(n_ctx=1024), kv_block_tokens=64, kv_scope_share=0.5)
    per_token = h.engine.kv_bytes_per_token
    refused = refusal(h, 8, 600)
    assert refused.code == errors.DEVICE_MEMORY_BUDGET_EXCEEDED == "device_memory_budget_exceeded"
    assert refused.param == "max_tokens"
    details = refused.details
    assert (details["prompt_tokens"], details["max_tokens"], details["limit"]) == (8, 600, 512)
    assert details["kv_bytes_per_token"] == per_token == 100
    assert details["estimated_bytes"] == per_token * (8 + 600) == 60_800
    assert details["limit_bytes"] == per_token * 512 == 51_200
    assert "60800 bytes" in refused.message and "51200 bytes" in refused.message
    assert errors.status_of(refused.code) == 400
    assert h.scheduler.counters["refused_device_memory_budget"] == 1
    h.scheduler.submit(req("fits", 8, 504))  # exactly the share: queued
    assert h.scheduler.has_work()


def test_past_n_ctx_stays_context_length_exceeded_and_is_priced(harness):
    h = harness(FakeEngine(n_ctx=1024), kv_block_tokens=64, kv_scope_share=0.5)
    refused = refusal(h, 8, 2000)
    assert refused.code == errors.CONTEXT_LENGTH_EXCEEDED
    assert refused.details["limit"] == 1024  # the context, though the share is tighter
    assert refused.details["estimated_bytes"] == 100 * 2008
    assert refused.details["limit_bytes"] == 100 * 1024
    assert h.scheduler.counters["refused_context_length"] == 1
    assert h.scheduler.counters["refused_device_memory_budget"] == 0


def test_a_prompt_over_the_budget_names_the_prompt_and_prices_one_token_to_generate(harness):
    h = harness(FakeEngine(n_ctx=1024), kv_block_tokens=64, kv_budget_tokens=256)
    refused = refusal(h, 300, None)  # no max_tokens: the default, at least one token
    assert (refused.code, refused.param) == (errors.DEVICE_MEMORY_BUDGET_EXCEEDED, "prompt")
    assert (refused.details["max_tokens"], refused.details["limit"]) == (1, 256)
    assert refused.details["estimated_bytes"] == 100 * 301
    assert refused.details["limit_bytes"] == 100 * 256
    refused = refusal(h, 1100, None)
    assert (refused.code, refused.param) == (errors.CONTEXT_LENGTH_EXCEEDED, "prompt")
    assert refused.details["estimated_bytes"] == 100 * 1101


def test_with_no_budget_below_the_context_every_refusal_is_the_contexts(harness):
    h = harness(FakeEngine(n_ctx=1024), kv_block_tokens=64)
    assert refusal(h, 8, 1017).code == errors.CONTEXT_LENGTH_EXCEEDED
    h.scheduler.submit(req("fits", 8, 1016))
    assert h.scheduler.has_work()


@pytest.mark.slow
def test_real_refusals_are_priced_from_the_engines_kv_shape(gemma_engine):
    # n_ctx 4096 in 64 blocks of 64; a quarter of them for one scope: 1024 tokens
    core = InferenceCore(gemma_engine, SchedulerConfig(kv_block_tokens=64, kv_scope_share=0.25))
    core.start()
    try:
        per_token = gemma_engine.kv_bytes_per_token
        assert per_token > 0
        messages = [{"role": "user", "content": "Name three rivers of Europe."}]
        n_prompt = len(core.prompt_tokens(None, messages))

        def refused(max_tokens: int) -> Refusal:
            with pytest.raises(Refusal) as caught:
                core.submit(messages=messages, params=SamplingParams(max_tokens=max_tokens))
            details = caught.value.details
            assert details["prompt_tokens"] == n_prompt
            assert details["kv_bytes_per_token"] == per_token
            assert details["estimated_bytes"] == per_token * (n_prompt + max_tokens)
            assert details["limit_bytes"] == per_token * details["limit"]
            return caught.value

        over_share = refused(1024 - n_prompt + 1)
        assert over_share.code == "device_memory_budget_exceeded"
        assert over_share.details["limit"] == 1024
        assert over_share.details["limit_bytes"] == per_token * 1024
        over_context = refused(4096 - n_prompt + 1)
        assert over_context.code == "context_length_exceeded"
        assert over_context.details["limit_bytes"] == per_token * 4096
        assert not core.scheduler.has_work()
        done = core.submit(messages=messages, cache_prompt=False,
                           params=SamplingParams(max_tokens=8, temperature=0.0)
                           ).result(timeout=120).finished
        assert done.finish_reason in ("stop", "length") and done.stats.completion_tokens > 0
        assert done.stats.prompt_tokens == n_prompt
    finally:
        core.stop(grace_s=0)
