"""Tenant limits, and an API key's own within them, in Redis: the one owner of their keys,
of the admission script and of the concurrency slots. The web admits (``admit``,
``take_slot``) and gives slots back (``release``, ``free_slot``); the daemon's writer queues
``record_usage`` in the pipeline that writes a request's terminal event. Nothing here
imports Django (the web's side, limits read from the database and refusals turned into API
errors, is ``inference/limits.py``).

Windows slide: requests and tokens per minute count what happened in the last 60 s, kept
as one-second buckets in a hash (61 of them: a request counts for 60 to 61 s, never less),
so no burst gets twice a limit across a minute boundary. The monthly budget is a UTC
calendar month (what a bill counts). See docs/limits.md for why one script and not GCRA
or the ``limits`` library.

Keys (tenant ids are the database ids):
In-flight ``llm:limit:inflight:<tenant>``  sorted set: request id (or ``resume:<hex>``) ->
                                           expiry (unix s); past its expiry a member is
                                           dropped by the next admission: no slot leaks.
Reserved  ``llm:limit:reserved:<tenant>``  hash: request id -> tokens reserved at admission;
                                           counts while the request's in-flight member lives.
Requests  ``llm:limit:rpm:<tenant>``       hash: unix second -> requests admitted in it
                                           (and replays, when the tenant has an rpm limit)
Replays   ``llm:limit:replays:<tenant>``   hash: unix second -> replays of finished requests
                                           served in it (``replay_call``)
Tokens    ``llm:limit:tpm:<tenant>``       hash: unix second -> tokens of requests that ended in it
Month     ``llm:usage:month:<tenant>:<YYYYMM>``  tokens of requests that ended in a UTC month
Refusals  ``llm:limit:refusals``           hash: refusal code -> count (for /metrics)
          ``llm:limit:refusals:<tenant>``  the same, one tenant's (the admin; refused requests
                                           get no history row: see ``admit``)

An API key's own limits (``KeyLimits``: its requests and tokens per minute, its monthly
budget, each within its tenant's) are checked in the same script run as the tenant's, with
counters of the key's (key ids are the database ids):
Requests  ``llm:limit:key:rpm:<key>``      hash: unix second -> requests of the key admitted
Tokens    ``llm:limit:key:tpm:<key>``      hash: unix second -> tokens of its requests ended
Month     ``llm:usage:key:month:<key>:<YYYYMM>``  tokens of its requests ended in a UTC month
Reserved  ``llm:limit:key:reserved:<key>`` hash: request id -> tokens reserved of the key's;
                                           counts while the request's tenant in-flight
                                           member lives (so never past its slot)
Keys of   ``llm:limit:keyof:<tenant>``     hash: request id -> the key it was admitted with
                                           (its end charges that key: ``lua/end_key.lua``);
                                           dropped with the request's in-flight member
"""

from __future__ import annotations

import calendar
import math
import time
from dataclasses import dataclass
from typing import Any

from . import queue
from .errors import CODES
from .protocol import HEARTBEAT_TTL_S, PREFIX
from .scripts import lua

WINDOW_S = 60  # requests and tokens per minute: the last WINDOW_S seconds
WINDOW_KEY_TTL_S = 2 * WINDOW_S  # a window's hash outlives its newest bucket by this much
MONTH_USAGE_TTL_S = 62 * 86400
REFUSALS_HASH = f"{PREFIX}:limit:refusals"
RESUME_SLOT_PREFIX = "resume:"
UNLIMITED = -1

# The refusal codes (statuses and OpenAI types: wire/errors.py).
RPM_EXCEEDED = CODES["rpm_exceeded"].code
TPM_EXCEEDED = CODES["tpm_exceeded"].code
CONCURRENCY_LIMITED = CODES["concurrency_limited"].code
BUDGET_EXCEEDED = CODES["budget_exceeded"].code
QUEUE_FULL = CODES["queue_full"].code
REPLAYS_EXCEEDED = CODES["replays_exceeded"].code
TENANT_QUEUE_FULL = CODES["tenant_queue_full"].code
REFUSAL_CODES = (RPM_EXCEEDED, TPM_EXCEEDED, CONCURRENCY_LIMITED, BUDGET_EXCEEDED,
                 REPLAYS_EXCEEDED)
QUEUE_REFUSAL_CODES = (QUEUE_FULL, TENANT_QUEUE_FULL)  # the model queue's gate (wire/queue.py)

# Which limit refused (the script names them so) -> the refusal's code.
BUDGET, TPM, RPM, CONCURRENCY = "budget", "tpm", "rpm", "concurrency"
QUEUE, TENANT_QUEUE = "queue", "tenant_queue"  # the model's queue (wire/queue.py's gate)
REPLAYS = "replays"  # the replay rate (``replay_call``)
# The key's own limits (the script names them so): the same codes as the tenant's.
KEY_BUDGET, KEY_TPM, KEY_RPM = "key_budget", "key_tpm", "key_rpm"
KEY_LIMITS = {KEY_BUDGET: BUDGET, KEY_TPM: TPM, KEY_RPM: RPM}
CODE_OF = {BUDGET: BUDGET_EXCEEDED, TPM: TPM_EXCEEDED, RPM: RPM_EXCEEDED,
           CONCURRENCY: CONCURRENCY_LIMITED, QUEUE: QUEUE_FULL, TENANT_QUEUE: TENANT_QUEUE_FULL,
           REPLAYS: REPLAYS_EXCEEDED, KEY_BUDGET: BUDGET_EXCEEDED, KEY_TPM: TPM_EXCEEDED,
           KEY_RPM: RPM_EXCEEDED}
# How: waiting for the window or the month helps (retry_after_s says when) ...
OVER = "over"
# ... what is missing is held by requests (or resumes) in flight: retry soon ...
HELD = "held"
# ... this request alone is over the limit: waiting never helps.
TOO_BIG = "too_big"
# ... the model's queue (or the tenant's share of it) is full: retry_after_s from its drain.
FULL = "full"


def inflight_key(tenant_id: str) -> str:
    return f"{PREFIX}:limit:inflight:{tenant_id}"


def reserved_key(tenant_id: str) -> str:
    return f"{PREFIX}:limit:reserved:{tenant_id}"


def rpm_key(tenant_id: str) -> str:
    return f"{PREFIX}:limit:rpm:{tenant_id}"


def replays_key(tenant_id: str) -> str:
    return f"{PREFIX}:limit:replays:{tenant_id}"


def tpm_key(tenant_id: str) -> str:
    return f"{PREFIX}:limit:tpm:{tenant_id}"


def tenant_refusals_key(tenant_id: str) -> str:
    return f"{REFUSALS_HASH}:{tenant_id}"


KEY_RPM_PREFIX = f"{PREFIX}:limit:key:rpm:"
KEY_TPM_PREFIX = f"{PREFIX}:limit:key:tpm:"
KEY_RESERVED_PREFIX = f"{PREFIX}:limit:key:reserved:"
KEY_MONTH_PREFIX = f"{PREFIX}:usage:key:month:"


def key_rpm_key(key_id: str) -> str:
    return f"{KEY_RPM_PREFIX}{key_id}"


def key_tpm_key(key_id: str) -> str:
    return f"{KEY_TPM_PREFIX}{key_id}"


def key_reserved_key(key_id: str) -> str:
    return f"{KEY_RESERVED_PREFIX}{key_id}"


def key_month_key(key_id: str, now: float) -> str:
    """The key's token counter for the UTC month of ``now``."""
    return f"{KEY_MONTH_PREFIX}{key_id}:{_month(now)}"


def key_of_key(tenant_id: str) -> str:
    """The tenant's requests in flight -> the key each was admitted with."""
    return f"{PREFIX}:limit:keyof:{tenant_id}"


def key_keys(tenant_id: str, key_id: str, now: float) -> list[str]:
    """The admission script's KEYS of a key (the last five, wire/lua/admit.lua)."""
    return [key_rpm_key(key_id), key_tpm_key(key_id), key_month_key(key_id, now),
            key_reserved_key(key_id), key_of_key(tenant_id)]


def month_key(tenant_id: str, now: float) -> str:
    """The tenant's token counter for the UTC month of ``now``."""
    return f"{PREFIX}:usage:month:{tenant_id}:{_month(now)}"


def _month(now: float) -> str:
    return time.strftime("%Y%m", time.gmtime(now))


@dataclass(frozen=True, slots=True)
class Limits:
    """A tenant's limits; None: unlimited."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    monthly_token_budget: int | None = None


@dataclass(frozen=True, slots=True)
class KeyLimits:
    """An API key's own limits within its tenant's; None: no limit of the key's."""

    key_id: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    monthly_token_budget: int | None = None

    @property
    def token_limited(self) -> bool:
        return self.tokens_per_minute is not None or self.monthly_token_budget is not None


@dataclass(frozen=True, slots=True)
class Refused:
    """Why the script refused: which ``limit`` (BUDGET, TPM, RPM, CONCURRENCY), ``how``
    (OVER, HELD, TOO_BIG), the seconds until the request would be admitted (if nothing else
    changes), what that limit counts now and the tokens reserved by requests in flight."""

    limit: str
    how: str
    retry_after_s: int
    used: int
    reserved: int

    @property
    def code(self) -> str:
        return CODE_OF[self.limit]

    @property
    def of_key(self) -> bool:
        """Whether the key's own limit refused (KEY_BUDGET, KEY_TPM, KEY_RPM; then
        ``used`` and ``reserved`` are the key's)."""
        return self.limit in KEY_LIMITS

    @property
    def base_limit(self) -> str:
        """The limit's kind, the key's or the tenant's alike (BUDGET, TPM, RPM, ...)."""
        return KEY_LIMITS.get(self.limit, self.limit)


# The scripts (wire/lua/): admit.lua and take_slot.lua, each headed by in_flight.lua (the
# in-flight set, the reservations, now); renew_slot.lua; count_replay.lua.
_ADMIT = lua("admit")  # the gate (given its keys) and every limit, in one step
_TAKE_SLOT = lua("take_slot")  # a slot without tokens (a resume)
_RENEW_SLOT = lua("renew_slot")  # a held slot's expiry pushed on


def admit(client: Any, tenant_id: str, request_id: str, limits: Limits, *, now: float,
          reserve: int, slot_ttl_s: int, model: str | None = None,
          max_queued: int | None = None, key: KeyLimits | None = None) -> Refused | None:
    """``admit_call`` run with a synchronous client (see there)."""
    script, keys, args = admit_call(tenant_id, request_id, limits, now=now, reserve=reserve,
                                    slot_ttl_s=slot_ttl_s, model=model, max_queued=max_queued,
                                    key=key)
    return decision(client.eval(script, len(keys), *keys, *args))


def admit_call(tenant_id: str, request_id: str, limits: Limits, *, now: float, reserve: int,
               slot_ttl_s: int, model: str | None = None, max_queued: int | None = None,
               key: KeyLimits | None = None) -> tuple[str, list[str], list[Any]]:
    """Admit a request in one atomic script, or say why not (then nothing is counted). When
    admitted it holds a concurrency slot for at most ``slot_ttl_s``, counts as a request
    in the window, and, when the tenant has a token limit, holds ``reserve`` tokens until it
    ends (``release`` or ``record_usage``). (script, keys, args) for any client's ``eval``;
    ``decision`` reads its reply.

    ``model``: first, the gate of that model's queue (wire/queue.py): refused ``queue_full``
    when the jobs waiting for it reach the live daemons' MAX_QUEUE summed (plus the room
    they had free at their last heartbeat), or
    ``tenant_queue_full`` when this tenant's reach its share (``max_queued``, the tenant's
    own cap per daemon, else MAX_QUEUE_PER_TENANT, times the live daemons), with a
    Retry-After from the rate the daemons take jobs. A refused request is counted (by code,
    for all and for the tenant), never stored: a row per refusal would make refusing under
    an overload cost a database write, more than the work it refuses to queue.

    ``key``: the API key the request is made with, and its own limits, checked in the same
    run (refused as KEY_BUDGET, KEY_TPM, KEY_RPM: the tenant's codes). Admitted, the request
    counts in the key's requests window, is recorded as the key's (its end charges the
    key's tokens window and month: ``record_usage``) and, when the key has a token limit,
    holds ``reserve`` tokens of the key's until it ends, at most as long as its slot."""
    token_limited = limits.tokens_per_minute is not None or \
        limits.monthly_token_budget is not None
    keys = [inflight_key(tenant_id), reserved_key(tenant_id), rpm_key(tenant_id),
            tpm_key(tenant_id), month_key(tenant_id, now), REFUSALS_HASH,
            tenant_refusals_key(tenant_id)]
    args = [
        repr(now), request_id, repr(now + slot_ttl_s), slot_ttl_s, seconds_to_next_month(now),
        max(0, int(reserve)) if token_limited else 0,
        _arg(limits.monthly_token_budget), _arg(limits.tokens_per_minute),
        _arg(limits.requests_per_minute), _arg(limits.max_concurrent),
        BUDGET_EXCEEDED, TPM_EXCEEDED, RPM_EXCEEDED, CONCURRENCY_LIMITED,
        WINDOW_S, WINDOW_KEY_TTL_S,
    ]
    if key is None:
        args += ["", 0, UNLIMITED, UNLIMITED, UNLIMITED]
    else:
        args += [key.key_id, max(0, int(reserve)) if key.token_limited else 0,
                 _arg(key.monthly_token_budget), _arg(key.tokens_per_minute),
                 _arg(key.requests_per_minute)]
    if model is not None:
        keys += queue.gate_keys(model, tenant_id)
        args += queue.gate_args(tenant_id, max_queued, now, HEARTBEAT_TTL_S, QUEUE_FULL,
                                TENANT_QUEUE_FULL)
    if key is not None:  # the key's come last (admit.lua reads them from the end)
        keys += key_keys(tenant_id, key.key_id, now)
    return _ADMIT, keys, args


def take_slot(client: Any, tenant_id: str, member: str, max_concurrent: int | None, *,
              now: float, ttl_s: int) -> Refused | None:
    """``take_slot_call`` run with a synchronous client (see there)."""
    script, keys, args = take_slot_call(tenant_id, member, max_concurrent, now=now, ttl_s=ttl_s)
    return decision(client.eval(script, len(keys), *keys, *args))


def take_slot_call(tenant_id: str, member: str, max_concurrent: int | None, *, now: float,
                   ttl_s: int) -> tuple[str, list[str], list[Any]]:
    """A concurrency slot without tokens (a resume's reader) under ``max_concurrent``,
    expiring ``ttl_s`` from ``now`` unless ``renew_slot`` pushes it on. (script, keys, args)
    for any client's ``eval``; ``decision`` reads its reply."""
    keys = [inflight_key(tenant_id), reserved_key(tenant_id), REFUSALS_HASH]
    args = [repr(now), member, repr(now + ttl_s), _arg(max_concurrent), ttl_s,
            CONCURRENCY_LIMITED]
    return _TAKE_SLOT, keys, args


_COUNT_REPLAY = lua("count_replay")  # a replay counted (``replay_call``)


def replay_call(tenant_id: str, *, now: float, replays_per_minute: int | None,
                requests_per_minute: int | None, earlier_code: str = "",
                earlier_refusals: int = 0) -> tuple[str, list[str], list[Any]]:
    """Count a replay (a resume of a finished request: its stored stream sent again) in
    one atomic script: in the tenant's replay window under ``replays_per_minute``, and,
    when the tenant has a ``requests_per_minute`` limit, as a request in its requests
    window; or refuse it (``decision``: REPLAYS or RPM, OVER or TOO_BIG) and count nothing
    but the refusal. None: unlimited. ``earlier_refusals`` replays refused with
    ``earlier_code`` without the script (a web process that remembered a refusal until its
    Retry-After) are added to the refusal counters first. (script, keys, args) for any
    client's ``eval``."""
    keys = [replays_key(tenant_id), rpm_key(tenant_id), REFUSALS_HASH,
            tenant_refusals_key(tenant_id)]
    args = [repr(now), WINDOW_S, WINDOW_KEY_TTL_S, _arg(replays_per_minute),
            _arg(requests_per_minute), REPLAYS_EXCEEDED, RPM_EXCEEDED,
            earlier_code if earlier_refusals > 0 else "", max(0, int(earlier_refusals))]
    return _COUNT_REPLAY, keys, args


def renew_slot(client: Any, tenant_id: str, member: str, ttl_s: float, now: float) -> Any:
    """Push a held slot's expiry to ``ttl_s`` from ``now``, only if it is still held, and
    the in-flight key's TTL with it (else a resume read for longer than the key's TTL would
    vanish with the key). Returns the client's reply (awaitable with an asyncio client)."""
    return client.eval(_RENEW_SLOT, 1, inflight_key(tenant_id), member, repr(now + ttl_s),
                       max(1, math.ceil(ttl_s)))


def free_slot(client: Any, tenant_id: str, member: str) -> Any:
    """Free a slot that holds no tokens (a resume's). Returns the client's reply."""
    return client.zrem(inflight_key(tenant_id), member)


_END_KEY = lua("end_key")  # a request's end for its key (charge, reservation, record)


def release(pipe: Any, tenant_id: str, request_id: str) -> None:
    """Queue on ``pipe`` the end of a request's hold: drop its key's reservation and record
    (nothing charged), its token reservation, free its concurrency slot (idempotent)."""
    _end_key(pipe, tenant_id, request_id, 0, time.time())
    _free(pipe, tenant_id, request_id)


def _free(pipe: Any, tenant_id: str, request_id: str) -> None:
    pipe.hdel(reserved_key(tenant_id), request_id)
    pipe.zrem(inflight_key(tenant_id), request_id)


def _end_key(pipe: Any, tenant_id: str, request_id: str, total_tokens: int,
             now: float) -> None:
    pipe.eval(_END_KEY, 1, key_of_key(tenant_id), request_id, max(0, int(total_tokens)),
              _bucket(now), WINDOW_KEY_TTL_S, _month(now), MONTH_USAGE_TTL_S, KEY_TPM_PREFIX,
              KEY_RESERVED_PREFIX, KEY_MONTH_PREFIX)


def record_usage(pipe: Any, tenant_id: str, request_id: str, total_tokens: int,
                 now: float) -> None:
    """Queue on ``pipe`` what a request's end does to its tenant's limits and its key's:
    charge its actual tokens to the tenant's tokens-per-minute window and month, and to
    its key's (the key admission recorded for it, if any: ``lua/end_key.lua``, which drops
    the key's reservation and the record), then drop its reservation and free its slot. In
    that order: a concurrent admission may see both the charge and the reservation (too
    cautious for a moment), never neither. Idempotent but for the tenant's charge (the
    key's is charged once: its record goes with it)."""
    if total_tokens > 0:
        window, month = tpm_key(tenant_id), month_key(tenant_id, now)
        pipe.hincrby(window, _bucket(now), total_tokens)
        pipe.expire(window, WINDOW_KEY_TTL_S)
        pipe.incrby(month, total_tokens)
        pipe.expire(month, MONTH_USAGE_TTL_S)
    _end_key(pipe, tenant_id, request_id, total_tokens, now)
    _free(pipe, tenant_id, request_id)


def current_usage(client: Any, tenant_id: str, now: float) -> dict[str, int]:
    """The tenant's counters as the admission sees them: requests admitted and tokens
    charged in the window (the last minute), tokens this month, slots held."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(rpm_key(tenant_id))
    pipe.hgetall(tpm_key(tenant_id))
    pipe.get(month_key(tenant_id, now))
    pipe.zcount(inflight_key(tenant_id), f"({now!r}", "+inf")
    requests, tokens, month, concurrent = pipe.execute()
    return {
        "requests_this_minute": _window_sum(requests, now),
        "tokens_this_minute": _window_sum(tokens, now),
        "tokens_this_month": int(month or 0),
        "concurrent": int(concurrent),
    }


def current_key_usage(client: Any, key_id: str, now: float) -> dict[str, int]:
    """A key's counters as the admission sees them (``current_usage``'s sibling): its
    requests admitted and tokens charged in the window (the last minute), its tokens this
    month."""
    pipe = client.pipeline(transaction=False)
    pipe.hgetall(key_rpm_key(key_id))
    pipe.hgetall(key_tpm_key(key_id))
    pipe.get(key_month_key(key_id, now))
    requests, tokens, month = pipe.execute()
    return {
        "requests_this_minute": _window_sum(requests, now),
        "tokens_this_minute": _window_sum(tokens, now),
        "tokens_this_month": int(month or 0),
    }


def refusal_counts(client: Any, tenant_id: str | None = None) -> dict[str, int]:
    """Refusals by code since the counters began (every web process; one tenant's)."""
    key = REFUSALS_HASH if tenant_id is None else tenant_refusals_key(tenant_id)
    return {_text(k): int(v) for k, v in client.hgetall(key).items()}


def seconds_to_next_month(now: float) -> int:
    """Whole seconds from ``now`` to the start of the next UTC month (at least 1)."""
    t = time.gmtime(now)
    year, month = (t.tm_year + 1, 1) if t.tm_mon == 12 else (t.tm_year, t.tm_mon + 1)
    return max(1, math.ceil(calendar.timegm((year, month, 1, 0, 0, 0)) - now))


def _bucket(now: float) -> str:
    return str(math.floor(now))


def _window_sum(buckets: dict[Any, Any], now: float) -> int:
    oldest = math.floor(now) - WINDOW_S
    return sum(int(n) for b, n in buckets.items() if int(b) >= oldest)


def decision(reply: object) -> Refused | None:
    """The admission script's reply: None (admitted) or why it refused."""
    text = _text(reply)
    if text == "ok":
        return None
    limit, how, retry, used, reserved = text.split(":")
    return Refused(limit, how, int(retry), int(float(used)), int(float(reserved)))


def _arg(limit: int | None) -> int:
    return UNLIMITED if limit is None else int(limit)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
