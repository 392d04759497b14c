"""Deadlines for real (daphne + a Gemma daemon of this module's own): a request past its
``timeout`` ends with the text it made and ``timeout``, billed, its slots freed, whether it
was generating or queued inside the daemon; a job whose deadline passed before the daemon
started it is refused with 504. Timeouts are small and ``max_tokens`` large, so what ends a
request is its deadline; no assertion is about how long anything took, and every wait has a
hang guard."""
from __future__ import annotations

import json
import threading
import time

import pytest

from tests.live_service import RealDaemon, redis_conn, wait_until
from tests.test_limits_http import make_tenant
from wire import limits as wire_limits
from wire import protocol

pytestmark = pytest.mark.slow

TIMEOUT_S = 3  # small next to what LONG asks for: 900 tokens never fit in it
# (a tenant's share of the daemon's 2048-token context is 1024: KV_TENANT_SHARE 0.5)
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(web):
    """Its own daemon: a test here drains it (the session's shared one must not pause)."""
    own = RealDaemon(web, f"gemma-deadline-{time.monotonic_ns() % 10**6}").start()
    yield own
    own.stop()


@pytest.fixture(scope="module")
def tenant(web):
    """A tenant with one request at a time: a slot not freed shows as a 429."""
    return make_tenant(web, max_concurrent=1)


def sse_frames(reply) -> list[tuple[str | None, object]]:
    return [(i, d if d == "[DONE]" else json.loads(d)) for i, d in reply.sse()]


def history(web, key: str, request_id: str) -> dict:
    return web.request("GET", f"/v1/requests/{request_id}", key=key).json()


def slots_idle(daemon: RealDaemon) -> bool:
    snap = daemon.snapshot()
    return bool(snap) and all(s["state"] == "idle" for s in snap["slots"])


def assert_admitted_again(web, daemon, key: str) -> None:
    """The tenant's one concurrency slot is free: its next request is admitted and runs."""
    body = {"model": daemon.model, "prompt": "Hi", "max_tokens": 2}
    reply = web.request("POST", "/v1/completions", body, key)
    assert reply.status == 200, reply.json()
    assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_stream_past_its_timeout_ends_with_its_text_then_the_timeout(web, daemon, tenant):
    tenant_id, key = tenant
    body = {"model": daemon.model, "prompt": "Count: one, two,", "stream": True,
            "stream_options": {"include_usage": True}, "timeout": TIMEOUT_S, **LONG}
    reply = web.request("POST", "/v1/completions", body, key, timeout=120)
    assert reply.status == 200
    request_id = reply.header("X-Request-Id")
    frames = sse_frames(reply)
    assert frames[-1] == (None, "[DONE]")
    entry_id, last = frames[-2]
    assert entry_id  # the daemon's event, not the web's backstop (which has no id)
    assert last["error"]["code"] == "timeout" and last["error"]["type"] == "server_error"
    text = "".join(c["choices"][0]["text"] for _, c in frames[:-2] if c.get("choices"))
    assert text  # the partial output came first
    row = wait_until(lambda: (r := history(web, key, request_id))["finished"] and r)
    assert (row["status"], row["error_code"]) == ("error", "timeout")
    assert 0 < row["completion_tokens"] < LONG["max_tokens"]  # billed what it made
    r = redis_conn()
    assert r.zscore(wire_limits.inflight_key(str(tenant_id)), request_id) is None
    wait_until(lambda: slots_idle(daemon), timeout_s=10)  # its daemon slot and KV freed
    assert_admitted_again(web, daemon, key)


def test_a_whole_reply_past_its_timeout_is_a_504_with_its_partial_text(web, daemon, tenant):
    _, key = tenant
    body = {"model": daemon.model, "messages": [{"role": "user", "content": "Tell a story."}],
            "timeout": TIMEOUT_S, **LONG}
    reply = web.request("POST", "/v1/chat/completions", body, key, timeout=120)
    error = reply.json()["error"]
    assert reply.status == 504 and error["code"] == "timeout"
    assert error["partial_text"]
    usage = error["usage"]
    assert 0 < usage["completion_tokens"] < LONG["max_tokens"] and usage["prompt_tokens"] > 0
    newest = web.request("GET", "/v1/requests?limit=1", key=key).json()["results"][0]
    assert (newest["status"], newest["error_code"]) == ("error", "timeout")
    assert newest["completion_tokens"] == usage["completion_tokens"]  # billed what it showed
    wait_until(lambda: slots_idle(daemon), timeout_s=10)
    assert_admitted_again(web, daemon, key)


def test_a_request_queued_in_the_daemon_expires_there(web, daemon):
    """Both slots (and the whole KV budget) busy with two tenants' requests that have no
    short deadline: a third tenant's waits in the scheduler's queue, accepted, and ends
    there with ``timeout``, nothing generated."""
    _, key = make_tenant(web)
    blockers = []
    for _ in range(2):
        _, blocker_key = make_tenant(web)
        body = {"model": daemon.model, "prompt": "Blocker", "stream": True, **LONG}
        blocker = web.request("POST", "/v1/completions", body, blocker_key, timeout=120)
        assert blocker.status == 200
        blockers.append((blocker, blocker_key))
    try:
        wait_until(lambda: all(s["state"] != "idle" for s in daemon.snapshot()["slots"]),
                   timeout_s=30)
        body = {"model": daemon.model, "prompt": "Queued", "stream": True, "timeout": 2,
                "stream_options": {"include_usage": True}, **LONG}
        reply = web.request("POST", "/v1/completions", body, key, timeout=120)
        assert reply.status == 200  # accepted: the stream opened, then it waited its turn
        frames = sse_frames(reply)
        error = frames[-2][1]["error"]
        assert error["code"] == "timeout"
        assert not [c for _, c in frames[:-2] if c.get("choices") and c["choices"][0]["text"]]
        row = wait_until(lambda: (r := history(web, key, reply.header("X-Request-Id")))
                         ["finished"] and r)
        assert (row["status"], row["error_code"], row["completion_tokens"]) == (
            "error", "timeout", 0)
        assert daemon.snapshot()["counters"]["timeouts"] >= 1
        assert all(s["state"] != "idle" for s in daemon.snapshot()["slots"])  # others go on
    finally:
        for blocker, blocker_key in blockers:
            request_id = blocker.header("X-Request-Id")
            web.request("POST", f"/v1/requests/{request_id}/cancel", key=blocker_key).json()
            blocker.close()
    wait_until(lambda: slots_idle(daemon), timeout_s=30)


def test_a_job_whose_deadline_passed_before_it_started_is_refused_504(web, daemon):
    """The daemon stops reading jobs (an operator's drain); the job waits in the jobs
    stream past its deadline; once the daemon reads it again it refuses it: nothing runs."""
    _, key = make_tenant(web, max_concurrent=2)
    r = redis_conn()
    r.xadd(protocol.control_stream(daemon.daemon_id), protocol.encode_command("drain"))
    replies: list = []
    try:
        wait_until(lambda: daemon.snapshot().get("draining"), timeout_s=30)
        submitted_before = daemon.snapshot()["counters"].get("submitted", 0)
        prompt = f"Late {time.time_ns()}"  # finds its job among the stream's older entries
        body = {"model": daemon.model, "prompt": prompt, "timeout": 1, **LONG}
        sender = threading.Thread(target=lambda: replies.append(
            web.request("POST", "/v1/completions", body, key, timeout=120)), daemon=True)
        sender.start()
        stream = protocol.jobs_stream(daemon.model)
        job = wait_until(lambda: _job_with(r, stream, prompt), timeout_s=10)
        while time.time() <= job.deadline:  # until its deadline has passed (not a verdict)
            time.sleep(0.1)
    finally:
        r.xadd(protocol.control_stream(daemon.daemon_id), protocol.encode_command("resume"))
    sender.join(60)
    assert replies, "hang guard: no reply"
    reply = replies[0]
    error = reply.json()["error"]
    assert (reply.status, error["code"]) == (504, "timeout")
    assert "partial_text" not in error  # refused: it never ran
    row = wait_until(lambda: (rw := history(web, key, job.id))["finished"] and rw)
    assert (row["status"], row["error_code"]) == ("error", "timeout")
    assert row["started"] is None and not row["completion_tokens"]  # refused: nothing ran
    assert daemon.snapshot()["counters"].get("submitted", 0) == submitted_before


def _job_with(r, stream: str, prompt: str) -> protocol.Job | None:
    jobs = (protocol.Job.decode(fields) for _, fields in r.xrange(stream, "-", "+"))
    return next((job for job in jobs if job.prompt == prompt), None)
