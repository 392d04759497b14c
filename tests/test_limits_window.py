"""The limits' sliding windows and their all-or-nothing admission (issue 13), against the
real test Redis. Time is driven through the script's ``now``, never the wall clock:

- no burst gets twice a per-minute limit across a minute boundary (the fixed UTC windows
  this replaced admitted a full limit at 12:00:59 and another at 12:01:00);
- in ANY 60 s, at most the limit is admitted, and a refusal is justified by the last 61 s;
- Retry-After is when the request would be admitted (refused a second earlier);
- a refused admission counts nothing: every limit key is as it was (but the refusal count).
"""

from __future__ import annotations

import random
import uuid

import pytest

from inference import limits
from inference.errors import ApiError
from wire import errors
from wire import limits as wire_limits

MINUTE_END = 1_800_000_000 - 0.5  # 0.5 s before a UTC minute begins (1.8e9 is one)


def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def admit(tenant: str, lim: limits.Limits, now: float, reserve: int = 0,
          request_id: str | None = None) -> ApiError | None:
    try:
        limits.admit_sync(tenant, request_id or uuid.uuid4().hex, lim, now=now, reserve=reserve)
    except ApiError as error:
        assert error.status == errors.status_of(error.code) == 429
        return error
    return None


def code(outcome: ApiError | None) -> str | None:
    return None if outcome is None else outcome.code


def end(redis_client, tenant: str, request_id: str, tokens: int, now: float) -> None:
    """The daemon's end of a request (what its writer queues with the terminal event)."""
    pipe = redis_client.pipeline(transaction=False)
    wire_limits.record_usage(pipe, tenant, request_id, tokens, now)
    pipe.execute()


# -- no double burst at a minute boundary ------------------------------------------------------


def test_requests_per_minute_no_second_burst_across_the_boundary():
    assert MINUTE_END % 60 == 59.5
    t, lim = tenant_id(), limits.Limits(requests_per_minute=10)
    assert [code(admit(t, lim, MINUTE_END)) for _ in range(10)] == [None] * 10
    after = MINUTE_END + 1  # a new UTC minute
    assert [code(admit(t, lim, after)) for _ in range(10)] == ["rpm_exceeded"] * 10
    assert code(admit(t, lim, MINUTE_END + 60)) == "rpm_exceeded"
    assert code(admit(t, lim, MINUTE_END + 61)) is None


def test_tokens_per_minute_no_second_burst_across_the_boundary(redis_client):
    t, lim = tenant_id(), limits.Limits(tokens_per_minute=1000)
    for i in range(10):  # 10 requests end using 100 tokens each just before the minute turns
        assert admit(t, lim, MINUTE_END, reserve=100, request_id=f"r{i}") is None
        end(redis_client, t, f"r{i}", 100, MINUTE_END)
    refused = admit(t, lim, MINUTE_END + 1, reserve=100)
    assert code(refused) == "tpm_exceeded"
    assert "1000 tokens in the last minute" in refused.message
    assert refused.param is None  # all used: a smaller max_tokens would not fit either
    assert limits.current_usage_sync(t, now=MINUTE_END + 1)["tokens_this_minute"] == 1000
    assert admit(t, lim, MINUTE_END + 61, reserve=100) is None


# -- the window holds at every instant -----------------------------------------------------------


def test_no_60_seconds_ever_admit_more_than_the_limit_and_every_refusal_is_due():
    rng = random.Random(13)
    t, rpm = tenant_id(), 7
    lim = limits.Limits(requests_per_minute=rpm)
    times = sorted(MINUTE_END + rng.uniform(0, 300) for _ in range(120))
    admitted, refused = [], []
    for now in times:
        (admitted if admit(t, lim, now) is None else refused).append(now)
    for start in admitted:  # any 60 s starting at an admission (the worst case)
        assert sum(start <= a < start + 60 for a in admitted) <= rpm
    for now in refused:  # refused only when the last 61 s already hold the limit
        assert sum(now - 61 < a <= now for a in admitted) >= rpm
    assert len(admitted) >= rpm * 4  # 300 s: the limit is a rate, not a ban


def test_tokens_in_any_60_seconds_stay_within_the_limit(redis_client):
    rng = random.Random(7)
    t, tpm = tenant_id(), 500
    lim = limits.Limits(tokens_per_minute=tpm)
    charges = []  # (end time, tokens)
    now = MINUTE_END
    for i in range(150):
        now += rng.uniform(0, 2)
        reserve = rng.randint(20, 120)
        if admit(t, lim, now, reserve=reserve, request_id=f"r{i}") is None:
            used = rng.randint(1, reserve)
            end(redis_client, t, f"r{i}", used, now + 0.3)
            charges.append((now + 0.3, used))
    for start, _ in charges:
        assert sum(n for at, n in charges if start <= at < start + 60) <= tpm
    assert sum(n for _, n in charges) > 2 * tpm  # ~300 s: the limit let tokens through


# -- Retry-After: when the request would be admitted ---------------------------------------------


def test_rpm_retry_after_is_when_it_would_be_admitted():
    t, lim = tenant_id(), limits.Limits(requests_per_minute=3)
    for offset in (0, 10, 20):
        assert admit(t, lim, MINUTE_END + offset) is None
    now = MINUTE_END + 30.2
    retry = _retry(admit(t, lim, now))  # the one at +0 leaves the window first
    assert 1 <= retry <= 31
    assert code(admit(t, lim, now + retry - 1)) == "rpm_exceeded"
    assert admit(t, lim, now + retry) is None


def test_tpm_retry_after_is_when_it_would_be_admitted(redis_client):
    t, lim = tenant_id(), limits.Limits(tokens_per_minute=300)
    for i, offset in enumerate((0, 15, 30)):
        assert admit(t, lim, MINUTE_END + offset, reserve=100, request_id=f"r{i}") is None
        end(redis_client, t, f"r{i}", 100, MINUTE_END + offset)
    now = MINUTE_END + 40.7
    retry = _retry(admit(t, lim, now, reserve=150))  # 300 used: two must leave the window
    assert 15 < retry <= 36
    assert code(admit(t, lim, now + retry - 1, reserve=150)) == "tpm_exceeded"
    assert admit(t, lim, now + retry, reserve=150) is None


def test_the_refusal_names_the_limit_that_keeps_the_request_out_longest():
    t = tenant_id()
    lim = limits.Limits(requests_per_minute=1, max_concurrent=1, monthly_token_budget=100)
    assert admit(t, lim, MINUTE_END, reserve=60) is None  # in flight, holding 60 tokens
    # all over: the budget held by it (1 s), its slot (1 s), requests per minute (56 s)
    refused = admit(t, lim, MINUTE_END + 5, reserve=60)
    assert code(refused) == "rpm_exceeded" and _retry(refused) == 56


def _retry(error: ApiError | None) -> int:
    assert error is not None
    assert error.body()["error"]["retry_after_s"] == int(error.headers["Retry-After"])
    return int(error.headers["Retry-After"])


# -- all or nothing ------------------------------------------------------------------------------


def snapshot(redis_client, tenant: str, now: float) -> dict:
    return {
        "inflight": redis_client.zrange(wire_limits.inflight_key(tenant), 0, -1, withscores=True),
        "reserved": redis_client.hgetall(wire_limits.reserved_key(tenant)),
        "rpm": redis_client.hgetall(wire_limits.rpm_key(tenant)),
        "tpm": redis_client.hgetall(wire_limits.tpm_key(tenant)),
        "month": redis_client.get(wire_limits.month_key(tenant, now)),
    }


@pytest.mark.parametrize("refusing", [
    "budget_exceeded", "tpm_exceeded", "rpm_exceeded", "concurrency_limited"])
def test_a_refused_admission_counts_nothing(redis_client, refusing):
    """Every limit set, one of them refusing (each in turn): the admission changes no limit
    key, so the refused request takes no request, token or slot from the next ones."""
    t, now = tenant_id(), MINUTE_END
    lim = limits.Limits(requests_per_minute=100, tokens_per_minute=1000, max_concurrent=3,
                        monthly_token_budget=10_000)
    assert admit(t, lim, now, reserve=50, request_id="first") is None
    end(redis_client, t, "first", 40, now)
    assert admit(t, lim, now, reserve=50, request_id="running") is None
    tight = {
        "budget_exceeded": limits.Limits(**{**_fields(lim), "monthly_token_budget": 100}),
        "tpm_exceeded": limits.Limits(**{**_fields(lim), "tokens_per_minute": 100}),
        "rpm_exceeded": limits.Limits(**{**_fields(lim), "requests_per_minute": 2}),
        "concurrency_limited": limits.Limits(**{**_fields(lim), "max_concurrent": 1}),
    }[refusing]
    before = snapshot(redis_client, t, now)
    counted = limits.refusal_counts_sync().get(refusing, 0)
    for _ in range(5):
        assert code(admit(t, tight, now + 1, reserve=50)) == refusing
    assert snapshot(redis_client, t, now) == before
    assert limits.refusal_counts_sync()[refusing] == counted + 5
    # ...and the next admission under the roomy limits is judged as if they never came
    assert admit(t, lim, now + 1, reserve=50) is None
    assert limits.current_usage_sync(t, now=now + 1) == {
        "requests_this_minute": 3, "tokens_this_minute": 40, "tokens_this_month": 40,
        "concurrent": 2}


def test_refusal_codes_come_from_the_error_table():
    for refusal_code in wire_limits.REFUSAL_CODES:
        entry = errors.CODES[refusal_code]
        assert (entry.status, entry.type) == (429, errors.RATE_LIMIT)


def _fields(lim: limits.Limits) -> dict:
    return {f: getattr(lim, f) for f in limits.FIELDS}
