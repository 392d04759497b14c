"""Per-tenant limits, checked when a request is queued (``service.enqueue``).

One Lua script decides and records an admission atomically in Redis, so several web
processes agree and no burst slips between a check and its increment. An admission
*reserves* the most tokens the request can use (``reservation``: an upper bound of its
prompt plus its ``max_tokens``) when the tenant has a token limit; the reservations of
requests in flight count against the limits like used tokens. When the request ends,
``protocol.record_usage`` (the daemon's writer, in the terminal event's pipeline) charges
the actual tokens and drops the reservation, and frees the concurrency slot; the web does
the same when it closes a request the daemon cannot (``service.close_row``) or when
queueing fails (``release_sync``). A reservation lives and dies with its in-flight entry:
it expires with it, so a lost one never blocks a tenant for good.

Limits (``Tenant`` fields, NULL = unlimited), each a fixed UTC window:
- requests_per_minute     admitted requests this minute              -> 429 rate_limited
- tokens_per_minute       tokens used this minute + reserved in flight -> 429 rate_limited
- max_concurrent          requests queued or running, and resumes, now -> 429 concurrency_limited
- monthly_token_budget    tokens used this month + reserved in flight -> 429 budget_exceeded
Concurrency cannot take a tenant past a token limit: a request is admitted only if its
reservation fits next to what is used and what the others in flight reserved.
"""

from __future__ import annotations

import asyncio
import calendar
import logging
import math
import time
import uuid
from dataclasses import dataclass

from django.conf import settings

from accounts.models import ApiKey, Tenant
from inference import broker
from inference.api_errors import ApiError
from wire import protocol

RATE_LIMITED = "rate_limited"
CONCURRENCY_LIMITED = "concurrency_limited"
BUDGET_EXCEEDED = "budget_exceeded"
UNLIMITED = -1
log = logging.getLogger(__name__)
# Refusal reasons the admission script returns (the 429's code, message and Retry-After
# follow from them; the refusals hash counts the public code).
_OVER_BUDGET = "budget_exceeded"  # used + this request's reservation > budget
_BUDGET_HELD = "budget_held"  # ...fits, but not next to the reservations in flight
_BUDGET_TOO_BIG = "budget_too_big"  # this request's reservation alone > budget
_OVER_TPM = "tpm_exceeded"
_TPM_HELD = "tpm_held"
_TPM_TOO_BIG = "tpm_too_big"
_OVER_RPM = "rpm_exceeded"
_PUBLIC_CODE = {
    _OVER_BUDGET: BUDGET_EXCEEDED, _BUDGET_HELD: BUDGET_EXCEEDED, _BUDGET_TOO_BIG: BUDGET_EXCEEDED,
    _OVER_TPM: RATE_LIMITED, _TPM_HELD: RATE_LIMITED, _TPM_TOO_BIG: RATE_LIMITED,
    _OVER_RPM: RATE_LIMITED, CONCURRENCY_LIMITED: CONCURRENCY_LIMITED,
}

# The prompt estimate's allowance for what a chat template adds around each message
# (turn markers, role line, newlines) and once (BOS, the generation prompt). The web does
# not tokenize: a token covers at least one UTF-8 byte of text (byte fallback), so bytes +
# allowances bound the prompt's tokens from above.
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_FIXED = 16

# Drops expired in-flight entries and their reservations, then sums what the tenant's
# requests in flight reserved (a reservation whose entry is gone is dropped too).
_LIVE_RESERVED = """
local now = tonumber(ARGV[1])
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #expired > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  for i = 1, #expired do redis.call('HDEL', KEYS[6], expired[i]) end
end
local reserved = 0
local held = redis.call('HGETALL', KEYS[6])
for i = 1, #held, 2 do
  if redis.call('ZSCORE', KEYS[1], held[i]) then
    reserved = reserved + tonumber(held[i + 1])
  else
    redis.call('HDEL', KEYS[6], held[i])
  end
end
"""

# KEYS: inflight, rpm, tpm, month, refusals hash, reservations hash
# ARGV: now, request id, slot expiry, max_concurrent, rpm, tpm, budget, window ttl, slot ttl,
#       tokens to reserve
_ADMIT = _LIVE_RESERVED + """
local want = tonumber(ARGV[10])
local function refuse(reason, code, used)
  redis.call('HINCRBY', KEYS[5], code, 1)
  return reason .. ':' .. used .. ':' .. reserved
end
local function over(limit, used, too_big, exceeded, held, code)
  if limit < 0 then return nil end
  if used >= limit then return refuse(exceeded, code, used) end
  if want > limit then return refuse(too_big, code, used) end
  if used + want > limit then return refuse(exceeded, code, used) end
  if used + reserved >= limit or used + reserved + want > limit then
    return refuse(held, code, used)
  end
  return nil
end
local refused = over(tonumber(ARGV[7]), tonumber(redis.call('GET', KEYS[4]) or '0'),
  'budget_too_big', 'budget_exceeded', 'budget_held', 'budget_exceeded')
if refused then return refused end
refused = over(tonumber(ARGV[6]), tonumber(redis.call('GET', KEYS[3]) or '0'),
  'tpm_too_big', 'tpm_exceeded', 'tpm_held', 'rate_limited')
if refused then return refused end
local rpm = tonumber(ARGV[5])
if rpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= rpm then
  return refuse('rpm_exceeded', 'rate_limited', 0)
end
local concurrent = tonumber(ARGV[4])
if concurrent >= 0 and redis.call('ZCARD', KEYS[1]) >= concurrent then
  return refuse('concurrency_limited', 'concurrency_limited', 0)
end
redis.call('INCR', KEYS[2])
redis.call('EXPIRE', KEYS[2], ARGV[8])
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[9])
if want > 0 then
  redis.call('HSET', KEYS[6], ARGV[2], want)
  redis.call('EXPIRE', KEYS[6], ARGV[9])
end
return 'ok'
"""

# A slot without tokens (a resume): only the concurrency limit.
# KEYS: inflight, refusals hash; ARGV: now, member, expiry, max_concurrent, slot ttl
_TAKE_SLOT = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]))
local concurrent = tonumber(ARGV[4])
if concurrent >= 0 and redis.call('ZCARD', KEYS[1]) >= concurrent then
  redis.call('HINCRBY', KEYS[2], 'concurrency_limited', 1)
  return 'concurrency_limited'
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[5])
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


def admit_tenant_sync(tenant_id: int, request_id: str, reserve: int = 0) -> None:
    """``admit_sync`` with the tenant's limits as the database has them now."""
    admit_sync(tenant_id, request_id, Limits.for_tenant(tenant_id), reserve=reserve)


FRESH_KEY_S = 1.0  # a key (and its tenant) loaded this recently counts as read now


def key_limits_sync(api_key: ApiKey) -> Limits:
    """The tenant's limits as loaded with ``api_key`` if that was at most FRESH_KEY_S ago (a
    REST request authenticates every time), else as the database has them now (a
    websocket keeps its key for the connection)."""
    loaded_at = getattr(api_key, "loaded_at", None)
    if loaded_at is not None and time.monotonic() - loaded_at <= FRESH_KEY_S:
        tenant = api_key.tenant
        return Limits(**{f: getattr(tenant, f) for f in FIELDS})
    return Limits.for_tenant(api_key.tenant_id)


def admit_key_sync(api_key: ApiKey, request_id: str, reserve: int = 0) -> None:
    """``admit_sync`` for a request made with ``api_key`` (limits: ``key_limits_sync``)."""
    admit_sync(api_key.tenant_id, request_id, key_limits_sync(api_key), reserve=reserve)


def reservation(prompt: str | list[int] | None, messages: list[dict[str, str]] | None,
                max_tokens: int | None) -> int:
    """The most tokens a request can use: an upper bound of its prompt's tokens (UTF-8
    bytes of its text, plus the template's allowances; token ids count one each) plus its
    ``max_tokens`` (``DEFAULT_MAX_TOKENS`` when it names none)."""
    estimate = TEMPLATE_TOKENS_FIXED
    if messages is not None:
        for message in messages:
            estimate += TEMPLATE_TOKENS_PER_MESSAGE + _utf8_len(message.get("role", ""))
            estimate += _utf8_len(message.get("content", ""))
    elif isinstance(prompt, list):
        estimate += len(prompt)
    elif prompt is not None:
        estimate += _utf8_len(prompt)
    completion = max_tokens if max_tokens is not None else settings.DEFAULT_MAX_TOKENS
    return estimate + int(completion)


def _utf8_len(text: object) -> int:
    # surrogatepass: a lone surrogate (refused elsewhere) is 3 bytes, never an error here
    return len(str(text).encode("utf-8", "surrogatepass"))


def admit_sync(
    tenant_id: int | str, request_id: str, limits: Limits, now: float | None = None,
    reserve: int = 0,
) -> None:
    """Take a slot for ``request_id`` or raise ApiError 429 (with Retry-After). With a
    token limit, ``reserve`` tokens are held for the request until it ends (its actual
    usage replaces them: ``protocol.record_usage``)."""
    now = time.time() if now is None else now
    tenant = str(tenant_id)
    minute = int(now // 60)
    keys = [
        protocol.inflight_key(tenant),
        protocol.rpm_key(tenant, minute),
        protocol.tpm_key(tenant, minute),
        protocol.usage_keys(tenant, now)[1],
        protocol.LIMIT_REFUSALS_HASH,
        protocol.reserved_key(tenant),
    ]
    token_limited = limits.tokens_per_minute is not None or limits.monthly_token_budget is not None
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
        max(0, int(reserve)) if token_limited else 0,
    ]
    result = _text(broker.sync_client().eval(_ADMIT, len(keys), *keys, *args))
    if result != "ok":
        raise refusal(result, limits, now, reserve)


def release_sync(tenant_id: int | str, request_id: str) -> None:
    """Free a request's concurrency slot and drop its token reservation (idempotent)."""
    tenant = str(tenant_id)
    pipe = broker.sync_client().pipeline(transaction=False)
    pipe.hdel(protocol.reserved_key(tenant), request_id)
    pipe.zrem(protocol.inflight_key(tenant), request_id)
    pipe.execute()


RESUME_SLOT_PREFIX = "resume:"


def take_resume_slot_sync(api_key: ApiKey, ttl_s: float, now: float | None = None) -> str:
    """A slot in the tenant's in-flight set for a resume (a reader of a request's events
    holds one for as long as it reads), under ``max_concurrent``; raises ApiError 429.
    Returns the member, which expires after ``ttl_s`` unless ``renew_slot`` pushes it on;
    ``free_slot_quietly`` frees it at the end."""
    now = time.time() if now is None else now
    limits = key_limits_sync(api_key)
    tenant = str(api_key.tenant_id)
    member = f"{RESUME_SLOT_PREFIX}{uuid.uuid4().hex}"
    ttl = max(1, math.ceil(ttl_s))
    keys = [protocol.inflight_key(tenant), protocol.LIMIT_REFUSALS_HASH]
    args = [repr(now), member, repr(now + ttl), _arg(limits.max_concurrent), ttl]
    result = _text(broker.sync_client().eval(_TAKE_SLOT, len(keys), *keys, *args))
    if result != "ok":
        raise refusal(result, limits, now)
    return member


async def renew_slot(tenant_id: str, member: str, ttl_s: float) -> None:
    """Push a held slot's expiry to ``ttl_s`` from now (only if it is still held)."""
    await broker.async_client().zadd(protocol.inflight_key(tenant_id),
                                     {member: time.time() + ttl_s}, xx=True)


async def free_slot_quietly(tenant_id: str, member: str) -> None:
    """Free a held slot; never raises (used while unwinding: an unfreed slot expires)."""
    try:
        await asyncio.wait_for(
            broker.async_client().zrem(protocol.inflight_key(tenant_id), member), timeout=2)
    except Exception:
        log.warning("could not free the slot %s of tenant %s", member, tenant_id, exc_info=True)


def refusal(reason: str, limits: Limits, now: float, reserve: int = 0) -> ApiError:
    """The 429 for a refusal, with Retry-After: when trying again can help (the next
    minute or month; 1 s when requests in flight hold what is missing)."""
    reason, _, rest = reason.partition(":")
    used_text, _, reserved_text = rest.partition(":")
    used, reserved = int(used_text or 0), int(reserved_text or 0)
    code = _PUBLIC_CODE.get(reason, reason)
    param = None
    if reason in (_OVER_BUDGET, BUDGET_EXCEEDED):
        retry = _seconds_to_next_month(now)
        budget = limits.monthly_token_budget
        message = f"This tenant has used its monthly budget of {budget} tokens."
        if used < (budget or 0):
            message = (
                f"This tenant has {budget - used} tokens left of its monthly budget of "
                f"{budget}; this request may use up to {reserve} (prompt estimate + "
                "max_tokens): lower max_tokens."
            )
            param = "max_tokens"
    elif reason == _BUDGET_TOO_BIG:
        retry = _seconds_to_next_month(now)
        message = (
            f"This request may use up to {reserve} tokens (prompt estimate + max_tokens), "
            f"more than the tenant's monthly budget of {limits.monthly_token_budget}: "
            "lower max_tokens."
        )
        param = "max_tokens"
    elif reason in (_BUDGET_HELD, _TPM_HELD):
        retry = 1
        which = "monthly budget" if reason == _BUDGET_HELD else "tokens per minute"
        message = (
            f"This tenant's requests in flight have reserved {reserved} tokens of its {which}; "
            f"this request may use up to {reserve} (prompt estimate + max_tokens) and does "
            "not fit next to them: wait for one to finish, or lower max_tokens."
        )
    elif reason == _TPM_TOO_BIG:
        retry = max(1, math.ceil(60 - now % 60))
        message = (
            f"This request may use up to {reserve} tokens (prompt estimate + max_tokens), "
            f"more than the tenant's {limits.tokens_per_minute} tokens per minute: "
            "lower max_tokens."
        )
        param = "max_tokens"
    elif reason == CONCURRENCY_LIMITED:
        retry = 1
        message = (
            f"This tenant already has {limits.max_concurrent} requests queued or running "
            "(resumes count too); wait for one to finish."
        )
    else:
        retry = max(1, math.ceil(60 - now % 60))
        message = (
            "This tenant is over its rate limit "
            f"({_describe_rate(limits)}); try again in {retry} s."
        )
    return ApiError(429, message, code, param, headers={"Retry-After": str(retry)})


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
