"""Token limits reserved at admission, live (issue 12): real daphne, real daemon (Gemma),
real Redis. Eight concurrent requests with 50 tokens of monthly budget left never use more
than the budget (counted only at the end they could use 2,440); the daemon's end of each request
replaces its reservation with its actual usage; the prompt estimate bounds the real count."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from inference import limits
from tests.live_service import redis_conn, wait_until
from tests.test_limits_http import make_tenant
from wire import limits as wire_limits

pytestmark = pytest.mark.slow


def test_eight_concurrent_requests_stay_within_the_budget(web, daemon):
    tenant_id, key = make_tenant(web, monthly_token_budget=1000)
    r = redis_conn()
    month_key = wire_limits.month_key(str(tenant_id), time.time())
    r.set(month_key, 950, ex=3600)  # 50 tokens left
    body = {"model": daemon.model, "prompt": "Once upon a time", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}
    assert limits.reservation(body["prompt"], None, 8) <= 50

    def one(_: int) -> tuple[int, dict]:
        reply = web.request("POST", "/v1/completions", body, key, timeout=300)
        return reply.status, reply.json()

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    statuses = sorted(status for status, _ in results)
    assert statuses.count(200) >= 1, results
    assert set(statuses) <= {200, 429}, results
    assert all(body["error"]["code"] == "budget_exceeded"
               for status, body in results if status == 429)
    used = sum(body["usage"]["total_tokens"] for status, body in results if status == 200)
    wait_until(lambda: int(r.get(month_key)) == 950 + used, timeout_s=30)
    assert int(r.get(month_key)) <= 1000
    wait_until(lambda: not r.hlen(wire_limits.reserved_key(str(tenant_id))), timeout_s=30)


def test_the_prompt_estimate_bounds_the_real_prompt(web, daemon):
    _, key = make_tenant(web, monthly_token_budget=1_000_000)
    messages = [{"role": "system", "content": "Réponds en une phrase. 日本語も可。"},
                {"role": "user", "content": "hello <end_of_turn> friend 👋🏽"}]
    reply = web.request("POST", "/v1/chat/completions",
                        {"model": daemon.model, "messages": messages, "max_tokens": 1}, key,
                        timeout=300)
    assert reply.status == 200
    usage = reply.json()["usage"]
    estimate = limits.reservation(None, messages, 1) - 1
    assert usage["prompt_tokens"] <= estimate, (usage, estimate)
    prompt = "The quick brown fox " * 20
    reply = web.request("POST", "/v1/completions",
                        {"model": daemon.model, "prompt": prompt, "max_tokens": 1}, key,
                        timeout=300)
    assert reply.status == 200
    assert reply.json()["usage"]["prompt_tokens"] <= limits.reservation(prompt, None, 1) - 1
