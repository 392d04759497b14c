"""Tenant limits against the real test Redis: each limit under and over, the admission
script's atomicity under concurrent bursts, slot release and expiry, the monthly budget.
(The sliding windows and the all-or-nothing admission: tests/test_limits_window.py.)

Each test uses its own tenant id (unique keys), so nothing here needs a flush."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from accounts.models import Tenant
from inference import limits
from inference.errors import ApiError
from wire import errors
from wire import limits as wire_limits

# A whole second, mid-minute (the windows slide: the minute no longer matters).
NOW = (time.time() // 60) * 60 + 20


def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def admit(tenant: str, lim: limits.Limits, now: float = NOW) -> str | None:
    """The refusal code, or None when admitted."""
    try:
        limits.admit_sync(tenant, uuid.uuid4().hex, lim, now=now)
    except ApiError as error:
        assert error.status == 429
        assert int(error.headers["Retry-After"]) >= 1
        assert error.body()["error"]["type"] == errors.CODES[error.code].type == "rate_limit_error"
        assert error.body()["error"]["retry_after_s"] == int(error.headers["Retry-After"])
        return error.code
    return None


def record(redis_client, tenant: str, request_id: str, tokens: int, now: float = NOW) -> None:
    pipe = redis_client.pipeline(transaction=False)
    wire_limits.record_usage(pipe, tenant, request_id, tokens, now)
    pipe.execute()


def test_unlimited_admits_everything():
    t = tenant_id()
    assert [admit(t, limits.Limits()) for _ in range(30)] == [None] * 30


def test_requests_per_minute_then_a_minute_later_admits_again():
    t, lim = tenant_id(), limits.Limits(requests_per_minute=3)
    assert [admit(t, lim) for _ in range(4)] == [None, None, None, "rpm_exceeded"]
    assert admit(t, lim, now=NOW + 60) == "rpm_exceeded"  # a request counts 60 to 61 s
    assert admit(t, lim, now=NOW + 61) is None


def test_rpm_retry_after_is_when_the_oldest_request_leaves_the_window():
    t, lim = tenant_id(), limits.Limits(requests_per_minute=1)
    assert admit(t, lim) is None
    with pytest.raises(ApiError) as caught:
        limits.admit_sync(t, "r", lim, now=NOW + 20.5)
    assert caught.value.code == "rpm_exceeded" and caught.value.headers["Retry-After"] == "41"
    assert "1 requests in the last minute" in caught.value.message


def test_zero_requests_per_minute_never_admits():
    t = tenant_id()
    assert admit(t, limits.Limits(requests_per_minute=0)) == "rpm_exceeded"
    assert admit(t, limits.Limits(requests_per_minute=0), now=NOW + 3600) == "rpm_exceeded"


def test_tokens_per_minute_counts_recorded_usage(redis_client):
    t, lim = tenant_id(), limits.Limits(tokens_per_minute=100)
    assert admit(t, lim) is None
    record(redis_client, t, "r1", 99)
    assert admit(t, lim) is None
    record(redis_client, t, "r2", 1)
    assert admit(t, lim) == "tpm_exceeded"
    assert admit(t, lim, now=NOW + 60) == "tpm_exceeded"  # still in the last minute
    assert admit(t, lim, now=NOW + 61) is None


def test_max_concurrent_and_release(redis_client):
    t, lim = tenant_id(), limits.Limits(max_concurrent=2)
    limits.admit_sync(t, "a", lim, now=NOW)
    limits.admit_sync(t, "b", lim, now=NOW)
    assert admit(t, lim) == "concurrency_limited"
    record(redis_client, t, "a", 10)  # the daemon's terminal event frees a's slot
    assert admit(t, lim) is None
    assert admit(t, lim) == "concurrency_limited"
    limits.release_sync(t, "b")  # the web's own release (interrupted, failed enqueue)
    assert admit(t, lim) is None


def test_a_lost_slot_expires():
    t, lim = tenant_id(), limits.Limits(max_concurrent=1)
    limits.admit_sync(t, "lost", lim, now=NOW)
    assert admit(t, lim) == "concurrency_limited"
    assert admit(t, lim, now=NOW + limits.slot_ttl_s() + 1) is None


@pytest.mark.django_db
def test_monthly_budget_refuses_until_raised(redis_client):
    tenant = Tenant.objects.create(
        slug=f"budget-{uuid.uuid4().hex[:6]}", name="B", monthly_token_budget=1000
    )
    t = str(tenant.id)
    record(redis_client, t, "r1", 1000)
    with pytest.raises(ApiError) as caught:
        limits.admit_sync(t, "r2", limits.tenant_limits(tenant.id), now=NOW)
    assert caught.value.code == "budget_exceeded"
    assert int(caught.value.headers["Retry-After"]) > 60  # the next month
    Tenant.objects.filter(pk=tenant.id).update(monthly_token_budget=2000)
    limits.admit_sync(t, "r3", limits.tenant_limits(tenant.id), now=NOW)
    assert limits.current_usage_sync(t, now=NOW)["tokens_this_month"] == 1000


def test_refusals_are_counted_for_metrics():
    before = limits.refusal_counts_sync().get("concurrency_limited", 0)
    t, lim = tenant_id(), limits.Limits(max_concurrent=0)
    assert admit(t, lim) == "concurrency_limited"
    assert limits.refusal_counts_sync()["concurrency_limited"] == before + 1


@pytest.mark.parametrize(
    "lim, expected",
    [
        (limits.Limits(max_concurrent=7), 7),
        (limits.Limits(requests_per_minute=11), 11),
    ],
)
def test_two_concurrent_bursts_never_exceed_a_limit_together(lim, expected):
    t = tenant_id()
    admitted = []
    start = threading.Barrier(2)

    def burst() -> None:
        start.wait()
        for _ in range(20):
            if admit(t, lim) is None:
                admitted.append(1)

    threads = [threading.Thread(target=burst) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == expected


def _burst_in_a_process(tenant: str, lim: limits.Limits, start, results) -> None:
    start.wait()
    results.put(sum(admit(tenant, lim) is None for _ in range(20)))


def test_two_processes_bursting_admit_exactly_the_limit():
    """As two web processes would: separate interpreters, separate Redis connections."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    t, lim = tenant_id(), limits.Limits(max_concurrent=9)
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_burst_in_a_process, args=(t, lim, start, results))
             for _ in range(2)]
    for proc in procs:
        proc.start()
    counts = [results.get(timeout=30) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
    assert sum(counts) == 9


@pytest.mark.django_db
def test_a_key_just_loaded_brings_its_tenants_limits_and_an_old_one_reads_them_again():
    from accounts.authentication import authenticate_key
    from accounts.models import ApiKey

    tenant = Tenant.objects.create(name="fresh", slug=f"fresh-{uuid.uuid4().hex[:8]}",
                                   max_concurrent=1)
    _, raw = ApiKey.issue(tenant, "k")
    api_key = authenticate_key(raw)
    limits.admit_key_sync(api_key, uuid.uuid4().hex)
    Tenant.objects.filter(pk=tenant.pk).update(max_concurrent=2)  # raised after the key loaded
    with pytest.raises(ApiError) as refused:  # a REST request: the limits it loaded with the key
        limits.admit_key_sync(api_key, uuid.uuid4().hex)
    assert refused.value.code == limits.CONCURRENCY_LIMITED
    api_key.loaded_at -= limits.FRESH_KEY_S + 1  # a websocket's key, loaded long ago
    limits.admit_key_sync(api_key, uuid.uuid4().hex)  # reads the raised limit
    with pytest.raises(ApiError):
        limits.admit_key_sync(api_key, uuid.uuid4().hex)
