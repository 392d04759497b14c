"""``Idempotency-Key`` on the completion endpoints: a retry returns the original request.

The first request with a key claims it for its tenant: a Redis ``SET NX`` of
``protocol.idempotency_key(tenant, sha256(key))`` → ``{"request_id", "body"}`` (the body's
sha256, endpoint included) for ``IDEMPOTENCY_TTL_S``; it then runs under that request id,
its events stream kept as long (``Job.retention_s``). A later request with the key and the
same body follows the original's events from the start (``service.resume``): its result,
or its stream, under the same id, whether the original still runs or ended. Another body:
409 ``idempotency_key_reused``. A request that never ran (refused before a daemon accepted
it: 400, 429, 503, or its client left) gives the key back, so that a retry runs it.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import redis
from django.conf import settings

from accounts.models import ApiKey
from inference import broker, service
from inference.broker import StreamEvent
from inference.errors import ApiError, invalid
from inference.models import InferenceRequest
from inference.openai_request import ParsedRequest
from wire import errors, protocol, sessions
from wire.scripts import lua

log = logging.getLogger(__name__)

HEADER = "Idempotency-Key"
MAX_KEY_CHARS = 255
# Printable ASCII, no space at either end (a proxy may trim those).
KEY_PATTERN = r"^[!-~]([ -~]*[!-~])?$"
_KEY = re.compile(KEY_PATTERN, re.ASCII)
CLAIM_TRIES = 3  # a key given back between our SET NX and GET is claimed again
ROW_POLL_S = 0.05
# Deletes the claim only while it is still ours (a later claim of the key is left alone).
_RELEASE = lua("release_claim")


@dataclass(frozen=True, slots=True)
class Claim:
    """A key's record: ours to run (``won``), or the original request's to replay."""

    redis_key: str
    record: bytes
    request_id: str
    won: bool


@dataclass(slots=True)
class Replay:
    """The original request of a retry: its row's identity and its events from the first."""

    request_id: str
    kind: str
    model: str
    created: int
    first: StreamEvent
    rest: service.ReaderEvents

    def events(self) -> ReplayEvents:
        """Every event from the first, as ``service.events`` gives a fresh submission's."""
        return ReplayEvents(self.first, self.rest)

    async def collect(self, n: int = 1) -> service.Collected:
        """All text and the terminal event (``service.collect``'s twin)."""
        collected = await service.collect_events(self.request_id, self.events(), n)
        if collected is not None:
            return collected
        raise ApiError(errors.INFERENCE_INTERRUPTED, "The request's events ended early.")


class ReplayEvents:
    """A retry's events: its first event, then the rest of its stream; closing them
    (``aclose``) closes the rest, started or not, so a reader cancelled before its first
    read gives its place back at once (``service.ReaderEvents``)."""

    def __init__(self, first: StreamEvent, rest: service.ReaderEvents) -> None:
        self._first: StreamEvent | None = first
        self._rest = rest
        self._ended = first.is_terminal

    def __aiter__(self) -> ReplayEvents:
        return self

    async def __anext__(self) -> StreamEvent | None:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        if self._ended:
            await self.aclose()
            raise StopAsyncIteration
        return await anext(self._rest)  # which closes itself when it ends or fails

    async def aclose(self) -> None:
        self._ended = True
        await self._rest.aclose()


def key_digest(headers: Mapping[str, str]) -> str | None:
    """The sha256 of the request's Idempotency-Key (None: no header); 400 when it is not
    1 to MAX_KEY_CHARS printable ASCII characters."""
    value = headers.get(HEADER)
    if value is None:
        return None
    if len(value) > MAX_KEY_CHARS or not _KEY.fullmatch(value):
        raise invalid(HEADER, f"{HEADER} must be 1 to {MAX_KEY_CHARS} printable ASCII "
                              "characters.")
    return hashlib.sha256(value.encode("ascii")).hexdigest()


def body_digest(kind: str, body: object) -> str:
    """What makes two requests the same: the endpoint and the body's JSON, keys sorted (a
    client may serialize it differently on a retry)."""
    canonical = json.dumps([kind, body], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


async def submit(api_key: ApiKey, parsed: ParsedRequest, key: str,
                 body: str) -> service.Submission | Replay:
    """``service.submit`` once per (tenant, key): the first request runs, its retries get a
    ``Replay``. ``key``: ``key_digest``; ``body``: ``body_digest``. Raises ApiError: 409
    another body under the key; what ``service.submit`` and ``service.resume`` raise."""
    tenant_id = str(api_key.tenant_id)
    for _ in range(CLAIM_TRIES):
        claim = await _claim(tenant_id, key, body)
        if parsed.session_mode == "new":  # its retries name the session its first run made
            made = sessions.id_for_request(settings.SECRET_KEY, tenant_id, claim.request_id)
            if parsed.session == parsed.session_id:
                parsed.session = made
            parsed.session_id = made
        if claim.won:
            parsed.request_id, parsed.retention_s = claim.request_id, protocol.IDEMPOTENCY_TTL_S
            try:
                return await service.submit(api_key, parsed)
            except BaseException:  # it never ran: a retry must run it
                await release(claim)
                raise
        replay = await _replay(api_key, claim)
        if replay is not None:
            return replay
    raise _busy()


async def _claim(tenant_id: str, key: str, body: str) -> Claim:
    client = broker.async_client()
    redis_key = protocol.idempotency_key(tenant_id, key)
    try:
        for _ in range(CLAIM_TRIES):
            request_id = str(uuid.uuid4())
            record = json.dumps({"request_id": request_id, "body": body},
                                separators=(",", ":")).encode()
            if await client.set(redis_key, record, nx=True, ex=protocol.IDEMPOTENCY_TTL_S):
                return Claim(redis_key, record, request_id, True)
            held = await client.get(redis_key)
            if held is None:
                continue  # given back in between
            original = json.loads(held)
            if original["body"] != body:
                raise ApiError("idempotency_key_reused", f"This {HEADER} was used with another "
                               "request body; use a new key for a new request.", HEADER)
            return Claim(redis_key, held, original["request_id"], False)
    except redis.RedisError:
        log.warning("the idempotency key could not be claimed", exc_info=True)
    raise _busy()


async def release(claim: Claim) -> None:
    """Give the key back if it still holds ``claim``; never raises (used while unwinding)."""
    try:
        client = broker.async_client()
        await asyncio.wait_for(client.eval(_RELEASE, 1, claim.redis_key, claim.record), 2)
    except Exception:  # the key then expires with its TTL; a retry meanwhile replays
        log.warning("could not give back the idempotency key of %s", claim.request_id,
                    exc_info=True)


async def _holds(claim: Claim) -> bool:
    return await broker.async_client().get(claim.redis_key) == claim.record


async def _replay(api_key: ApiKey, claim: Claim) -> Replay | None:
    """The original's events from the start; None when its key was given back meanwhile
    (it never ran: the caller claims the key again)."""
    row = await _original_row(api_key, claim)
    if row is None:
        return None
    request_id = str(row.id)
    try:
        events = await service.resume(api_key, row, "0-0")
    except ApiError as error:
        if error.code == "events_expired" and not await _holds(claim):
            return None  # queued, then given back (its enqueue failed)
        raise
    try:
        first = await _first(events)
    except BaseException:
        await events.aclose()
        raise
    if first.kind == protocol.ERROR and first.data.get("status"):
        await events.aclose()
        raise ApiError.from_event(first.data)  # the original's refusal, answered alike
    created = int(row.created.timestamp())
    return Replay(request_id, row.kind, row.model, created, first, events)


async def _original_row(api_key: ApiKey, claim: Claim) -> InferenceRequest | None:
    """The original's history row, once its request has recorded it (it claims the key
    first); None when the key was given back, or is stale (its request never recorded a
    row within ACCEPT_TIMEOUT_S: its web process died in between)."""
    deadline = time.monotonic() + settings.ACCEPT_TIMEOUT_S
    while True:
        try:
            return await service.owned_row(api_key.tenant, claim.request_id)
        except ApiError as error:
            if error.code != "not_found":
                raise
        if not await _holds(claim):
            return None
        if time.monotonic() > deadline:
            await release(claim)
            return None
        await asyncio.sleep(ROW_POLL_S)


async def _first(events: AsyncIterator[StreamEvent | None]) -> StreamEvent:
    async for event in events:
        if event is not None:
            return event
    raise ApiError(errors.INFERENCE_INTERRUPTED, "The original request has no events.")


def _busy() -> ApiError:
    return ApiError(errors.SERVICE_UNAVAILABLE, f"The request with this {HEADER} could not be "
                    "looked up right now; retry.", headers={"Retry-After": "1"})
