"""Tenant limits over HTTP (a real daphne; a stand-in daemon answers): the 429s a client
sees, that a refused request is neither queued nor stored, the web's own slot release when
a daemon dies, and a raised budget letting the tenant in at once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

from inference import auth
from tests.live_service import ROOT, StandIn, echo, redis_conn, wait_until
from wire import limits as wire_limits
from wire import protocol

HELLO = [{"role": "user", "content": "Hi"}]


def shell(web, code: str) -> str:
    done = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", code],
        cwd=ROOT,
        env=web.env,
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""


def make_tenant(web, **limits) -> tuple[int, str]:
    """A new tenant in the web's database with ``limits``: (tenant id, API key)."""
    out = shell(
        web,
        f"""
import json
from accounts.models import ApiKey, Tenant
t = Tenant.objects.create(slug="lim-{uuid.uuid4().hex[:8]}", name="Limits", **{limits!r})
print(json.dumps([t.id, ApiKey.issue(t)[1]]))
""",
    )
    tenant_id, key = json.loads(out)
    # Tenant ids repeat across the test servers' own databases, which share one Redis db: a
    # new tenant's limit keys may hold another server's tenant's counts. It starts clean.
    t = str(tenant_id)
    redis_conn().delete(wire_limits.inflight_key(t), wire_limits.reserved_key(t),
                        wire_limits.rpm_key(t), wire_limits.tpm_key(t),
                        wire_limits.month_key(t, time.time()), wire_limits.tenant_refusals_key(t))
    return tenant_id, key


def set_limits(web, tenant_id: int, **limits) -> None:
    shell(
        web,
        "from accounts.models import Tenant; "
        f"Tenant.objects.filter(pk={tenant_id}).update(**{limits!r})",
    )


def chat(web, standin, key, **body):
    body = {"model": standin.model, "messages": HELLO, **body}
    return web.request("POST", "/v1/chat/completions", body, key)


def assert_429(reply, code: str) -> None:
    assert reply.status == 429
    assert int(reply.header("Retry-After")) >= 1
    error = reply.json()["error"]
    assert error["code"] == code and error["type"] == "rate_limit_error" and error["message"]
    assert error["retry_after_s"] == int(reply.header("Retry-After"))


def test_requests_per_minute_over_http(web, standin):
    _, key = make_tenant(web, requests_per_minute=2)
    standin.serve(echo, jobs=2)
    assert chat(web, standin, key).status == 200
    assert chat(web, standin, key).status == 200
    refused = chat(web, standin, key)
    assert_429(refused, "rpm_exceeded")
    assert 1 <= int(refused.header("Retry-After")) <= 61  # when the first leaves the window
    jobs = redis_conn().xlen(protocol.jobs_stream(standin.model))
    assert jobs == 2  # the refused request was never queued
    history = web.request("GET", "/v1/requests", key=key).json()["results"]
    assert len(history) == 2  # ...nor stored


def test_concurrency_slot_is_freed_by_the_web_when_the_daemon_dies(web, standin):
    tenant_id, key = make_tenant(web, max_concurrent=1)
    standin.serve(lambda daemon, job: daemon.accept(job))  # accepted, never finished
    held = chat(web, standin, key, stream=True)
    assert held.status == 200
    request_id = held.header("X-Request-Id")
    assert_429(chat(web, standin, key), "concurrency_limited")
    inflight = wire_limits.inflight_key(str(tenant_id))
    assert redis_conn().zscore(inflight, request_id) is not None
    standin.die()  # the web notices, writes inference_interrupted and frees the slot
    events = [data for _id, data in held.sse()]
    assert any("inference_interrupted" in e for e in events)
    wait_until(lambda: redis_conn().zscore(inflight, request_id) is None, timeout_s=10)
    other = StandIn(model=standin.model).start()
    try:
        other.serve(echo)
        assert chat(web, other, key).status == 200
    finally:
        other.stop()


def test_budget_refuses_until_raised(web, standin):
    tenant_id, key = make_tenant(web, monthly_token_budget=100)
    month_key = wire_limits.month_key(str(tenant_id), time.time())
    redis_conn().set(month_key, 100, ex=3600)  # as the daemon records it when requests end
    assert_429(chat(web, standin, key), "budget_exceeded")
    set_limits(web, tenant_id, monthly_token_budget=1000)
    # another process changed it (a shell, not the admin): the web trusts the key and its
    # tenant for KEY_CACHE_S (inference/auth.py), so the new budget applies within that
    # (the shell usually takes longer to start; on a fast run it did not, and got 429)
    time.sleep(auth.KEY_CACHE_S + 0.5)
    standin.serve(echo)
    assert chat(web, standin, key).status == 200
