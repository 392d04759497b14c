"""An API key's own limits (issue 38): its requests and tokens per minute and its monthly
budget, checked in the same admission script run as its tenant's (wire/lua/admit.lua),
with reservations of the key's; the request's end (``wire.limits.record_usage``, what the
daemon's writer queues) charges the key and drops them; the web's rollback
(``release``) drops them too. Against the real test Redis."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from accounts.models import ApiKey, Tenant
from inference import limits
from inference.errors import ApiError
from wire import limits as wire_limits

NOW = (time.time() // 60) * 60 + 20
NO_TENANT_LIMITS = wire_limits.Limits()


def ids() -> tuple[str, str]:
    """A fresh (tenant id, key id): nothing of another test's counters."""
    return f"t-{uuid.uuid4().hex[:12]}", f"k-{uuid.uuid4().hex[:12]}"


def admit(redis_client, tenant: str, key: wire_limits.KeyLimits | None,
          lim: wire_limits.Limits = NO_TENANT_LIMITS, reserve: int = 0, now: float = NOW,
          request_id: str | None = None) -> wire_limits.Refused | None:
    return wire_limits.admit(redis_client, tenant, request_id or uuid.uuid4().hex, lim,
                             now=now, reserve=reserve, slot_ttl_s=600, key=key)


def end(redis_client, tenant: str, request_id: str, tokens: int, now: float = NOW) -> None:
    pipe = redis_client.pipeline(transaction=False)
    wire_limits.record_usage(pipe, tenant, request_id, tokens, now)
    pipe.execute()


def release(redis_client, tenant: str, request_id: str) -> None:
    pipe = redis_client.pipeline(transaction=False)
    wire_limits.release(pipe, tenant, request_id)
    pipe.execute()


def key_usage(redis_client, key_id: str, now: float = NOW) -> dict[str, int]:
    return wire_limits.current_key_usage(redis_client, key_id, now)


# -- the key's requests per minute -------------------------------------------------------------


def test_the_keys_requests_per_minute_refuse_its_requests_only(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, requests_per_minute=2)
    assert admit(redis_client, t, key) is None
    assert admit(redis_client, t, key, now=NOW + 5) is None
    refused = admit(redis_client, t, key, now=NOW + 10)
    assert refused is not None and refused.limit == wire_limits.KEY_RPM
    assert refused.code == "rpm_exceeded" and refused.how == wire_limits.OVER and refused.of_key
    assert refused.used == 2
    assert refused.retry_after_s == 51  # the first leaves the window at NOW + 61
    # the tenant's other key, and requests with no key, are not the key's
    assert admit(redis_client, t, wire_limits.KeyLimits(f"{k}-other")) is None
    assert admit(redis_client, t, None) is None
    assert key_usage(redis_client, k, NOW + 10)["requests_this_minute"] == 2
    assert wire_limits.current_usage(redis_client, t, NOW + 10)["requests_this_minute"] == 4
    assert admit(redis_client, t, key, now=NOW + 61) is None  # the first has left


def test_a_refusal_by_the_key_counts_nothing_but_the_refusal(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, requests_per_minute=0)
    refused = admit(redis_client, t, key, request_id="r")
    assert refused is not None and refused.limit == wire_limits.KEY_RPM
    assert refused.how == wire_limits.TOO_BIG
    assert redis_client.zscore(wire_limits.inflight_key(t), "r") is None
    assert wire_limits.current_usage(redis_client, t, NOW)["requests_this_minute"] == 0
    assert key_usage(redis_client, k)["requests_this_minute"] == 0
    assert wire_limits.refusal_counts(redis_client, t) == {"rpm_exceeded": 1}


# -- the key's tokens: windows and reservations ----------------------------------------------


def test_the_keys_reservations_hold_its_tokens_per_minute(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    assert admit(redis_client, t, key, reserve=40, request_id="a") is None
    assert admit(redis_client, t, key, reserve=40, request_id="b") is None
    held = admit(redis_client, t, key, reserve=40)
    assert held is not None and held.limit == wire_limits.KEY_TPM
    assert held.how == wire_limits.HELD and held.retry_after_s == 1 and held.reserved == 80
    # the tenant has no token limit: it reserves nothing of its own
    assert not redis_client.exists(wire_limits.reserved_key(t))
    end(redis_client, t, "a", 10)  # a used 10 of its 40: 10 charged + 40 held + 40 fits
    assert admit(redis_client, t, key, reserve=40, request_id="c") is None
    assert redis_client.hget(wire_limits.key_reserved_key(k), "a") is None
    assert key_usage(redis_client, k)["tokens_this_minute"] == 10


def test_tokens_charged_to_the_key_refuse_until_they_leave_the_window(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    assert admit(redis_client, t, key, reserve=90, request_id="a") is None
    end(redis_client, t, "a", 90, now=NOW + 3)
    refused = admit(redis_client, t, key, reserve=20, now=NOW + 10)
    assert refused is not None and refused.limit == wire_limits.KEY_TPM
    assert refused.how == wire_limits.OVER and refused.used == 90 and refused.reserved == 0
    assert refused.retry_after_s == 3 + 61 - 10  # the 90 leave the window at NOW + 64
    assert admit(redis_client, t, key, reserve=10, now=NOW + 10) is None  # 90 + 10 fits
    assert admit(redis_client, t, key, reserve=20, now=NOW + 64) is None


def test_a_request_larger_than_the_keys_limit_is_too_big(redis_client):
    t, k = ids()
    refused = admit(redis_client, t, wire_limits.KeyLimits(k, tokens_per_minute=50), reserve=51)
    assert refused is not None and refused.limit == wire_limits.KEY_TPM
    assert refused.how == wire_limits.TOO_BIG
    refused = admit(redis_client, t, wire_limits.KeyLimits(k, monthly_token_budget=50),
                    reserve=51)
    assert refused is not None and refused.limit == wire_limits.KEY_BUDGET
    assert refused.code == "budget_exceeded" and refused.how == wire_limits.TOO_BIG
    assert refused.retry_after_s == wire_limits.seconds_to_next_month(NOW)


def test_the_keys_monthly_budget(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, monthly_token_budget=100)
    assert admit(redis_client, t, key, reserve=60, request_id="a") is None
    held = admit(redis_client, t, key, reserve=60)
    assert held is not None and held.limit == wire_limits.KEY_BUDGET
    assert held.how == wire_limits.HELD and held.retry_after_s == 1
    end(redis_client, t, "a", 95)
    over = admit(redis_client, t, key, reserve=10)
    assert over is not None and over.limit == wire_limits.KEY_BUDGET
    assert over.how == wire_limits.OVER and over.used == 95
    assert over.retry_after_s == wire_limits.seconds_to_next_month(NOW)
    assert int(redis_client.get(wire_limits.key_month_key(k, NOW))) == 95
    assert key_usage(redis_client, k)["tokens_this_month"] == 95
    assert admit(redis_client, t, key, reserve=5) is None  # what is left fits


# -- the tenant's limits and the key's together ------------------------------------------------


def test_the_stricter_limit_refuses_the_tenants_or_the_keys(redis_client):
    t, k = ids()
    # the key's is stricter
    tenant = wire_limits.Limits(tokens_per_minute=1000)
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    assert admit(redis_client, t, key, tenant, reserve=80, request_id="a") is None
    refused = admit(redis_client, t, key, tenant, reserve=80)
    assert refused is not None and refused.limit == wire_limits.KEY_TPM
    # the tenant's is stricter (its reservations hold 80 of 150; the key's 80 of 1000)
    t2, k2 = ids()
    tenant = wire_limits.Limits(tokens_per_minute=150)
    key = wire_limits.KeyLimits(k2, tokens_per_minute=1000)
    assert admit(redis_client, t2, key, tenant, reserve=80) is None
    refused = admit(redis_client, t2, key, tenant, reserve=80)
    assert refused is not None and refused.limit == wire_limits.TPM and not refused.of_key
    # both refuse: the one that keeps it out longest is named (the key's month, not the
    # tenant's held tokens)
    t3, k3 = ids()
    tenant = wire_limits.Limits(tokens_per_minute=100)
    key = wire_limits.KeyLimits(k3, monthly_token_budget=100)
    assert admit(redis_client, t3, key, tenant, reserve=60, request_id="x") is None
    end(redis_client, t3, "x", 60)
    refused = admit(redis_client, t3, key, tenant, reserve=50, now=NOW + 1)
    assert refused is not None and refused.limit == wire_limits.KEY_BUDGET


def test_another_key_of_the_tenant_shares_the_tenants_limit_not_the_keys(redis_client):
    t, k = ids()
    tenant = wire_limits.Limits(tokens_per_minute=200)
    first = wire_limits.KeyLimits(k, tokens_per_minute=100)
    second = wire_limits.KeyLimits(f"{k}-2")
    assert admit(redis_client, t, first, tenant, reserve=100) is None
    assert admit(redis_client, t, first, tenant, reserve=1) is not None  # the key's is full
    assert admit(redis_client, t, second, tenant, reserve=100) is None  # the tenant's is not
    refused = admit(redis_client, t, second, tenant, reserve=1)
    assert refused is not None and refused.limit == wire_limits.TPM  # now the tenant's is


# -- the end and the rollback --------------------------------------------------------------------


def test_record_usage_charges_the_key_once_and_drops_its_reservation(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=1000, monthly_token_budget=10_000)
    assert admit(redis_client, t, key, reserve=300, request_id="a") is None
    assert redis_client.hget(wire_limits.key_of_key(t), "a") == k.encode()
    end(redis_client, t, "a", 120)
    end(redis_client, t, "a", 120)  # a second end (a reclaim) charges the key nothing
    usage = key_usage(redis_client, k)
    assert usage == {"requests_this_minute": 1, "tokens_this_minute": 120,
                     "tokens_this_month": 120}
    assert not redis_client.exists(wire_limits.key_reserved_key(k))
    assert redis_client.hget(wire_limits.key_of_key(t), "a") is None
    # a key without limits of its own is counted all the same (the console reads it)
    t2, k2 = ids()
    assert admit(redis_client, t2, wire_limits.KeyLimits(k2), reserve=50, request_id="b") is None
    assert not redis_client.exists(wire_limits.key_reserved_key(k2))
    end(redis_client, t2, "b", 7)
    assert key_usage(redis_client, k2)["tokens_this_month"] == 7


def test_the_webs_release_drops_the_keys_reservation_without_a_charge(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    assert admit(redis_client, t, key, reserve=80, request_id="a") is None
    assert admit(redis_client, t, key, reserve=80) is not None
    release(redis_client, t, "a")  # the web's rollback: the request never ran
    assert not redis_client.exists(wire_limits.key_reserved_key(k))
    assert redis_client.hget(wire_limits.key_of_key(t), "a") is None
    assert admit(redis_client, t, key, reserve=80) is None
    assert key_usage(redis_client, k)["tokens_this_minute"] == 0


def test_a_keys_reservation_never_outlives_its_requests_slot(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    assert admit(redis_client, t, key, reserve=80, request_id="lost") is None
    assert admit(redis_client, t, key, reserve=80) is not None
    # the slot lapses (a request whose end was never written): its reservation goes with it
    assert admit(redis_client, t, key, reserve=80, now=NOW + 601, request_id="n") is None
    assert redis_client.hget(wire_limits.key_reserved_key(k), "lost") is None
    assert redis_client.hget(wire_limits.key_of_key(t), "lost") is None
    # and a slot freed without the key's part (a writer of before) frees the key's too
    redis_client.zrem(wire_limits.inflight_key(t), "n")
    assert admit(redis_client, t, key, reserve=80, now=NOW + 602) is None
    assert redis_client.hget(wire_limits.key_reserved_key(k), "n") is None


def test_concurrent_admissions_never_reserve_past_the_keys_limit(redis_client):
    t, k = ids()
    key = wire_limits.KeyLimits(k, tokens_per_minute=100)
    admitted: list[str] = []
    start = threading.Barrier(12)

    def one() -> None:
        request_id = uuid.uuid4().hex
        client = redis_client.__class__(connection_pool=redis_client.connection_pool)
        start.wait()
        if admit(client, t, key, reserve=30, request_id=request_id) is None:
            admitted.append(request_id)

    threads = [threading.Thread(target=one) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 3  # 3 x 30 of 100
    for request_id in admitted:
        end(redis_client, t, request_id, 30)
    assert key_usage(redis_client, k)["tokens_this_minute"] == 90


# -- the web's side: the key's limits read with it, the refusal's message and Retry-After ----------


@pytest.mark.django_db
def test_the_web_admits_under_the_keys_own_limit_and_says_it_is_the_keys():
    tenant = Tenant.objects.create(slug=f"kl-{uuid.uuid4().hex[:8]}", name="K",
                                   tokens_per_minute=10_000)
    api_key = ApiKey.issue(tenant, "limited")[0]
    api_key.tokens_per_minute = 100
    api_key.requests_per_minute = 5
    api_key.save()
    api_key = ApiKey.objects.select_related("tenant").get(pk=api_key.pk)  # loaded now
    own = limits.own_limits(api_key)
    assert own == wire_limits.KeyLimits(str(api_key.pk), 5, 100, None)
    limits.admit_key_sync(api_key, "a", reserve=60)
    with pytest.raises(ApiError) as refused:
        limits.admit_key_sync(api_key, "b", reserve=60)
    error = refused.value
    assert error.status == 429 and error.code == "tpm_exceeded"
    assert error.headers["Retry-After"] == "1" and error.details["retry_after_s"] == 1
    assert "This API key" in error.message and "tenant" not in error.message
    limits.release_sync(tenant.id, "a")
    limits.admit_key_sync(api_key, "c", reserve=60)
    # a key loaded long ago (a websocket's) reads its limits again: a raised limit applies
    api_key.loaded_at = time.monotonic() - 10
    ApiKey.objects.filter(pk=api_key.pk).update(tokens_per_minute=1000)
    limits.admit_key_sync(api_key, "d", reserve=60)
    assert limits.admission_limits_sync(api_key)[1].tokens_per_minute == 1000


@pytest.mark.django_db
def test_the_keys_requests_per_minute_refusal_over_the_web():
    tenant = Tenant.objects.create(slug=f"kl-{uuid.uuid4().hex[:8]}", name="K")
    api_key = ApiKey.issue(tenant, "limited")[0]
    ApiKey.objects.filter(pk=api_key.pk).update(requests_per_minute=1)
    api_key = ApiKey.objects.select_related("tenant").get(pk=api_key.pk)
    limits.admit_key_sync(api_key, "a")
    with pytest.raises(ApiError) as refused:
        limits.admit_key_sync(api_key, "b")
    error = refused.value
    assert error.code == "rpm_exceeded" and 1 <= int(error.headers["Retry-After"]) <= 61
    assert error.message.startswith("This API key made 1 requests in the last minute")
    assert "replays" not in error.message
    assert limits.current_usage_sync(tenant.id)["requests_this_minute"] == 1
