"""/metrics: access control, the Prometheus text format, and values that move."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from django.test import Client, override_settings
from prometheus_client.parser import text_string_to_metric_families

from inference import limits, metrics
from inference.errors import ApiError
from wire import protocol

URL = "/metrics"  # also served at /v1/metrics


def scrape(client: Client | None = None, **headers: str) -> dict[str, list]:
    reply = (client or Client()).get(URL, **headers)
    assert reply.status_code == 200, reply.content
    assert reply["Content-Type"].startswith("text/plain")
    return {f.name: f.samples for f in text_string_to_metric_families(reply.content.decode())}


def value(families: dict[str, list], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    return sum(
        s.value
        for s in families.get(family, [])
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


@pytest.fixture
def fake_daemon(redis_client):
    """A published snapshot (as a daemon's heartbeat writes it) with known numbers."""
    daemon_id, model = f"metrics-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    snap = {
        "daemon_id": daemon_id,
        "model": model,
        "heartbeat_at": time.time(),
        "slots": [{"id": 0, "state": "generating"}, {"id": 1, "state": "idle"}],
        "queue": [{"request_id": "q1"}, {"request_id": "q2"}, {"request_id": "q3"}],
        "kv": {"blocks_used": 5, "blocks_total": 8},
        "counters": {
            "finished_stop": 4,
            "finished_length": 2,
            "prompt_tokens": 100,
            "completion_tokens": 40,
            "cached_tokens": 30,
            "cache_lookups": 6,
            "cache_hits_slot": 2,
            "cache_hits_ram": 1,
            "cache_hit_tokens_ram": 16,
            "kv_pressure": 3,
            "refused_queue_full": 7,
        },
        "cache": {"ram_bytes": 12345, "ram_budget_bytes": 99999},
    }
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: time.time()})
    yield daemon_id
    redis_client.delete(protocol.daemon_key(daemon_id))
    redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)


def test_metrics_read_every_live_daemons_snapshot(fake_daemon):
    got = scrape()
    d = {"daemon": fake_daemon}
    assert value(got, "llm_requests_total", finish_reason="stop", **d) == 4
    assert value(got, "llm_requests_total", finish_reason="length", **d) == 2
    assert value(got, "llm_prompt_tokens_total", **d) == 100
    assert value(got, "llm_completion_tokens_total", **d) == 40
    assert value(got, "llm_cached_tokens_total", **d) == 30
    assert value(got, "llm_prefix_cache_lookups_total", **d) == 6
    assert value(got, "llm_prefix_cache_hits_total", tier="slot", **d) == 2
    assert value(got, "llm_prefix_cache_hits_total", tier="ram", **d) == 1
    assert value(got, "llm_prefix_cache_hit_tokens_total", tier="ram", **d) == 16
    assert value(got, "llm_kv_pressure_events_total", **d) == 3
    assert value(got, "llm_daemon_refusals_total", code="queue_full", **d) == 7
    assert value(got, "llm_queue_depth", **d) == 3
    assert value(got, "llm_active_slots", **d) == 1
    assert value(got, "llm_slots", **d) == 2
    assert value(got, "llm_kv_blocks_used", **d) == 5
    assert value(got, "llm_ram_cache_bytes", **d) == 12345
    for name in ("llm_limit_refusals", "llm_request_ttft_seconds", "llm_request_duration_seconds"):
        assert name in got


def test_latency_histograms_and_refusals_move():
    before = scrape()
    metrics.observe_end(
        {"finish_reason": "stop", "timings": {"ttft_ms": 120.0, "duration_ms": 900.0}}, "done"
    )
    with pytest.raises(ApiError):
        limits.admit_sync(f"t-{uuid.uuid4().hex}", "r", limits.Limits(requests_per_minute=0))
    after = scrape()
    assert (
        value(after, "llm_request_ttft_seconds_count")
        == value(before, "llm_request_ttft_seconds_count") + 1
    )
    assert value(after, "llm_request_ttft_seconds_sum") == pytest.approx(
        value(before, "llm_request_ttft_seconds_sum") + 0.12
    )
    assert (
        value(after, "llm_request_duration_seconds_count")
        == value(before, "llm_request_duration_seconds_count") + 1
    )
    assert (
        value(after, "llm_web_requests_total", status="stop")
        == value(before, "llm_web_requests_total", status="stop") + 1
    )
    assert (
        value(after, "llm_limit_refusals_total", code="rpm_exceeded")
        == value(before, "llm_limit_refusals_total", code="rpm_exceeded") + 1
    )


def refused(reply, status: int, code: str) -> None:
    assert reply.status_code == status
    error = reply.json()["error"]
    assert (error["code"], error["type"]) == (code, "invalid_request_error")


@pytest.mark.parametrize("url", [URL, "/v1/metrics"])
def test_outside_the_allowed_networks_is_403(url):
    refused(Client(REMOTE_ADDR="10.1.2.3").get(url), 403, "permission_denied")
    with override_settings(METRICS_ALLOWED_NETS=["10.0.0.0/8"]):
        assert Client(REMOTE_ADDR="10.1.2.3").get(url).status_code == 200
        refused(Client().get(url), 403, "permission_denied")  # loopback is not on the list


def test_the_allowed_networks_take_addresses_and_ipv4_mapped_ones():
    with override_settings(METRICS_ALLOWED_NETS=["192.0.2.7", "2001:db8::/32"]):
        for allowed in ("192.0.2.7", "::ffff:192.0.2.7", "2001:db8::1"):
            assert Client(REMOTE_ADDR=allowed).get(URL).status_code == 200, allowed
        for other in ("192.0.2.8", "2001:db9::1", "", "unix"):
            refused(Client(REMOTE_ADDR=other).get(URL), 403, "permission_denied")


@override_settings(METRICS_TOKEN="s3cret")
def test_a_token_when_one_is_set_even_from_loopback():
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer wrong"},
                    {"HTTP_AUTHORIZATION": "Basic s3cret"}, {"HTTP_AUTHORIZATION": "s3cret"}):
        reply = Client().get(URL, **headers)
        refused(reply, 401, "invalid_api_key")
        assert reply["WWW-Authenticate"] == "Bearer"
    scrape(HTTP_AUTHORIZATION="Bearer s3cret")
    scrape(Client(REMOTE_ADDR="10.1.2.3"), HTTP_AUTHORIZATION="Bearer s3cret")  # any address
