"""Token limits reserved at admission (issue 12): concurrency cannot take a tenant past its
monthly budget or tokens per minute. Against the real test Redis and the admission's Lua
script; the daemon's side is played by ``wire.limits.record_usage`` (what the daemon's
writer queues at a request's end)."""
from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest
from channels.db import database_sync_to_async

from accounts.models import ApiKey, Tenant
from inference import limits, service
from inference.errors import ApiError
from inference.openai_request import CHAT, COMPLETION, parse_request
from tests.live_service import StandIn
from wire import limits as wire_limits

NOW = (time.time() // 60) * 60 + 20


def tenant_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def record(redis_client, tenant: str, request_id: str, tokens: int, now: float = NOW) -> None:
    pipe = redis_client.pipeline(transaction=False)
    wire_limits.record_usage(pipe, tenant, request_id, tokens, now)
    pipe.execute()


def admit(tenant: str, lim: limits.Limits, reserve: int, now: float = NOW,
          request_id: str | None = None) -> ApiError | None:
    try:
        limits.admit_sync(tenant, request_id or uuid.uuid4().hex, lim, now=now, reserve=reserve)
    except ApiError as error:
        return error
    return None


def month_used(redis_client, tenant: str, now: float = NOW) -> int:
    return int(redis_client.get(wire_limits.month_key(tenant, now)) or 0)


# -- the estimate ----------------------------------------------------------------------------


def test_reservation_is_prompt_bytes_plus_allowances_plus_max_tokens(settings):
    settings.DEFAULT_MAX_TOKENS = 100
    fixed, per_message = limits.TEMPLATE_TOKENS_FIXED, limits.TEMPLATE_TOKENS_PER_MESSAGE
    assert limits.reservation("héllo", None, 7) == fixed + 6 + 7  # UTF-8 bytes
    assert limits.reservation([1, 2, 3], None, None) == fixed + 3 + 100  # token ids; default
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert limits.reservation(None, messages, 5) == (
        fixed + 2 * per_message + len("system") + len("Be brief.") + len("user") + 2 + 5)
    assert limits.reservation("\ud800", None, 1) == fixed + 3 + 1  # never raises
    assert limits.reservation("héllo", None, 7, n=3) == fixed + 6 + 3 * 7  # n choices
    # an embeddings request's inputs: texts by their bytes, token lists by their length
    assert limits.reservation(["ab", [1, 2, 3]], None, 0) == fixed + 2 + 3


# -- concurrency cannot overshoot ------------------------------------------------------------


@pytest.mark.parametrize("field", ["monthly_token_budget", "tokens_per_minute"])
def test_eight_concurrent_admissions_never_reserve_past_the_limit(redis_client, field):
    """Budget 1000 with 950 used: 50 left. Eight threads each want a request that may use
    28 tokens; before reservations all eight were admitted (and used 8 x 28)."""
    t = tenant_id()
    record(redis_client, t, "earlier", 950)  # charged to the minute and the month
    lim = limits.Limits(**{field: 1000})
    reserve = limits.reservation("hi", None, 10)
    assert 25 < reserve <= 50
    admitted: list[str] = []
    start = threading.Barrier(8)

    def one() -> None:
        request_id = uuid.uuid4().hex
        start.wait()
        if admit(t, lim, reserve, request_id=request_id) is None:
            admitted.append(request_id)

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 1  # 50 left, each may take 28
    for request_id in admitted:  # they end, each using all it reserved
        record(redis_client, t, request_id, reserve)
    usage = limits.current_usage_sync(t, now=NOW)
    assert usage["tokens_this_month"] == usage["tokens_this_minute"] == 950 + reserve <= 1000


def test_a_reservation_is_replaced_by_actual_usage_at_the_end(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100)
    assert admit(t, lim, 60, request_id="a") is None
    held = admit(t, lim, 60)
    assert held is not None and held.code == "budget_exceeded"
    assert held.headers["Retry-After"] == "1"  # in flight holds it: worth retrying soon
    record(redis_client, t, "a", 20)  # a used 20 of its 60
    assert month_used(redis_client, t) == 20
    assert admit(t, lim, 60, request_id="b") is None  # 20 used + 60 fits in 100
    assert redis_client.hget(wire_limits.reserved_key(t), "a") is None


def test_a_request_larger_than_what_is_left_is_refused_until_next_month(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100)
    record(redis_client, t, "old", 90)
    error = admit(t, lim, 30)
    assert error is not None and error.code == "budget_exceeded"
    assert int(error.headers["Retry-After"]) > 60  # the next month
    assert error.param == "max_tokens" and "10 tokens left" in error.message
    assert admit(t, lim, 10) is None  # a smaller max_tokens fits


def test_a_request_larger_than_the_whole_limit_says_so():
    t = tenant_id()
    error = admit(t, limits.Limits(tokens_per_minute=50), 51)
    assert error is not None and error.code == "tpm_exceeded" and error.param == "max_tokens"
    error = admit(t, limits.Limits(monthly_token_budget=50), 51)
    assert error is not None and error.code == "budget_exceeded"


def test_web_release_drops_the_reservation(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100)
    assert admit(t, lim, 80, request_id="a") is None
    assert admit(t, lim, 80) is not None
    limits.release_sync(t, "a")  # the web closes a request the daemon cannot
    assert admit(t, lim, 80) is None
    assert month_used(redis_client, t) == 0


def test_a_lost_reservation_expires_with_its_slot(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100)
    assert admit(t, lim, 80, request_id="lost") is None
    assert admit(t, lim, 80) is not None
    later = NOW + limits.slot_ttl_s() + 1
    assert admit(t, lim, 80, now=later) is None
    assert redis_client.hget(wire_limits.reserved_key(t), "lost") is None


def test_a_reservation_without_its_slot_counts_for_nothing(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100)
    redis_client.hset(wire_limits.reserved_key(t), "orphan", 90)
    assert admit(t, lim, 80) is None
    assert redis_client.hget(wire_limits.reserved_key(t), "orphan") is None


def test_no_token_limit_reserves_nothing(redis_client):
    t = tenant_id()
    assert admit(t, limits.Limits(max_concurrent=5), 10_000, request_id="a") is None
    assert not redis_client.exists(wire_limits.reserved_key(t))


def test_record_usage_keeps_its_signature_and_is_idempotent_for_the_slot(redis_client):
    t, lim = tenant_id(), limits.Limits(monthly_token_budget=100, max_concurrent=1)
    assert admit(t, lim, 50, request_id="a") is None
    record(redis_client, t, "a", 30)
    record(redis_client, t, "a", 0)  # a second end (e.g. a reclaim) frees nothing more
    assert month_used(redis_client, t) == 30
    assert admit(t, lim, 50) is None


# -- through service.enqueue: the issue's case --------------------------------------------------


@database_sync_to_async
def _tenant_with_budget(budget: int) -> ApiKey:
    tenant = Tenant.objects.create(slug=f"res-{uuid.uuid4().hex[:8]}", name="R",
                                   monthly_token_budget=budget)
    return ApiKey.issue(tenant, "k")[0]


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_eight_concurrent_requests_with_50_tokens_left_stay_within_the_budget(
        redis_client):
    """8 concurrent requests, 50 tokens of budget left: before, all eight were admitted and
    used 2,440 tokens. Each request here may use up to 16 + 2 + 10 = 28 tokens."""
    standin = StandIn().start()
    try:
        api_key = await _tenant_with_budget(1000)
        tenant = str(api_key.tenant_id)
        month_key = wire_limits.month_key(tenant, time.time())
        redis_client.set(month_key, 950, ex=3600)
        parsed = [parse_request(COMPLETION, {"model": standin.model, "prompt": "hi",
                                             "max_tokens": 10}) for _ in range(8)]
        results = await asyncio.gather(*(service.enqueue(api_key, p) for p in parsed),
                                       return_exceptions=True)
        queued = [r for r in results if isinstance(r, service.Queued)]
        refused = [r for r in results if isinstance(r, ApiError)]
        assert len(queued) + len(refused) == 8
        assert all(r.status == 429 and r.code == "budget_exceeded" for r in refused)
        for q in queued:  # the daemon ends each, using every token it may
            record(redis_client, tenant, q.request_id, 28, now=time.time())
        assert int(redis_client.get(month_key)) <= 1000
        assert len(queued) == 1
    finally:
        standin.stop()


@pytest.mark.django_db
def test_chat_reservation_comes_from_the_parsed_messages():
    parsed = parse_request(CHAT, {"messages": [{"role": "user", "content": "héllo"}],
                                  "max_tokens": 3})
    assert limits.reservation(parsed.prompt, parsed.messages, parsed.params.get("max_tokens")) \
        == limits.TEMPLATE_TOKENS_FIXED + limits.TEMPLATE_TOKENS_PER_MESSAGE + 4 + 6 + 3
