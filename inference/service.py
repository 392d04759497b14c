"""A request's life seen from the web: submit, wait for the daemon's answer, follow the stream.

Shared by the REST views (JSON and SSE) and the websocket consumer. Every wait is bounded:
reads block at most ``BLOCK_MS``, and after each empty read the daemon serving the request
is checked; a dead one ends the stream with ``inference_interrupted`` (written once, under
the protocol's SET NX guard) and closes the history row.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import redis
from django.conf import settings
from django.utils import timezone

from accounts.models import ApiKey, Tenant
from inference import adapters, broker, db, history, limits, metrics, watch
from inference.auth import READ_ONLY
from inference.broker import StreamEvent
from inference.errors import ApiError, invalid, model_not_found, unavailable
from inference.models import InferenceRequest
from inference.openai_request import ParsedRequest
from wire import errors, ownership, protocol, sessions
from wire.errors import KEY_READ_ONLY, MODEL_NOT_ALLOWED, SERVICE_UNAVAILABLE

log = logging.getLogger(__name__)

# A Redis stream entry id: two unsigned 64-bit integers (at most 20 ASCII digits each).
_EVENT_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}", re.ASCII)
BLOCK_MS = 1000  # longest single XREAD BLOCK: the dead-daemon check runs at least this often
# A model seen served this recently is taken as live when a request is queued; a daemon that
# died since is caught by the wait for its answer (``_wait_first`` asks afresh).
LIVE_MODELS_MAX_AGE_S = 1.0
GUARD_GRACE_TICKS = 5  # empty reads to wait for an interrupted event someone else claimed
BACKSTOP_MARGIN_S = 5.0  # the web's own REQUEST_TIMEOUT_S waits this much past the daemon's


@dataclass(frozen=True, slots=True)
class Queued:
    """A request in the jobs stream, its history row created; ``place``: its reader's place
    in this process, held until the request is answered and read (``release``)."""

    request_id: str
    kind: str
    model: str
    created: int  # unix seconds
    watched_at: float = 0.0  # monotonic: when the enqueue wrote its watch key (0: it did not)
    deadline: float | None = None  # unix seconds: the job's (its ``timeout``)
    place: broker.ReaderPlace | None = None

    def release(self) -> None:
        """Give the reader's place back (idempotent)."""
        if self.place is not None:
            self.place.release()


@dataclass(frozen=True, slots=True)
class Submission:
    """A request the daemon answered: ``first`` is its ``accepted`` (or a terminal event);
    ``place``: its reader's place, given back when its events end (``events``)."""

    request_id: str
    kind: str
    model: str
    created: int
    first: StreamEvent
    place: broker.ReaderPlace | None = None

    def release(self) -> None:
        """Give the reader's place back (idempotent)."""
        if self.place is not None:
            self.place.release()


async def submit(api_key: ApiKey, parsed: ParsedRequest) -> Submission:
    """``enqueue`` then ``answer``."""
    return await answer(await enqueue(api_key, parsed))


async def enqueue(api_key: ApiKey, parsed: ParsedRequest) -> Queued:
    """Create the history row and queue a checked request for a daemon of its model; its
    reader holds a place in this process from here (``broker.take_place``).

    Raises ApiError: 403 ``key_read_only`` or ``model_not_allowed`` for what the key may not
    do (``check_scope``), before anything else; 404 ``model_not_found`` for a model no
    daemon serves (or an adapter the
    key's tenant does not have: inference/adapters.py); 503 no live daemon serves a model of
    ``MODELS``; 429 over a tenant limit
    or the tenant's share of this process's readers; 503 ``service_unavailable``
    (Retry-After) when this process is full, or Redis does not answer or refuses: no row is
    left queued (one already made is closed as failed) and the slot is released.
    """
    check_scope(api_key, parsed)
    try:
        await adapters.resolve(api_key, parsed)
        check_scope(api_key, parsed)  # resolved: a served base whose name holds ':'
        served = await broker.is_served(parsed.model, LIVE_MODELS_MAX_AGE_S)
    except redis.RedisError as exc:
        raise _redis_unavailable(exc) from exc
    if not served:
        if parsed.model in settings.MODELS:  # configured, its daemon not up (yet)
            raise unavailable(parsed.model)
        raise model_not_found(parsed.model_sent or parsed.model)
    request_id = parsed.request_id or str(uuid.uuid4())  # an Idempotency-Key claim's id
    # 429/503 before anything is admitted when the tenant's share or this process is full
    place = broker.take_place(str(api_key.tenant_id), request_id)
    try:
        return await _enqueue(api_key, parsed, request_id, place)
    except BaseException:
        place.release()
        raise


def check_scope(api_key: ApiKey, parsed: ParsedRequest) -> None:
    """What the key may run: a read-only key nothing (403 ``key_read_only``); a key with an
    allow-list only its models (``model_allowed``: the base model, or ``<model>:<adapter>``
    for an adapter; 403 ``model_not_allowed``, whether or not the model exists: a key
    learns nothing of models it may not use). Every request that runs passes here
    (``enqueue``: before its adapter is resolved, and after, when a name holding ':' is
    known to be a served base model's or an adapter's); the entry points that may answer
    with a replay (an Idempotency-Key's) call it first too."""
    if api_key.read_only:
        raise ApiError(KEY_READ_ONLY, READ_ONLY)
    base, adapter = _base_and_adapter(parsed)
    if not model_allowed(api_key, base, adapter):
        name = f"{base}:{adapter}" if adapter else base
        raise ApiError(MODEL_NOT_ALLOWED, f"This API key may not use the model {name!r}; "
                       "GET /v1/models lists the models it may use.", "model")


def model_allowed(api_key: ApiKey, base: str, adapter: str | None = None) -> bool:
    """Whether the key may use ``base`` (an adapter of it: ``adapter``): an empty allow-list
    allows every model; a base listed allows its adapters; an adapter may be listed alone
    (``<base>:<adapter>``). A base whose own name holds ':' (``<name>:<tag>``) is no
    adapter of ``<name>``: it is allowed by its own name only."""
    allowed = api_key.allowed_models or []
    return not allowed or base in allowed or (
        adapter is not None and f"{base}:{adapter}" in allowed)


def _base_and_adapter(parsed: ParsedRequest) -> tuple[str, str | None]:
    """The base model and adapter a request names: as resolved (``adapters.resolve``), else
    as read: ``<base>:<adapter>`` unless the whole name is a configured model's."""
    if parsed.adapter_name is not None or parsed.alias_name is None:
        return parsed.model, parsed.adapter_name or parsed.lora_name
    if parsed.model_sent in settings.MODELS:
        return parsed.model_sent, parsed.lora_name
    return parsed.model, parsed.alias_name


async def _enqueue(api_key: ApiKey, parsed: ParsedRequest, request_id: str,
                   place: broker.ReaderPlace) -> Queued:
    async with Admission(api_key, parsed, request_id) as admitted:
        row = await admitted.record()
        # watched from the enqueue script on (it writes the watch key before the job)
        async with CancelIfAbandoned(request_id, at_once=True, watch_written=True):
            job = parsed.job(request_id, str(api_key.tenant_id), api_key.tenant.max_queued)
            watched_at = time.monotonic() if watch.enabled() else 0.0  # at or before the key
            await broker.enqueue(job, watch_ms=watch.ttl_ms())
        admitted.queued()
    return Queued(request_id, parsed.kind, parsed.model, int(row.created.timestamp()),
                  watched_at, job.deadline, place)


class Admission:
    """A request's admission, from the script that admits it to its job in the queue: the
    one owner of what the admission holds (the gate's place in the model's queue, the
    tenant's concurrency slot and token reservation) and of its one rollback.

    ``async with Admission(...) as admitted:`` runs the admission (the model queue's gate,
    then the tenant's limits: one script, ``limits.admit_key``) on the event loop, so a
    refusal (429, 503) never waits behind other requests' rows on the database thread;
    a refusal raises its ApiError and holds nothing. Inside, ``record`` creates the history
    row and the caller queues the job, then says so (``queued``): from there the request is
    the daemons'. Any other way out of the block (an exception, a cancellation, a block
    that ends without ``queued``) gives everything back, once: the slot and reservation
    (``limits.release_soon``: once Redis answers if it does not now), the gate's place
    (``broker.unadmit``, else it lapses after ADMIT_HOLD_S) and, when the row exists, the
    row, closed cancelled (its caller went away) or failed ``service_unavailable`` (Redis
    refused the job). A RedisError on the way out is the 503 ``_redis_unavailable`` says.

    ``_enqueue`` is its one user: every entry point that admits (the REST views, JSON and
    SSE, the embeddings and vocabulary views, the websocket consumer, an Idempotency-Key's
    first request) reaches it through ``enqueue`` or ``submit``."""

    def __init__(self, api_key: ApiKey, parsed: ParsedRequest, request_id: str) -> None:
        self.api_key = api_key
        self.parsed = parsed
        self.request_id = request_id
        self._creation: asyncio.Future[InferenceRequest] | None = None
        self._done = False  # queued, or given back: nothing (more) to give back
        self._session_begun = False  # a session's turn marked busy (or made) for it

    async def __aenter__(self) -> Admission:
        history_tokens = 0
        try:
            if self.parsed.session_id is not None:  # the session's turn first: 404, 409, 429
                self._session_begun = True  # (a reply lost on the way: it may have begun)
                try:
                    history_tokens = await _begin_turn(self.api_key, self.parsed,
                                                       self.request_id)
                except ApiError:
                    self._session_begun = False  # refused: it holds nothing
                    raise
            await limits.admit_key(self.api_key, self.request_id,
                                   reserve=_reservation(self.parsed) + history_tokens,
                                   model=self.parsed.model)
        except ApiError:
            await self._end_turn()  # refused: the script counted nothing (but the refusal)
            raise
        except BaseException as exc:  # the script may have run: its reply may be all we lost
            await self._roll_back(exc)
            if isinstance(exc, redis.RedisError):
                raise _redis_unavailable(exc) from exc
            raise
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._done:
            return
        await self._roll_back(exc)
        if isinstance(exc, redis.RedisError):
            raise _redis_unavailable(exc) from exc

    async def record(self) -> InferenceRequest:
        """Create the request's history row (on the database thread, which finishes it even
        when the caller is cancelled meanwhile: the rollback then waits for it)."""
        self._creation = asyncio.ensure_future(
            db.run(_record, self.api_key, self.parsed, self.request_id))
        return await asyncio.shield(self._creation)

    def queued(self) -> None:
        """The job is in the queue: nothing is given back from here."""
        self._done = True

    async def _roll_back(self, exc: BaseException | None) -> None:
        """The one rollback (see the class)."""
        if self._done:
            return
        self._done = True
        tenant_id, request_id = self.api_key.tenant_id, self.request_id
        try:
            if await self._row_made():
                if isinstance(exc, redis.RedisError):
                    log.warning("Redis refused the job of request %s: %r", request_id, exc)
                    await db.run(history.close_failed, request_id, SERVICE_UNAVAILABLE)
                else:
                    await db.run(history.abandon, request_id)
        finally:
            await limits.release_soon(tenant_id, request_id)
            await broker.unadmit(self.parsed.model, str(tenant_id), request_id)
            await self._end_turn()

    async def _end_turn(self) -> None:
        """The session's turn ends unchanged (never raises: a turn whose end is lost stays
        busy until its deadline passes)."""
        if not self._session_begun:
            return
        self._session_begun = False
        parsed = self.parsed
        tenant = str(self.api_key.tenant_id)
        try:
            if parsed.session_mode == "new":  # never used: it holds no place under the cap
                keys = [sessions.key(parsed.session_id), sessions.tenant_key(tenant)]
                await broker.async_client().eval(sessions.DELETE, len(keys), *keys, tenant,
                                                 parsed.session_id)
                return
            keys, args = sessions.end_args(parsed.session_id, tenant, self.request_id, b"",
                                           settings.SESSION_TTL_S, time.time())
            await broker.async_client().eval(sessions.END, len(keys), *keys, *args)
        except redis.RedisError as exc:
            log.warning("could not end session %s's turn %s: %r", parsed.session_id,
                        self.request_id, exc)

    async def _row_made(self) -> bool:
        """Whether ``record`` made the row (waiting for a creation its caller left)."""
        creation = self._creation
        if creation is None or creation.cancelled():
            return False
        try:
            await creation
        except BaseException:
            return False
        return True


async def session_info(api_key: ApiKey, session_id: str) -> dict[str, Any]:
    """A session of the key's tenant: model, turns, tokens held, whether a turn runs, and
    when it expires (unix s). ApiError 404 ``no_session``."""
    if sessions.is_id(session_id):
        try:
            client = broker.async_client()
            pipe = client.pipeline(transaction=False)
            pipe.hmget(sessions.key(session_id), "tenant", "model", "turns", "n_tokens", "busy")
            pipe.ttl(sessions.key(session_id))
            (tenant, model, turns, n_tokens, busy), ttl = await pipe.execute()
        except redis.RedisError as exc:
            raise _redis_unavailable(exc) from exc
        if tenant is not None and protocol.as_text(tenant) == str(api_key.tenant_id):
            return {"model": protocol.as_text(model), "turns": int(turns or 0),
                    "tokens": int(n_tokens or 0), "busy": bool(busy),
                    "expires_at": int(time.time() + max(0, ttl))}
    raise ApiError(errors.NO_SESSION, "No such session.", param="session_id")


async def delete_session(api_key: ApiKey, session_id: str) -> None:
    """Delete a session of the key's tenant (a turn running keeps running; its end saves
    nothing). ApiError 404 ``no_session``."""
    if sessions.is_id(session_id):
        tenant = str(api_key.tenant_id)
        keys = [sessions.key(session_id), sessions.tenant_key(tenant)]
        try:
            deleted = await broker.async_client().eval(sessions.DELETE, len(keys), *keys,
                                                       tenant, session_id)
        except redis.RedisError as exc:
            raise _redis_unavailable(exc) from exc
        if deleted:
            return
    raise ApiError(errors.NO_SESSION, "No such session.", param="session_id")


async def _begin_turn(api_key: ApiKey, parsed: ParsedRequest, request_id: str) -> int:
    """Begin a session's turn (wire/sessions.py BEGIN); returns the tokens the session
    holds (a continued turn adds them to its reservation). ApiError 404 ``no_session``, 409
    ``session_busy``, 429 ``too_many_sessions``, 400 ``session_model_mismatch``."""
    tenant = str(api_key.tenant_id)
    now = time.time()
    timeout_s = parsed.timeout_s or settings.REQUEST_TIMEOUT_S
    keys = [sessions.key(parsed.session_id), sessions.tenant_key(tenant)]
    args = [parsed.session_mode, parsed.session_id, tenant, parsed.model, request_id,
            now + timeout_s + settings.ACCEPT_TIMEOUT_S + sessions.BUSY_MARGIN_S,
            settings.SESSION_TTL_S, settings.SESSIONS_PER_TENANT, now]
    reply = await broker.async_client().eval(sessions.BEGIN, len(keys), *keys, *args)
    outcome = protocol.as_text(reply[0])
    if outcome == "ok":
        return int(reply[1])
    if outcome == errors.SESSION_BUSY:
        raise ApiError(outcome, "The session's previous turn is still running; send this "
                       "turn when it has ended.", param="session_id")
    if outcome == errors.TOO_MANY_SESSIONS:
        raise ApiError(outcome, f"The tenant holds {settings.SESSIONS_PER_TENANT} sessions "
                       "(SESSIONS_PER_TENANT); delete one (DELETE /v1/sessions/<id>) or let "
                       "one expire.", param="session_id", headers={"Retry-After": "60"})
    if outcome == errors.SESSION_MODEL_MISMATCH:
        raise invalid("model", f"The session holds a conversation with the model "
                      f"{protocol.as_text(reply[1])!r}.", errors.SESSION_MODEL_MISMATCH)
    raise ApiError(errors.NO_SESSION, "No such session (unknown, expired or deleted): send "
                   'the full history with "session_id": "new".', param="session_id")


def _redis_unavailable(exc: redis.RedisError) -> ApiError:
    """Redis away or refusing (a full or read-only Redis): 503 with Retry-After."""
    if isinstance(exc, ApiError):
        return exc  # RedisBusy, RedisDown: typed already
    if isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
        return broker.RedisDown()
    return broker.RedisDown("The service's queue (Redis) refused this request; try again "
                            "shortly.")


def _reservation(parsed: ParsedRequest) -> int:
    """The tokens the request may use at most (its limits reservation)."""
    # a vocabulary request generates nothing (its reservation: the prompt's bound alone)
    generates = parsed.kind not in protocol.VOCAB_KINDS | {protocol.EMBEDDING_KIND}
    completion = parsed.params.get("max_tokens") if generates else 0
    return limits.reservation(parsed.prompts or parsed.prompt, parsed.messages, completion,
                              parsed.choices)


def _record(api_key: ApiKey, parsed: ParsedRequest, request_id: str) -> InferenceRequest:
    """An admitted request's history row (on the database thread)."""
    return history.create(request_id, api_key.tenant_id, api_key.pk, parsed.kind,
                          parsed.shown_model, parsed.session)


async def answer(queued: Queued) -> Submission:
    """Wait for the daemon's first event. Raises ApiError: 503 when no daemon takes the job;
    the daemon's refusal (queue_full 503, context_length_exceeded 400, ...); the reader's
    place is given back then."""
    # the key the enqueue wrote still has most of its grace to live: no second write
    written = bool(queued.watched_at) and time.monotonic() - queued.watched_at < watch.renew_s()
    try:
        async with CancelIfAbandoned(queued.request_id, watch_written=written):
            first = await _wait_first(queued.request_id, queued.model, queued.deadline)
    except BaseException:
        queued.release()
        raise
    if first.kind == protocol.ERROR:
        queued.release()
        metrics.observe_end(first.data, first.kind)
        raise ApiError.from_event(first.data)
    return Submission(queued.request_id, queued.kind, queued.model, queued.created, first,
                      queued.place)


async def _wait_first(request_id: str, model: str, deadline: float | None) -> StreamEvent:
    with broker.reader(request_id) as follower:
        return await _wait_first_read(request_id, model, follower, deadline)


async def _wait_first_read(request_id: str, model: str, follower: broker.Follower,
                           deadline: float | None = None) -> StreamEvent:
    """The job waits in the model's queue in Redis until a daemon has room for it (a fleet
    of them: wire/queue.py), so waiting is no failure while a live daemon of the model takes
    jobs; up to the job's ``deadline`` (unix s; then 504 ``timeout``, and it is cancelled:
    no daemon runs it later). A daemon that dies or restarts meanwhile leaves it there for
    the next one: no live daemon is a wait of RECOVERY_TIMEOUT_S, and live daemons that
    take no jobs (drained) a wait of ACCEPT_TIMEOUT_S, then 503 ``scheduler_unavailable``."""
    now = time.monotonic()
    stalled_at = now + settings.ACCEPT_TIMEOUT_S  # pushed on while a daemon takes jobs
    ends_at = (now + max(0.0, deadline - time.time()) + BACKSTOP_MARGIN_S
               if deadline is not None else None)
    none_since: float | None = None  # when no live daemon served the model any more
    while True:
        events = await broker.read_events(request_id, "0-0", BLOCK_MS, count=1,
                                          follower=follower)
        if events:
            return events[0]
        now = time.monotonic()
        live, taking = await broker.taking_models()
        if model in live:
            none_since = None
        else:
            none_since = none_since or now
        if model in taking:
            stalled_at = now + settings.ACCEPT_TIMEOUT_S
        if ends_at is not None and now > ends_at:
            await broker.publish_cancel(request_id)  # a daemon that takes it later ends it
            await close_row(request_id, errors.TIMEOUT)
            raise ApiError(errors.TIMEOUT, "The request waited in the queue past its "
                           "deadline (its timeout, or REQUEST_TIMEOUT_S) and was not run.")
        if now > stalled_at or (none_since and now - none_since >= settings.RECOVERY_TIMEOUT_S):
            await broker.publish_cancel(request_id)  # a daemon that comes later must not run it
            await close_row(request_id, protocol.SCHEDULER_UNAVAILABLE)
            raise unavailable(model)


def vocab_answer(end: StreamEvent) -> dict[str, Any]:
    """A tokenize/detokenize/embeddings request's answer: its ``done`` event's ``result``.
    An error end is its ApiError; one cancelled before its answer is 409
    ``request_cancelled``."""
    if end.kind == protocol.ERROR:
        raise ApiError.from_event(end.data)
    result = end.data.get("result") if end.kind == protocol.DONE else None
    if not isinstance(result, dict):
        reason = end.data.get("finish_reason")
        if reason == "cancelled":
            raise ApiError(errors.CANCELLED, "The request was cancelled before its answer.")
        raise ApiError(errors.INTERNAL_ERROR, f"The request ended without an answer "
                       f"(finish_reason {reason!r}).")
    return result


async def vocab_end(submission: Submission) -> StreamEvent:
    """The terminal event of a request with one answer: the first event (tokenize), or the
    one after ``accepted`` (embeddings, computed in the daemon's loop), followed like any
    request's (a dead daemon, the backstop deadline, a client that goes away)."""
    if submission.first.is_terminal:
        submission.release()
        metrics.observe_end(submission.first.data, submission.first.kind)
        return submission.first
    collected = await collect(submission)
    return collected.final


class ReaderEvents:
    """A reader's events (``events``, ``resume``) with what it holds while it reads: its
    place in this process (``broker.take_place``) and a resume's slot (tenant id, member).
    Both are given back when the events end or fail, or when it is closed (``aclose``),
    started or not: a reader cancelled before its first read (as ``CancelIfAbandoned``
    enters) gives them back at once, not when it is collected."""

    def __init__(self, events: AsyncGenerator[StreamEvent | None, None],
                 place: broker.ReaderPlace | None, slot: tuple[str, str] | None = None) -> None:
        self._events = events
        self._place = place
        self._slot = slot

    def __aiter__(self) -> ReaderEvents:
        return self

    async def __anext__(self) -> StreamEvent | None:
        try:
            return await anext(self._events)
        except BaseException:  # the end, or a failure: nothing more is read
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """Close the events; give the place and the slot back (once)."""
        try:
            await self._events.aclose()
        finally:
            if self._place is not None:
                self._place.release()
            slot, self._slot = self._slot, None
            if slot is not None:
                await limits.free_slot_quietly(*slot)


def events(submission: Submission) -> ReaderEvents:
    """The submission's first event, then the rest of its stream (see ``follow``); its
    reader's place is given back at the end, or when they are closed (``ReaderEvents``)."""
    return ReaderEvents(_events(submission), submission.place)


async def _events(submission: Submission) -> AsyncGenerator[StreamEvent | None, None]:
    yield submission.first
    if submission.first.is_terminal:
        metrics.observe_end(submission.first.data, submission.first.kind)
        return
    daemon_id = submission.first.data.get("daemon_id")
    assert submission.first.entry_id is not None
    rest = follow(submission.request_id, submission.first.entry_id, submission.model,
                  daemon_id, resuming=False)
    async with aclosing(rest):
        async for event in rest:
            if event is not None and event.is_terminal:
                # once per submission, never on resumes
                metrics.observe_end(event.data, event.kind)
            yield event


async def follow(request_id: str, after: str, model: str, daemon_id: str | None = None,
                 resuming: bool = True) -> AsyncIterator[StreamEvent | None]:
    """Events after ``after`` up to the terminal one; ``None`` after each idle second.

    Ends with a synthetic ``error`` (no entry id) if the request outlives REQUEST_TIMEOUT_S.
    ``resuming``: a reader coming back may ask after the end; a live submission cannot.
    """
    with broker.reader(request_id, after) as follower:
        async with aclosing(_follow(request_id, after, model, daemon_id, resuming,
                                    follower)) as events:
            async for event in events:
                yield event


async def _follow(request_id: str, after: str, model: str, daemon_id: str | None,
                  resuming: bool, follower: broker.Follower
                  ) -> AsyncIterator[StreamEvent | None]:
    if resuming and after != "0-0" and await _ended_before(request_id, after):
        return
    if daemon_id is None:
        first = await broker.first_event(request_id)
        if first is not None and first.kind == protocol.ACCEPTED:
            daemon_id = first.data.get("daemon_id")
    # a backstop: the daemon ends a request at its deadline (typed, with its usage)
    deadline = time.monotonic() + settings.REQUEST_TIMEOUT_S + BACKSTOP_MARGIN_S
    guard_ticks = 0
    gone_since: float | None = None  # when the daemon serving it was first seen gone
    while True:
        try:
            batch = await broker.read_events(request_id, after, BLOCK_MS, follower=follower)
        except (redis.ConnectionError, redis.TimeoutError):  # Redis stayed away (retried)
            yield _synthetic_error(errors.SERVICE_UNAVAILABLE,
                                   "The service lost its queue (Redis); the request's end is "
                                   "unknown. Resume it with its last event id.")
            return
        for event in batch:
            after = event.entry_id or after
            if event.kind == protocol.ACCEPTED:
                daemon_id = event.data.get("daemon_id")
                gone_since = None
                if event.data.get("resumed"):  # another daemon took it over: not news
                    continue
            yield event
            if event.is_terminal:
                return
        if batch:
            continue
        yield None
        if guard_ticks:
            guard_ticks += 1
            if guard_ticks > GUARD_GRACE_TICKS:
                yield _synthetic_error(protocol.INFERENCE_INTERRUPTED, "The daemon stopped.")
                return
        elif not await _serving(daemon_id, model):
            # A daemon that died is a pause: a live one (or its restart) continues the
            # request; only when none has within RECOVERY_TIMEOUT_S is it interrupted.
            now = time.monotonic()
            gone_since = gone_since or now
            if now - gone_since >= settings.RECOVERY_TIMEOUT_S:
                taken_by = await _interrupt(request_id, daemon_id)
                if taken_by is None:
                    guard_ticks = 1
                else:  # a daemon took it over as we gave up: follow it
                    daemon_id, gone_since = taken_by, None
        elif time.monotonic() > deadline:
            await broker.publish_cancel(request_id)
            yield _synthetic_error("timeout", "The request took too long and was cancelled.")
            return
        else:
            gone_since = None


RESUME_SLOT_TTL_S = 30.0  # a resume's slot expires unless its reader renews it...
RESUME_SLOT_RENEW_S = 10.0  # ...this often while it reads
EXPIRED_GRACE_S = 5.0  # an unfinished request with no stream this long after its accept
# timeout never got one: nobody took it and the web that queued it is gone


async def resume(api_key: ApiKey, row: InferenceRequest, after: str) -> ReaderEvents:
    """The events of ``row`` after ``after`` (``follow``), for a client coming back; checked
    before the first byte goes out, the cheapest checks first. Raises ApiError: 429 at once
    when it replays a finished request while this process remembers the tenant's replays
    refused (``limits.refuse_remembered_replay``: no Redis); 404 ``events_expired`` when the
    stream is gone or will never come; 503 when this web process is full; 429
    ``too_many_streams`` past the tenant's share of this process's readers or the readers
    one request may have (``broker.take_place``); 429 when the tenant has
    ``max_concurrent`` requests and resumes already (a resume holds a slot in the tenant's
    in-flight set for as long as it reads); 429 when it replays a finished request past
    the tenant's replay rate or requests per minute (``limits.count_replay``: a replay
    counts once it has its slot). None of it waits for the database thread (but for the
    limits of a key loaded over a second ago)."""
    request_id = str(row.id)
    replay = row.finished is not None  # a stored stream sent again: a request's worth
    if replay:
        await limits.refuse_remembered_replay(api_key)
    if not await broker.stream_exists(request_id) and _no_stream_coming(row):
        raise ApiError("events_expired", "The events of this request have expired.")
    tenant_id = str(api_key.tenant_id)
    place = broker.take_place(tenant_id, request_id)
    try:
        member = await limits.take_resume_slot(api_key, ttl_s=RESUME_SLOT_TTL_S)
        if replay:
            try:
                await limits.count_replay(api_key)
            except BaseException:
                await limits.free_slot_quietly(tenant_id, member)
                raise
    except BaseException:
        place.release()
        raise
    events = _renewing_slot(follow(request_id, after, adapters.base_of(row.model)), tenant_id,
                            member)
    return ReaderEvents(events, place, (tenant_id, member))


def _no_stream_coming(row: InferenceRequest) -> bool:
    if row.finished is not None:
        return True
    age = (timezone.now() - row.created).total_seconds()
    return age > settings.ACCEPT_TIMEOUT_S + EXPIRED_GRACE_S


async def _renewing_slot(events: AsyncGenerator[StreamEvent | None, None], tenant_id: str,
                         member: str) -> AsyncGenerator[StreamEvent | None, None]:
    """``events``, renewing the resume's slot while they last (``ReaderEvents`` frees it)."""
    renewed = time.monotonic()
    async with aclosing(events) as stream:
        async for event in stream:
            if time.monotonic() - renewed >= RESUME_SLOT_RENEW_S:
                renewed = time.monotonic()
                await limits.renew_slot(tenant_id, member, RESUME_SLOT_TTL_S)
            yield event


@dataclass(frozen=True, slots=True)
class Collected:
    """A whole request's output, for a non-streaming reply: per choice (index)."""

    texts: list[str]
    final: StreamEvent  # its terminal event
    logprobs: list[list[dict[str, Any]]]  # per choice, the wire's entries (when it asked)

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect(submission: Submission, n: int = 1) -> Collected:
    """All text of a request's ``n`` choices and its terminal event (non-streaming)."""
    collected = await collect_events(submission.request_id, events(submission), n)
    if collected is None:  # pragma: no cover
        raise AssertionError("events() ended without a terminal event")
    return collected


async def collect_events(request_id: str,
                         stream_of: ReaderEvents | AsyncGenerator[StreamEvent | None, None],
                         n: int = 1) -> Collected | None:
    """The text of ``stream_of``'s ``n`` choices and its terminal event, read while the
    request is held (``CancelIfAbandoned``); None when it ended without one. ``stream_of``
    is closed on every way out."""
    try:
        return await _collect(request_id, stream_of, n)
    finally:  # also when cancelled before _collect started it: a ReaderEvents' place goes back
        await stream_of.aclose()


async def _collect(request_id: str,
                   stream_of: ReaderEvents | AsyncGenerator[StreamEvent | None, None],
                   n: int) -> Collected | None:
    parts: list[list[str]] = [[] for _ in range(n)]
    logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
    async with CancelIfAbandoned(request_id), aclosing(stream_of) as stream:
        async for event in stream:
            if event is None:
                continue
            if event.kind == protocol.TOKEN:
                index = event.data.get("index") or 0
                if type(index) is not int or not 0 <= index < n:
                    continue  # not a choice of this request (a rogue writer)
                parts[index].append(event.data.get("text", ""))
                logprobs[index] += event.data.get("logprobs") or ()
            elif event.kind == protocol.ACCEPTED and event.data.get("echo"):
                echo = event.data["echo"]  # a continuation's accepted has none
                for i, choice in enumerate(parts):  # one text for all, or each choice's
                    if isinstance(echo, str) or i < len(echo):
                        choice.insert(0, echo if isinstance(echo, str) else str(echo[i]))
            elif event.is_terminal:
                return Collected(["".join(p) for p in parts], event, logprobs)
    return None


async def _serving(daemon_id: str | None, model: str) -> bool:
    if daemon_id:
        return await broker.daemon_alive(daemon_id)
    return model in await broker.live_models()


async def _interrupt(request_id: str, daemon_id: str | None) -> str | None:
    """Give up on a request no daemon took over: write its ``inference_interrupted`` (if its
    owner is still ``daemon_id``) and close its row. None when its end is written (here or
    by whoever won); else the daemon that owns it now."""
    who = f"daemon {daemon_id}" if daemon_id else "no scheduler daemon"
    if daemon_id is None:
        await broker.publish_cancel(request_id)
    message = f"The request was interrupted: {who} is gone and none took it over."
    if await broker.give_up(request_id, daemon_id or "", message):
        await close_row(request_id, protocol.INFERENCE_INTERRUPTED)
        return None
    owner = await broker.owner_of(request_id)
    if owner is None or owner == ownership.WEB or owner == daemon_id:
        return None  # ended (its terminal event is on its way) or given up elsewhere
    return owner


async def _ended_before(request_id: str, after: str) -> bool:
    """Whether the stream's terminal event is at or before ``after`` (nothing left to send)."""
    last = await broker.last_event(request_id)
    return (last is not None and last.is_terminal
            and protocol.entry_order(last.entry_id) <= protocol.entry_order(after))


def is_event_id(value: object) -> bool:
    """Whether ``value`` is a Redis stream entry id ("1712345678901-0"): ASCII digits, the
    whole string (no trailing newline), each part within 64 bits."""
    if not isinstance(value, str) or _EVENT_ID.fullmatch(value) is None:
        return False
    ms, _, seq = value.partition("-")
    return int(ms) < 2**64 and int(seq) < 2**64


def _synthetic_error(code: str, message: str) -> StreamEvent:
    return StreamEvent(None, protocol.ERROR, {"code": code, "message": message})


class CancelIfAbandoned:
    """Around a reader of a request: the request is watched while the reader is inside
    (inference/watch.py), and cancelled if the reader goes away before the end (its task is
    cancelled, e.g. on a client's disconnect, or the generator is closed early): by the
    daemon, RESUME_GRACE_S later, unless a reader comes back by then (a resume). ``at_once``
    (or RESUME_GRACE_S 0): the cancel is published as the reader leaves (a request whose
    client cannot have learnt its id yet). ``cancels`` False: the reader never cancels (a
    read-only key's: it reads others' requests and ends none)."""

    def __init__(self, request_id: str, at_once: bool = False,
                 watch_written: bool = False, cancels: bool = True) -> None:
        self.request_id = request_id
        self.at_once = at_once
        self.cancels = cancels
        self.ended = False  # set by a reader that has seen the terminal event: no cancel
        self._watching = watch.Watching(request_id, written=watch_written)

    async def __aenter__(self) -> CancelIfAbandoned:
        await self._watching.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._watching.__aexit__(kind, exc, tb)
        if self.ended or not self.cancels or (watch.enabled() and not self.at_once):
            return  # past the grace, the daemon cancels it (scheduler_daemon/service/watch.py)
        if kind is not None and issubclass(kind, (asyncio.CancelledError, GeneratorExit)):
            await cancel_quietly(self.request_id)


async def streamed(request_id: str, events: AsyncIterator[StreamEvent | None], opening: bytes,
                   keepalive: bytes, cancels: bool = True) -> AsyncIterator[StreamEvent | bytes]:
    """A streamed response's events, for its SSE writer: ``opening`` first (the server sends
    the headers with the first body bytes), ``keepalive`` after SSE_KEEPALIVE_S without an
    event (an idle tick is one empty read, BLOCK_MS), and each event as it comes, all under
    ``CancelIfAbandoned``: a client that goes away mid-stream leaves its request to be
    resumed within the grace (``cancels`` False: never cancelled by this reader, a
    read-only key's). The writer iterates it under ``aclosing``."""
    every = max(1, round(settings.SSE_KEEPALIVE_S * 1000 / BLOCK_MS))
    idle = 0
    # the events are closed last: a task cancelled while the guard enters gives back their
    # reader place (ReaderEvents) at once, not when they are collected
    async with aclosing(events) as stream, CancelIfAbandoned(request_id, cancels=cancels):
        yield opening
        async for event in stream:
            if event is None:
                idle += 1
                if idle % every == 0:
                    yield keepalive
                continue
            idle = 0
            yield event


async def cancel_quietly(request_id: str) -> None:
    """Publish a cancel; never raise (used while unwinding)."""
    try:
        await asyncio.wait_for(broker.publish_cancel(request_id), timeout=2)
    except Exception:  # the client is gone either way; the daemon's timeout is the backstop
        log.warning("could not publish the cancel of %s", request_id, exc_info=True)


# -- history rows ----------------------------------------------------------------------------


@db.sync
def close_row(request_id: str, error_code: str) -> None:
    """Close a row the daemon cannot close (it is gone): status error; free its
    concurrency slot (the daemon frees it only when it writes the end)."""
    tenant_id = history.close_interrupted(request_id, error_code)
    if tenant_id is not None:
        limits.release_sync(tenant_id, request_id)


@db.sync
def owned_row(tenant: Tenant, request_id: str) -> InferenceRequest:
    """The tenant's row, else 404 (another tenant's id looks exactly like an unknown one)."""
    row = InferenceRequest.objects.for_tenant(tenant).filter(id=request_id).first()
    if row is None:
        raise ApiError("not_found", f"No request with id {request_id}.")
    return row
