"""Per-tenant limits, the web's side: the limits a tenant has (from the database), the
token reservation a request needs, and a refusal turned into the API's 429. The Redis side
(keys, the admission script, slots, the daemon's end-of-request accounting) is
``wire/limits.py``, shared with the daemon; docs/limits.md says how it all works.

Limits (``Tenant`` fields, NULL = unlimited):
- requests_per_minute     requests admitted in the last 60 s (sliding)     -> rpm_exceeded
- tokens_per_minute       tokens used in the last 60 s + reserved in flight -> tpm_exceeded
- max_concurrent          requests queued or running, and resumes, now     -> concurrency_limited
- monthly_token_budget    tokens used this UTC month + reserved in flight  -> budget_exceeded

A replay (a resume of a finished request, its stored stream sent again: ``count_replay``)
counts as a request against requests_per_minute, and against the web's replay rate per
tenant, ``REPLAYS_PER_MINUTE`` (a setting; 0: unlimited)     -> replays_exceeded
A replay refused by the script is remembered in this process until its Retry-After
(``ReplayRefusals``): the tenant's replays in that time are refused without Redis.

An API key's own limits (``ApiKey`` fields, NULL = none of the key's), within its tenant's
and checked in the same script run (``KEY_FIELDS``: requests_per_minute,
tokens_per_minute, monthly_token_budget), refuse with the same codes; the message says it
is the key's limit. A replay counts against the tenant's requests per minute only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from dataclasses import dataclass, replace

import redis
from django.conf import settings

from accounts.models import ApiKey, Tenant
from inference import broker, db
from inference.errors import ApiError
from wire import limits as wire_limits
from wire.backoff import Backoff
from wire.limits import (  # noqa: F401  (re-exported: what the web's callers name)
    BUDGET_EXCEEDED,
    CONCURRENCY_LIMITED,
    QUEUE_REFUSAL_CODES,
    REFUSAL_CODES,
    RESUME_SLOT_PREFIX,
    Limits,
)

log = logging.getLogger(__name__)

# The prompt estimate's allowance for what a chat template adds around each message
# (turn markers, role line, newlines) and once (BOS, the generation prompt). The web does
# not tokenize: a token covers at least one UTF-8 byte of text (byte fallback), so bytes +
# allowances bound the prompt's tokens from above.
TEMPLATE_TOKENS_PER_MESSAGE = 8
TEMPLATE_TOKENS_FIXED = 16

FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget")
KEY_FIELDS = ("requests_per_minute", "tokens_per_minute", "monthly_token_budget")
FRESH_KEY_S = 1.0  # a key (and its tenant) loaded this recently counts as read now
REPLAYS_PER_MINUTE = 60  # default of the setting: one tenant's replays in the last minute


def tenant_limits(tenant_id: int) -> Limits:
    """Read fresh from the database: a raised limit applies to the very next request."""
    row = Tenant.objects.filter(pk=tenant_id).values(*FIELDS).first() or {}
    return Limits(**row)


def key_limits_sync(api_key: ApiKey) -> Limits:
    """The tenant's limits as loaded with ``api_key`` if that was at most FRESH_KEY_S ago (a
    REST request authenticates every time), else as the database has them now (a
    websocket keeps its key for the connection)."""
    loaded_at = api_key.loaded_at
    if loaded_at is not None and time.monotonic() - loaded_at <= FRESH_KEY_S:
        tenant = api_key.tenant
        return Limits(**{f: getattr(tenant, f) for f in FIELDS})
    return tenant_limits(api_key.tenant_id)


def slot_ttl_s() -> int:
    """How long a request may hold a concurrency slot before it is presumed lost."""
    return int(settings.ACCEPT_TIMEOUT_S + settings.REQUEST_TIMEOUT_S + settings.LIMIT_SLOT_GRACE_S)


async def admit_key(api_key: ApiKey, request_id: str, reserve: int = 0,
                    model: str | None = None) -> None:
    """``admit_key_sync`` on the event loop (the async Redis client): a refusal never waits
    for the database thread (the limits, the tenant's and the key's own, come with the key;
    read from the database only when it was loaded over FRESH_KEY_S ago). Raises ApiError
    (429, 503 ``queue_full``) or a RedisError (the script may have run: the caller
    releases)."""
    limits, own = await admission_limits(api_key)
    now = time.time()
    script, keys, args = wire_limits.admit_call(
        str(api_key.tenant_id), request_id, limits, now=now, reserve=reserve,
        slot_ttl_s=slot_ttl_s(), model=model, max_queued=api_key.tenant.max_queued, key=own)
    refused = wire_limits.decision(await broker.async_client().eval(script, len(keys), *keys,
                                                                     *args))
    if refused is not None:
        raise refusal(refused, limits, reserve, key=own)


def own_limits(api_key: ApiKey) -> wire_limits.KeyLimits:
    """The key's own limits as loaded with it."""
    return wire_limits.KeyLimits(str(api_key.pk), **{f: getattr(api_key, f) for f in KEY_FIELDS})


def _fresh(api_key: ApiKey) -> bool:
    loaded_at = api_key.loaded_at
    return loaded_at is not None and time.monotonic() - loaded_at <= FRESH_KEY_S


def admission_limits_sync(api_key: ApiKey) -> tuple[Limits, wire_limits.KeyLimits]:
    """The tenant's limits and the key's own, as loaded with ``api_key`` if that was at
    most FRESH_KEY_S ago, else as the database has them now (one query)."""
    if _fresh(api_key):
        return key_limits_sync(api_key), own_limits(api_key)
    row = ApiKey.objects.filter(pk=api_key.pk).values(
        *KEY_FIELDS, *(f"tenant__{f}" for f in FIELDS)).first()
    if row is None:  # deleted since: the tenant's as they are, no limit of its own
        return tenant_limits(api_key.tenant_id), wire_limits.KeyLimits(str(api_key.pk))
    return (Limits(**{f: row[f"tenant__{f}"] for f in FIELDS}),
            wire_limits.KeyLimits(str(api_key.pk), **{f: row[f] for f in KEY_FIELDS}))


async def admission_limits(api_key: ApiKey) -> tuple[Limits, wire_limits.KeyLimits]:
    """``admission_limits_sync`` from async code: the database thread only for a key loaded
    over FRESH_KEY_S ago (a websocket's)."""
    if _fresh(api_key):
        return key_limits_sync(api_key), own_limits(api_key)
    return await db.run(admission_limits_sync, api_key)


async def key_limits(api_key: ApiKey) -> Limits:
    """``key_limits_sync`` from async code: the database thread only for a key loaded over
    FRESH_KEY_S ago."""
    loaded_at = api_key.loaded_at
    if loaded_at is not None and time.monotonic() - loaded_at <= FRESH_KEY_S:
        return Limits(**{f: getattr(api_key.tenant, f) for f in FIELDS})
    return await db.run(tenant_limits, api_key.tenant_id)


@dataclass(slots=True)
class RememberedRefusal:
    """A replay refusal of the script: ``refused`` until ``until`` (monotonic s), under the
    replay rate ``per_minute`` and the tenant's ``rpm``; ``unreported``: replays refused
    from it since, not yet in Redis's refusal counters."""

    refused: wire_limits.Refused
    until: float
    per_minute: int
    rpm: int | None
    unreported: int = 0


class ReplayRefusals:
    """Per tenant, the last replay refusal of the script (``count_replay``), until the
    Retry-After it gave. No replay of the tenant can be admitted by any process before
    then (a window only gains counts until its buckets age out, and the Retry-After is when
    enough have), unless its limits change: so a replay in that time is refused here, with
    no Redis and no database work, while the script's windows stay the truth (nothing is
    ever admitted here). A refusal for the tenant's requests per minute holds only while
    that limit is unchanged; one for the replay rate only while ``REPLAYS_PER_MINUTE`` is.
    The refusals made here are added to Redis's counters by the tenant's next script calls
    (one code per call); until then they are only ever added to, never replaced.
    One per web process, used on its event loop only."""

    def __init__(self) -> None:
        self._remembered: dict[str, RememberedRefusal] = {}
        self._unreported: dict[str, dict[str, int]] = {}  # tenant: {code: refusals}

    def remember(self, tenant_id: str, refused: wire_limits.Refused, per_minute: int,
                 rpm: int | None, now: float) -> None:
        """The script refused the tenant's replay, ``refused.retry_after_s`` from ``now``."""
        if len(self._remembered) >= MAX_REMEMBERED_TENANTS:
            self._drop_expired(now)
        if tenant_id in self._remembered:  # a concurrent replay's refusal: keep its count
            self._forget(tenant_id)
        self._remembered[tenant_id] = RememberedRefusal(
            refused, now + refused.retry_after_s, per_minute, rpm)

    def refusal(self, tenant_id: str, per_minute: int, now: float,
                rpm: int | None = None) -> RememberedRefusal | None:
        """The tenant's remembered refusal if it still holds at ``now`` under these terms
        (``rpm`` is looked at for a requests-per-minute refusal only), else None (and
        it is forgotten)."""
        held = self._remembered.get(tenant_id)
        if held is None:
            return None
        if (held.until <= now or held.per_minute != per_minute
                or (held.refused.limit == wire_limits.RPM and held.rpm != rpm)):
            self._forget(tenant_id)
            return None
        return held

    def unreported(self, tenant_id: str) -> tuple[str, int]:
        """(code, count) of refusals of one code made here that Redis has not counted yet
        (("", 0): none); they are handed over (the caller passes them to the script, and
        ``put_back`` if the script fails)."""
        counts = self._unreported.get(tenant_id)
        if not counts:
            return "", 0
        code = next(iter(counts))
        count = counts.pop(code)
        if not counts:
            del self._unreported[tenant_id]
        return code, count

    def put_back(self, tenant_id: str, code: str, count: int) -> None:
        """Refusals handed over by ``unreported`` that the script did not count."""
        self._add(tenant_id, code, count)

    def clear(self) -> None:
        self._remembered.clear()
        self._unreported.clear()

    def _forget(self, tenant_id: str) -> None:
        held = self._remembered.pop(tenant_id)
        self._add(tenant_id, held.refused.code, held.unreported)  # for the next script call

    def _add(self, tenant_id: str, code: str, count: int) -> None:
        if count <= 0:
            return
        counts = self._unreported.setdefault(tenant_id, {})
        counts[code] = counts.get(code, 0) + count
        if len(self._unreported) > MAX_REMEMBERED_TENANTS:
            self._unreported.clear()  # counters for /metrics: a bound before exactness

    def _drop_expired(self, now: float) -> None:
        for tenant_id in [t for t, h in self._remembered.items() if h.until <= now]:
            self._forget(tenant_id)
        if len(self._remembered) >= MAX_REMEMBERED_TENANTS:
            self._remembered.clear()


MAX_REMEMBERED_TENANTS = 10_000
replay_refusals = ReplayRefusals()


def _replays_per_minute() -> int:
    return int(broker.setting("REPLAYS_PER_MINUTE", REPLAYS_PER_MINUTE))


async def refuse_remembered_replay(api_key: ApiKey) -> None:
    """Raise the tenant's remembered replay refusal (``ReplayRefusals``), its Retry-After
    what is left of it: with no Redis, and no database work but, for a requests-per-minute
    refusal of a key loaded over FRESH_KEY_S ago, the tenant's limits. Returns when none
    holds."""
    tenant_id, per_minute = str(api_key.tenant_id), _replays_per_minute()
    now = time.monotonic()
    held = replay_refusals.refusal(tenant_id, per_minute, now)
    if held is None:
        return
    limits = Limits()
    if held.refused.limit == wire_limits.RPM:
        limits = await key_limits(api_key)
        held = replay_refusals.refusal(tenant_id, per_minute, now, limits.requests_per_minute)
        if held is None:
            return
    held.unreported += 1
    left = replace(held.refused, retry_after_s=max(1, math.ceil(held.until - now)))
    raise refusal(left, limits, replays_per_minute=per_minute)


async def count_replay(api_key: ApiKey) -> None:
    """Count a replay of a finished request (``wire.limits.replay_call``) against the
    tenant's ``REPLAYS_PER_MINUTE`` and its requests per minute, or raise ApiError 429
    (``replays_exceeded``, ``rpm_exceeded``, with Retry-After), remembered for the tenant
    until then (``refuse_remembered_replay``); counts nothing when both are unlimited."""
    await refuse_remembered_replay(api_key)
    per_minute = _replays_per_minute()
    limits = await key_limits(api_key)
    if per_minute <= 0 and limits.requests_per_minute is None:
        return
    tenant_id = str(api_key.tenant_id)
    earlier_code, earlier = replay_refusals.unreported(tenant_id)
    script, keys, args = wire_limits.replay_call(
        tenant_id, now=time.time(), replays_per_minute=per_minute if per_minute > 0 else None,
        requests_per_minute=limits.requests_per_minute, earlier_code=earlier_code,
        earlier_refusals=earlier)
    try:
        reply = await broker.async_client().eval(script, len(keys), *keys, *args)
    except BaseException:  # not counted (or its reply lost): the next call hands them over
        replay_refusals.put_back(tenant_id, earlier_code, earlier)
        raise
    refused = wire_limits.decision(reply)
    if refused is not None:
        replay_refusals.remember(tenant_id, refused, per_minute, limits.requests_per_minute,
                                 time.monotonic())
        raise refusal(refused, limits, replays_per_minute=per_minute)


def admit_key_sync(api_key: ApiKey, request_id: str, reserve: int = 0,
                   model: str | None = None) -> None:
    """``admit_sync`` for a request made with ``api_key`` (limits: the tenant's and the
    key's own, ``admission_limits_sync``; ``model``: through that model's queue gate, under
    the tenant's ``max_queued``)."""
    limits, own = admission_limits_sync(api_key)
    admit_sync(api_key.tenant_id, request_id, limits, reserve=reserve, model=model,
               max_queued=api_key.tenant.max_queued, key=own)


def reservation(prompt: str | list[int] | None, messages: list[dict[str, str]] | None,
                max_tokens: int | None, n: int = 1) -> int:
    """The most tokens a request can use: an upper bound of its prompt's tokens (UTF-8
    bytes of its text, plus the template's allowances; token ids count one each) plus its
    ``max_tokens`` (``DEFAULT_MAX_TOKENS`` when it names none) for each of its ``n``
    choices (the prompt counts once)."""
    estimate = TEMPLATE_TOKENS_FIXED
    if messages is not None:
        for message in messages:
            estimate += TEMPLATE_TOKENS_PER_MESSAGE + _utf8_len(message.get("role", ""))
            estimate += _utf8_len(message.get("content", ""))
    elif isinstance(prompt, list):  # token ids; or an embeddings request's inputs
        estimate += sum(_utf8_len(p) if isinstance(p, str) else len(p) if isinstance(p, list)
                        else 1 for p in prompt)
    elif prompt is not None:
        estimate += _utf8_len(prompt)
    completion = max_tokens if max_tokens is not None else settings.DEFAULT_MAX_TOKENS
    return estimate + int(completion) * n


def _utf8_len(text: object) -> int:
    # surrogatepass: a lone surrogate (refused elsewhere) is 3 bytes, never an error here
    return len(str(text).encode("utf-8", "surrogatepass"))


def admit_sync(
    tenant_id: int | str, request_id: str, limits: Limits, now: float | None = None,
    reserve: int = 0, model: str | None = None, max_queued: int | None = None,
    key: wire_limits.KeyLimits | None = None,
) -> None:
    """Take a slot for ``request_id`` or raise ApiError 429 (with Retry-After). With a
    token limit, ``reserve`` tokens are held for the request until it ends (its actual
    usage replaces them: ``wire.limits.record_usage``). ``model``: the model's queue is
    looked at first (503 ``queue_full``, 429 ``tenant_queue_full``: wire/queue.py).
    ``key``: the key's own limits, in the same script run (``wire.limits.admit_call``)."""
    now = time.time() if now is None else now
    refused = wire_limits.admit(broker.sync_client(), str(tenant_id), request_id, limits,
                                now=now, reserve=reserve, slot_ttl_s=slot_ttl_s(),
                                model=model, max_queued=max_queued, key=key)
    if refused is not None:
        raise refusal(refused, limits, reserve, key=key)


def release_sync(tenant_id: int | str, request_id: str) -> None:
    """Free a request's concurrency slot and drop its token reservations, the tenant's and
    its key's (idempotent)."""
    pipe = broker.sync_client().pipeline(transaction=False)
    wire_limits.release(pipe, str(tenant_id), request_id)
    pipe.execute()


def release_quietly_sync(tenant_id: int | str, request_id: str) -> None:
    """``release_sync`` that never raises: a slot Redis cannot free now expires (its score)."""
    try:
        release_sync(tenant_id, request_id)
    except redis.RedisError as exc:
        log.warning("could not release the slot of %s now (%r); it expires", request_id, exc)


async def release_soon(tenant_id: int | str, request_id: str) -> None:
    """``release_sync`` from async code. Redis away: retried with backoff in the background
    until it answers (the slot is free the moment Redis is back), for at most the slot's
    TTL, past which the next admission drops the slot anyway. Never raises."""
    try:
        await _release(str(tenant_id), request_id)
    except redis.RedisError:
        task = asyncio.ensure_future(_release_when_back(str(tenant_id), request_id))
        _releasing.add(task)  # a task nothing references may be collected before it ends
        task.add_done_callback(_releasing.discard)


_releasing: set[asyncio.Future[None]] = set()


async def _release(tenant_id: str, request_id: str) -> None:
    pipe = broker.async_client().pipeline(transaction=False)
    wire_limits.release(pipe, tenant_id, request_id)
    await pipe.execute()


async def _release_when_back(tenant_id: str, request_id: str) -> None:
    outage = Backoff()
    give_up = time.monotonic() + slot_ttl_s()
    while time.monotonic() < give_up:
        await asyncio.sleep(outage.failed())
        try:
            await _release(tenant_id, request_id)
            return
        except redis.RedisError:
            continue
    log.warning("gave up releasing the slot of %s: it has expired by now", request_id)


async def take_resume_slot(api_key: ApiKey, ttl_s: float) -> str:
    """A slot in the tenant's in-flight set for a resume (a reader of a request's events
    holds one for as long as it reads), under ``max_concurrent``, on the event loop (the
    database thread only for a key loaded over FRESH_KEY_S ago); raises ApiError 429.
    Returns the member, which expires after ``ttl_s`` unless ``renew_slot`` pushes it on;
    ``free_slot_quietly`` frees it at the end."""
    limits = await key_limits(api_key)
    member = f"{RESUME_SLOT_PREFIX}{uuid.uuid4().hex}"
    script, keys, args = wire_limits.take_slot_call(
        str(api_key.tenant_id), member, limits.max_concurrent, now=time.time(),
        ttl_s=max(1, math.ceil(ttl_s)))
    refused = wire_limits.decision(await broker.async_client().eval(script, len(keys), *keys,
                                                                     *args))
    if refused is not None:
        raise refusal(refused, limits)
    return member


async def renew_slot(tenant_id: str, member: str, ttl_s: float) -> None:
    """Push a held slot's expiry to ``ttl_s`` from now (only if it is still held)."""
    await wire_limits.renew_slot(broker.async_client(), tenant_id, member, ttl_s, time.time())


async def free_slot_quietly(tenant_id: str, member: str) -> None:
    """Free a held slot; never raises (used while unwinding: an unfreed slot expires)."""
    try:
        await asyncio.wait_for(
            wire_limits.free_slot(broker.async_client(), tenant_id, member), timeout=2)
    except Exception:
        log.warning("could not free the slot %s of tenant %s", member, tenant_id, exc_info=True)


def refusal(refused: wire_limits.Refused, limits: Limits, reserve: int = 0,
            replays_per_minute: int = 0,
            key: wire_limits.KeyLimits | None = None) -> ApiError:
    """The 429 (503 for a full model queue) for a refusal: its code, a message saying what
    is over (the tenant's limit, or the key's own: ``key``) and what to do,
    ``param: "max_tokens"`` when a smaller one would fit, and when to retry (the
    ``Retry-After`` header, and ``retry_after_s`` in the body for websocket clients)."""
    if refused.limit == wire_limits.REPLAYS:
        message, param = (f"This tenant replayed {refused.used} finished requests in the last "
                          f"minute, the most per minute ({replays_per_minute}); try again in "
                          f"{refused.retry_after_s} s."), None
    elif refused.of_key:
        own = key or wire_limits.KeyLimits("")
        message, param = _explain(
            replace(refused, limit=refused.base_limit),
            Limits(own.requests_per_minute, own.tokens_per_minute, None,
                   own.monthly_token_budget), reserve, who="API key")
    else:
        message, param = _explain(refused, limits, reserve)
    retry = refused.retry_after_s
    return ApiError(refused.code, message, param, headers={"Retry-After": str(retry)},
                    retry_after_s=retry)


def _explain(refused: wire_limits.Refused, limits: Limits, reserve: int,
             who: str = "tenant") -> tuple[str, str | None]:
    """``who``: whose limit refused, "tenant" or "API key" (the key's own, within the
    tenant's)."""
    limit, how, used, reserved = refused.limit, refused.how, refused.used, refused.reserved
    this, its = f"This {who}", f"the {who}'s"
    if limit == wire_limits.QUEUE:
        return (f"{used} requests are waiting for this model, as many as its daemons "
                f"queue; try again in {refused.retry_after_s} s."), None
    if limit == wire_limits.TENANT_QUEUE:
        return (f"This tenant already has {used} requests waiting for this model, its "
                f"share of the queue; try again in {refused.retry_after_s} s."), None
    wants = f"this request may use up to {reserve} tokens (prompt estimate + max_tokens)"
    if how == wire_limits.HELD and limit == wire_limits.CONCURRENCY:
        return (f"This tenant already has {limits.max_concurrent} requests queued or running "
                "(resumes count too); wait for one to finish."), None
    if how == wire_limits.HELD:
        which = "monthly budget" if limit == wire_limits.BUDGET else "tokens per minute"
        return (f"{this}'s requests in flight have reserved {reserved} tokens of its "
                f"{which}; {wants} and does not fit next to them: wait for one to finish, "
                "or lower max_tokens."), None
    if limit == wire_limits.BUDGET:
        budget = limits.monthly_token_budget or 0
        if how == wire_limits.TOO_BIG:
            return (f"{wants[0].upper()}{wants[1:]}, more than {its} monthly budget "
                    f"of {budget}: lower max_tokens."), "max_tokens"
        if used >= budget:
            return f"{this} has used its monthly budget of {budget} tokens.", None
        return (f"{this} has {budget - used} tokens left of its monthly budget of "
                f"{budget}; {wants}: lower max_tokens."), "max_tokens"
    if limit == wire_limits.TPM:
        tpm = limits.tokens_per_minute or 0
        if how == wire_limits.TOO_BIG:
            return (f"{wants[0].upper()}{wants[1:]}, more than {its} {tpm} tokens per "
                    "minute: lower max_tokens."), "max_tokens"
        room = used + reserved < tpm  # a smaller max_tokens could fit now
        return (f"{this} used {used} tokens in the last minute and its requests in "
                f"flight reserved {reserved}, of its {tpm} tokens per minute; {wants}: try "
                f"again in {refused.retry_after_s} s{', or lower max_tokens' if room else ''}."
                ), "max_tokens" if room else None
    if limit == wire_limits.RPM:
        if how == wire_limits.TOO_BIG:
            return f"{this} may make no requests (requests_per_minute is 0).", None
        replays = " (replays count too)" if who == "tenant" else ""
        return (f"{this} made {used} requests in the last minute{replays}, its limit of "
                f"{limits.requests_per_minute} per minute; try again in "
                f"{refused.retry_after_s} s."), None
    return "This tenant may have no requests in flight (max_concurrent is 0).", None


def tenant_refusals_sync(tenant_id: int | str) -> dict[str, int]:
    """A tenant's refused requests by code (they have no history row: wire/limits.admit)."""
    return wire_limits.refusal_counts(broker.sync_client(), str(tenant_id))


def current_usage_sync(tenant_id: int | str, now: float | None = None) -> dict[str, int]:
    """The tenant's counters as the limits see them (for the usage API and the admin)."""
    now = time.time() if now is None else now
    return wire_limits.current_usage(broker.sync_client(), str(tenant_id), now)


def refusal_counts_sync() -> dict[str, int]:
    """Refusals by code since the counters began (all web processes)."""
    return wire_limits.refusal_counts(broker.sync_client())
