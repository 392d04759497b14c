"""Idempotent retries for real (daphne + the session's Gemma daemon): a client that sends
its request again with the same ``Idempotency-Key`` gets the original (same id, same text,
same event ids) and the model runs once, whether the original ended, still streams, or
was sent at the same moment; another body under the key is a 409; a request that never
ran leaves its key free. "Runs once" is read from the tenant's history rows (one per
request that ran) and the daemon's ``submitted`` counter. Every wait has a hang guard."""
from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from tests.live_service import wait_until
from tests.test_limits_http import make_tenant

pytestmark = pytest.mark.slow

SHORT = {"max_tokens": 8, "temperature": 0}
LONG = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}


def new_key() -> dict[str, str]:
    return {"Idempotency-Key": f"retry-{uuid.uuid4()}"}


def rows(web, key: str) -> list[dict]:
    return web.request("GET", "/v1/requests?limit=100", key=key).json()["results"]


def frames(reply) -> list[tuple[str | None, object]]:
    return [(i, d if d == "[DONE]" else json.loads(d)) for i, d in reply.sse()]


def submitted(daemon) -> int:
    """The daemon's count of requests it queued, from a snapshot newer than this call."""
    now = time.time()
    snap = wait_until(lambda: (s := daemon.snapshot()) and s["heartbeat_at"] > now and s,
                      timeout_s=10)
    return snap["counters"].get("submitted", 0)


def test_a_whole_reply_retried_is_the_original_and_runs_once(web, daemon):
    _, key = make_tenant(web)
    headers = new_key()
    body = {"model": daemon.model, "prompt": "The capital of France is", **SHORT}
    before = submitted(daemon)
    first = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert first.status == 200
    request_id = first.header("X-Request-Id")
    original = first.json()
    # the same body spelled differently (key order, spacing), as another client library might
    respelled = json.dumps(dict(reversed(list(body.items()))), indent=2)
    retry = web.request("POST", "/v1/completions", respelled, key, headers=headers)
    assert retry.status == 200
    assert retry.header("X-Request-Id") == request_id
    assert retry.json() == original  # id, created, text, finish_reason, usage
    assert original["choices"][0]["text"]
    assert [r["id"] for r in rows(web, key)] == [request_id]
    assert submitted(daemon) == before + 1


def test_a_stream_retried_after_its_end_replays_it_from_the_start(web, daemon):
    _, key = make_tenant(web)
    headers = new_key()
    body = {"model": daemon.model, "messages": [{"role": "user", "content": "Name a fruit."}],
            "stream": True, "stream_options": {"include_usage": True}, **SHORT}
    first = web.request("POST", "/v1/chat/completions", body, key, headers=headers)
    assert first.status == 200
    original = frames(first)
    assert original[-1] == (None, "[DONE]") and len(original) >= 4
    retry = web.request("POST", "/v1/chat/completions", body, key, headers=headers)
    assert retry.status == 200 and retry.header("X-Request-Id") == first.header("X-Request-Id")
    assert frames(retry) == original  # the same chunks under the same event ids
    assert len(rows(web, key)) == 1


def test_a_retry_while_the_original_streams_gets_all_of_it_and_it_runs_once(web, daemon):
    _, key = make_tenant(web, max_concurrent=2)  # the retry reads like a resume: a slot
    headers = new_key()
    body = {"model": daemon.model, "prompt": "Once upon a time", "stream": True, **LONG}
    first = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert first.status == 200
    events = first.sse()
    head = [next(events), next(events)]  # it is under way
    retry = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert retry.status == 200
    replayed = frames(retry)
    rest = [(i, d if d == "[DONE]" else json.loads(d)) for i, d in events]
    original = [(i, json.loads(d)) for i, d in head] + rest
    assert replayed == original
    text = "".join(c["choices"][0]["text"] for _, c in original[:-1])
    assert text and original[-2][1]["choices"][0]["finish_reason"] == "length"
    assert len(rows(web, key)) == 1


def test_concurrent_first_requests_with_one_key_run_once(web, daemon):
    _, key = make_tenant(web, max_concurrent=4)
    headers = new_key()
    body = {"model": daemon.model, "prompt": "One, two, three,", **SHORT}
    replies: list = [None] * 3
    start = threading.Barrier(3)

    def send(i: int) -> None:
        start.wait(10)
        reply = web.request("POST", "/v1/completions", body, key, headers=headers)
        replies[i] = (reply.status, reply.header("X-Request-Id"), reply.json())

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(replies), "hang guard: a request got no reply"
    assert {status for status, _, _ in replies} == {200}
    assert len({request_id for _, request_id, _ in replies}) == 1
    assert all(body == replies[0][2] for _, _, body in replies)
    assert len(rows(web, key)) == 1


def test_the_same_key_with_another_body_is_409_and_the_original_stands(web, daemon):
    _, key = make_tenant(web)
    headers = new_key()
    body = {"model": daemon.model, "prompt": "Red, green,", **SHORT}
    first = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert first.status == 200
    original = first.json()
    for other_path, other in (("/v1/completions", {**body, "max_tokens": 9}),
                              ("/v1/chat/completions", {"model": daemon.model, **SHORT,
                               "messages": [{"role": "user", "content": "Red, green,"}]})):
        reply = web.request("POST", other_path, other, key, headers=headers)
        error = reply.json()["error"]
        assert (reply.status, error["code"], error["param"]) == (
            409, "idempotency_key_reused", "Idempotency-Key")
    retry = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert retry.json() == original
    assert len(rows(web, key)) == 1
    # the key is the tenant's own: another tenant's same key and body run their own request
    _, other_key = make_tenant(web)
    theirs = web.request("POST", "/v1/completions", body, other_key, headers=headers)
    assert theirs.status == 200 and theirs.json()["id"] != original["id"]


def test_a_request_refused_before_it_ran_leaves_its_key_free(web, daemon):
    _, key = make_tenant(web, max_concurrent=1)
    headers = new_key()
    body = {"model": daemon.model, "prompt": "Blue, yellow,", **SHORT}
    # refused by the web (429: the tenant's one slot is taken)
    holder = web.request("POST", "/v1/completions",
                         {"model": daemon.model, "prompt": "Hold", "stream": True, **LONG}, key)
    assert holder.status == 200
    refused = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert (refused.status, refused.json()["error"]["code"]) == (429, "concurrency_limited")
    assert [f for f in holder.sse()][-1][1] == "[DONE]"  # the slot comes back at its end
    # refused by the daemon after it was queued (400: prompt + max_tokens over the share)
    too_long = {**body, "max_tokens": 1020}
    reply = web.request("POST", "/v1/completions", too_long, key, headers=headers)
    assert (reply.status, reply.json()["error"]["code"]) == (400, "device_memory_budget_exceeded")
    # neither kept the key: another body under it runs (not a 409), once
    ran = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert ran.status == 200
    request_id = ran.header("X-Request-Id")
    again = web.request("POST", "/v1/completions", body, key, headers=headers)
    assert again.header("X-Request-Id") == request_id
    assert ran.json() == again.json()
    ran_rows = [r for r in rows(web, key) if r["status"] == "done"]
    assert [r["id"] for r in ran_rows] == [request_id, holder.header("X-Request-Id")]


def test_a_timed_out_request_retried_is_the_same_504(web, daemon):
    _, key = make_tenant(web)
    headers = new_key()
    body = {"model": daemon.model, "prompt": "Count: one, two,", "timeout": 2,
            "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    first = web.request("POST", "/v1/completions", body, key, headers=headers, timeout=120)
    original = first.json()
    assert first.status == 504 and original["error"]["code"] == "timeout"
    assert original["error"]["partial_text"]
    retry = web.request("POST", "/v1/completions", body, key, headers=headers, timeout=120)
    assert (retry.status, retry.json()) == (504, original)
    assert len(rows(web, key)) == 1
