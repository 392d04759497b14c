"""Priced refusals over HTTP: daphne, a real daemon (Gemma, N_CTX 2048, KV_TENANT_SHARE 0.5:
one request may reserve 1024 tokens of KV), real Redis. A request past the share is a 400
``device_memory_budget_exceeded``, one past the context a 400 ``context_length_exceeded``,
both in OpenAI's error shape with ``estimated_bytes`` and ``limit_bytes``. Slow: the model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Name a river."}]
# Gemma 3 270M's KV per token: 18 layers x (K + V) x one 256-wide head x 2 bytes (f16)
GEMMA_KV_BYTES_PER_TOKEN_AT_LEAST = 18 * 2 * 256 * 2


def _chat(web, daemon, max_tokens: int):
    body = {"model": daemon.model, "messages": MESSAGES, "max_tokens": max_tokens,
            "temperature": 0}
    return web.request("POST", "/v1/chat/completions", body, web.keys["owner"], timeout=120)


def test_refusals_are_priced_in_kv_bytes_and_a_request_within_limits_answers(web, daemon):
    answered = _chat(web, daemon, 4)
    assert answered.status == 200, answered.json()
    n_prompt = answered.json()["usage"]["prompt_tokens"]
    for max_tokens, code, limit in ((1024 - n_prompt + 1, "device_memory_budget_exceeded", 1024),
                                    (2048 - n_prompt + 1, "context_length_exceeded", 2048)):
        reply = _chat(web, daemon, max_tokens)
        error = reply.json()["error"]
        assert reply.status == 400, error
        assert (error["code"], error["type"], error["param"]) == (
            code, "invalid_request_error", "max_tokens")
        per_token = error["kv_bytes_per_token"]
        assert per_token >= GEMMA_KV_BYTES_PER_TOKEN_AT_LEAST
        assert (error["prompt_tokens"], error["max_tokens"], error["limit"]) == (
            n_prompt, max_tokens, limit)
        assert error["estimated_bytes"] == per_token * (n_prompt + max_tokens)
        assert error["limit_bytes"] == per_token * limit
        assert str(error["estimated_bytes"]) in error["message"]
