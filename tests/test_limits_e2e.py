"""With the real daemon (Gemma): the daemon records a request's actual usage and frees its
concurrency slot at the terminal event; /metrics moves when requests run."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.live_service import redis_conn, wait_until
from tests.test_limits_http import assert_429, make_tenant
from wire import limits as wire_limits

pytestmark = pytest.mark.slow


def scrape(web) -> dict[tuple[str, tuple], float]:
    reply = web.request("GET", "/v1/metrics")
    assert reply.status == 200
    text = reply.response.read().decode()
    reply.conn.close()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == val for k, val in labels.items())
    )


def test_usage_recorded_slot_freed_and_metrics_move(web, daemon):
    tenant_id, key = make_tenant(web, max_concurrent=1, tokens_per_minute=100_000)
    before = scrape(web)
    body = {
        "model": daemon.model,
        "prompt": "The capital of France is",
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    held = web.request("POST", "/v1/completions", body, key)
    assert held.status == 200
    request_id = held.header("X-Request-Id")
    assert_429(
        web.request("POST", "/v1/completions", {**body, "stream": False}, key),
        "concurrency_limited",
    )
    frames = [data for _id, data in held.sse()]
    assert frames[-1] == "[DONE]"
    usage = next(json.loads(f)["usage"] for f in frames[:-1] if json.loads(f).get("usage"))
    used = usage["prompt_tokens"] + usage["completion_tokens"]
    r = redis_conn()
    month_key = wire_limits.month_key(str(tenant_id), time.time())
    wait_until(lambda: r.zscore(wire_limits.inflight_key(str(tenant_id)), request_id) is None)
    assert int(r.get(month_key)) == used
    current = wire_limits.current_usage(r, str(tenant_id), time.time())
    assert current["tokens_this_minute"] == used and current["requests_this_minute"] == 1
    # the slot is free again
    reply = web.request("POST", "/v1/completions", {**body, "stream": False, "max_tokens": 4}, key)
    assert reply.status == 200
    reply.json()
    after = wait_until(
        lambda: (
            (s := scrape(web))
            and total(s, "llm_requests_total", daemon=daemon.daemon_id)
            >= total(before, "llm_requests_total", daemon=daemon.daemon_id) + 2
            and s
        )
    )
    d = {"daemon": daemon.daemon_id}
    assert total(after, "llm_completion_tokens_total", **d) > total(
        before, "llm_completion_tokens_total", **d
    )
    assert total(after, "llm_prompt_tokens_total", **d) > total(
        before, "llm_prompt_tokens_total", **d
    )
    assert (
        total(after, "llm_request_ttft_seconds_count")
        >= total(before, "llm_request_ttft_seconds_count") + 2
    )
    assert total(after, "llm_limit_refusals_total", code="concurrency_limited") >= 1
    assert total(after, "llm_slots", **d) == 2
