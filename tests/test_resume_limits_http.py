"""SSE resumes against the tenant's concurrency (issue 12), over a real daphne with a
stand-in daemon: a resume holds a slot in the tenant's in-flight set while it reads
(429 concurrency_limited past max_concurrent, before any byte of the stream) and frees
it at the end; a resume of events that never came is 404 events_expired at once."""
from __future__ import annotations

import threading

from tests.live_service import StandIn, redis_conn, wait_until
from tests.test_limits_http import assert_429, chat, make_tenant, shell
from wire import limits as wire_limits
from wire import protocol

GUARD_S = 30  # hang guard


def hold(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    daemon.emit(job.id, protocol.TOKEN, {"text": "x", "n_tokens": 1})
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=GUARD_S)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


def resume_slots(tenant_id: int) -> list[bytes]:
    members = redis_conn().zrange(wire_limits.inflight_key(str(tenant_id)), 0, -1)
    return [m for m in members if m.startswith(b"resume:")]


def test_sse_resumes_count_against_max_concurrent(web, standin):
    tenant_id, key = make_tenant(web, max_concurrent=2)
    release = threading.Event()
    standin.serve(lambda d, j: hold(d, j, release))
    try:
        held = chat(web, standin, key, stream=True)  # slot 1
        assert held.status == 200
        request_id = held.header("X-Request-Id")
        path = f"/v1/requests/{request_id}/events"
        first = web.request("GET", path, key=key, timeout=GUARD_S)  # slot 2 while it reads
        assert first.status == 200
        wait_until(lambda: len(resume_slots(tenant_id)) == 1, timeout_s=GUARD_S)
        assert_429(web.request("GET", path, key=key), "concurrency_limited")
        assert_429(chat(web, standin, key), "concurrency_limited")
    finally:
        release.set()
    assert [data for _id, data in first.sse()][-1] == "[DONE]"
    wait_until(lambda: resume_slots(tenant_id) == [], timeout_s=GUARD_S)
    held.conn.close()


def test_sse_resume_of_a_request_nobody_took_is_404_at_once(web, standin):
    tenant_id, key = make_tenant(web)
    # queued long ago, never accepted (the web that queued it died before closing it)
    request_id = shell(web, f"""
from datetime import timedelta
from django.utils import timezone
from inference.models import InferenceRequest
print(InferenceRequest.objects.create(tenant_id={tenant_id}, kind="chat", model="{standin.model}",
      created=timezone.now() - timedelta(hours=1)).id)
""")
    reply = web.request("GET", f"/v1/requests/{request_id}/events", key=key, timeout=GUARD_S)
    assert reply.status == 404
    assert reply.json()["error"]["code"] == "events_expired"
