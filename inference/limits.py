"""Per-tenant limits, checked when a request is queued (``service.enqueue``).

One Lua script decides and records an admission atomically in Redis, so several web
processes agree and no burst slips between a check and its increment. Usage is recorded
by the daemon when a request ends (``protocol.record_usage``, from actual token counts),
which also frees the request's concurrency slot; the web frees it itself when it closes a
request the daemon cannot (``service.close_row``) or when queueing fails.

Limits (``Tenant`` fields, NULL = unlimited), each a fixed UTC window:
- requests_per_minute     admitted requests this minute          -> 429 rate_limited
- tokens_per_minute       tokens of requests that ended this minute -> 429 rate_limited
- max_concurrent          requests queued or running now          -> 429 concurrency_limited
- monthly_token_budget    tokens of requests that ended this month  -> 429 budget_exceeded
Token limits are checked against usage already recorded: a request that starts under the
limit may take it over (by at most its own size); the next one is refused.
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass

from django.conf import settings

from accounts.models import ApiKey, Tenant
from inference import broker
from inference.api_errors import ApiError
from scheduler_daemon import protocol

RATE_LIMITED = "rate_limited"
CONCURRENCY_LIMITED = "concurrency_limited"
BUDGET_EXCEEDED = "budget_exceeded"
UNLIMITED = -1

# KEYS: inflight, rpm, tpm, month, refusals hash
# ARGV: now, request id, slot expiry, max_concurrent, rpm, tpm, budget, window ttl, slot ttl
_ADMIT = """
local now = tonumber(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local function refuse(code)
  redis.call('HINCRBY', KEYS[5], code, 1)
  return code
end
local budget = tonumber(ARGV[7])
if budget >= 0 and tonumber(redis.call('GET', KEYS[4]) or '0') >= budget then
  return refuse('budget_exceeded')
end
local tpm = tonumber(ARGV[6])
if tpm >= 0 and tonumber(redis.call('GET', KEYS[3]) or '0') >= tpm then
  return refuse('rate_limited')
end
local rpm = tonumber(ARGV[5])
if rpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= rpm then
  return refuse('rate_limited')
end
local concurrent = tonumber(ARGV[4])
if concurrent >= 0 and redis.call('ZCARD', KEYS[1]) >= concurrent then
  return refuse('concurrency_limited')
end
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[9])
return 'ok'
"""


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    monthly_token_budget: int | None = None

    @classmethod
    def for_tenant(cls, tenant_id: int) -> Limits:
        """Read fresh from the database: a raised limit applies to the very next request
        (a websocket's key, and its tenant, are loaded once per connection)."""
        row = Tenant.objects.filter(pk=tenant_id).values(*FIELDS).first() or {}
        return cls(**row)


FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget")


def slot_ttl_s() -> int:
    """How long a request may hold a concurrency slot before it is presumed lost."""
    return int(settings.ACCEPT_TIMEOUT_S + settings.REQUEST_TIMEOUT_S + settings.LIMIT_SLOT_GRACE_S)


def admit_tenant_sync(tenant_id: int, request_id: str) -> None:
    """``admit_sync`` with the tenant's limits as the database has them now."""
    admit_sync(tenant_id, request_id, Limits.for_tenant(tenant_id))


FRESH_KEY_S = 1.0  # a key (and its tenant) loaded this recently counts as read now


def admit_key_sync(api_key: ApiKey, request_id: str) -> None:
    """``admit_sync`` for a request made with ``api_key``: the tenant's limits as loaded with
    the key if that was at most FRESH_KEY_S ago (a REST request authenticates every time),
    else as the database has them now (a websocket keeps its key for the connection)."""
    loaded_at = getattr(api_key, "loaded_at", None)
    if loaded_at is not None and time.monotonic() - loaded_at <= FRESH_KEY_S:
        tenant = api_key.tenant
        admit_sync(tenant.pk, request_id, Limits(**{f: getattr(tenant, f) for f in FIELDS}))
    else:
        admit_tenant_sync(api_key.tenant_id, request_id)


def admit_sync(
    tenant_id: int | str, request_id: str, limits: Limits, now: float | None = None
) -> None:
    """Take a slot for ``request_id`` or raise ApiError 429 (with Retry-After)."""
    now = time.time() if now is None else now
    tenant = str(tenant_id)
    minute = int(now // 60)
    keys = [
        protocol.inflight_key(tenant),
        protocol.rpm_key(tenant, minute),
        protocol.tpm_key(tenant, minute),
        protocol.usage_keys(tenant, now)[1],
        protocol.LIMIT_REFUSALS_HASH,
    ]
    ttl = slot_ttl_s()
    args = [
        repr(now),
        request_id,
        repr(now + ttl),
        _arg(limits.max_concurrent),
        _arg(limits.requests_per_minute),
        _arg(limits.tokens_per_minute),
        _arg(limits.monthly_token_budget),
        protocol.LIMIT_WINDOW_TTL_S,
        ttl,
    ]
    result = broker.sync_client().eval(_ADMIT, len(keys), *keys, *args)
    code = result.decode() if isinstance(result, bytes) else str(result)
    if code != "ok":
        raise refusal(code, limits, now)


def release_sync(tenant_id: int | str, request_id: str) -> None:
    """Free a request's concurrency slot (idempotent)."""
    broker.sync_client().zrem(protocol.inflight_key(str(tenant_id)), request_id)


def refusal(code: str, limits: Limits, now: float) -> ApiError:
    """The 429 for a refusal code, with Retry-After: the next window (minute or month)."""
    if code == BUDGET_EXCEEDED:
        retry = _seconds_to_next_month(now)
        message = (
            f"This tenant has used its monthly budget of {limits.monthly_token_budget} tokens."
        )
    elif code == CONCURRENCY_LIMITED:
        retry = 1
        message = (
            f"This tenant already has {limits.max_concurrent} requests queued or running; "
            "wait for one to finish."
        )
    else:
        retry = max(1, math.ceil(60 - now % 60))
        message = (
            "This tenant is over its rate limit "
            f"({_describe_rate(limits)}); try again in {retry} s."
        )
    return ApiError(429, message, code, headers={"Retry-After": str(retry)})


def current_usage_sync(tenant_id: int | str, now: float | None = None) -> dict[str, int]:
    """The tenant's counters as the limits see them (for the usage API and the admin)."""
    now = time.time() if now is None else now
    tenant = str(tenant_id)
    minute = int(now // 60)
    client = broker.sync_client()
    rpm, tpm, month = client.mget(
        [
            protocol.rpm_key(tenant, minute),
            protocol.tpm_key(tenant, minute),
            protocol.usage_keys(tenant, now)[1],
        ]
    )
    inflight_key = protocol.inflight_key(tenant)
    return {
        "requests_this_minute": int(rpm or 0),
        "tokens_this_minute": int(tpm or 0),
        "tokens_this_month": int(month or 0),
        "concurrent": int(client.zcount(inflight_key, f"({now!r}", "+inf")),
    }


def refusal_counts_sync() -> dict[str, int]:
    """Refusals by code since the counters began (all web processes)."""
    raw = broker.sync_client().hgetall(protocol.LIMIT_REFUSALS_HASH)
    return {_text(k): int(v) for k, v in raw.items()}


def _describe_rate(limits: Limits) -> str:
    parts = []
    if limits.requests_per_minute is not None:
        parts.append(f"{limits.requests_per_minute} requests per minute")
    if limits.tokens_per_minute is not None:
        parts.append(f"{limits.tokens_per_minute} tokens per minute")
    return ", ".join(parts)


def _seconds_to_next_month(now: float) -> int:
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return max(1, math.ceil(calendar.timegm((year, month, 1, 0, 0, 0)) - now))


def _arg(limit: int | None) -> int:
    return UNLIMITED if limit is None else int(limit)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
