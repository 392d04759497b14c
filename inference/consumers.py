"""The websocket API (/ws/v1/stream): several streamed requests on one socket.

Tokens are read from Redis by one task per request (``service.follow``), never through the
channel layer. A client that closes the socket on purpose (``DELIBERATE_CLOSE_CODES``)
cancels every request still running on it; a socket that drops (any other code: the
connection was lost) leaves them running for RESUME_GRACE_S, for a ``resume`` on a new
socket, after which the daemon cancels those nobody resumed. The message shapes are in
docs/api.md.

Robustness (issue 12): a malformed message is answered with an ``error`` naming the problem
and the socket carries on; a socket that has not authenticated within ``AUTH_TIMEOUT_S`` is
closed (4401); any exception in the consumer itself closes the socket (1011) after
cancelling its requests; a key that is revoked, expires (its ``expires_at`` passes) or whose
tenant is deactivated while its socket is open is noticed within ``REVOCATION_CHECK_S`` by
one watcher per process (one database query for all open sockets' keys), and its sockets
are closed (4401, ``invalid_api_key``) after cancelling their requests. The same query
brings the keys' scope (``read_only``, ``allowed_models``) and own limits up to date: a
socket's next request is held to the key as it is now (``service.check_scope``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from channels.exceptions import StopConsumer
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from accounts.models import ApiKey
from inference import broker, db, health, service
from inference.auth import (
    BAD_KEY,
    INVALID_API_KEY,
    NO_KEY,
    READ_ONLY,
    AuthThrottled,
    key_for,
)
from inference.broker import StreamEvent
from inference.errors import ApiError, invalid
from inference.openai_format import chat_logprob
from inference.openai_request import CHAT, COMPLETION, parse_request
from wire import protocol
from wire.errors import AUTH_THROTTLED, INTERNAL_ERROR, KEY_READ_ONLY

log = logging.getLogger(__name__)

REQUEST_TYPES = {"chat.completions": CHAT, "completions": COMPLETION}
MAX_REQUESTS_PER_SOCKET = 32
CLOSE_UNAUTHENTICATED = 4401
CLOSE_INTERNAL_ERROR = 1011
# Defaults of the settings of the same names (settings.WS_AUTH_TIMEOUT_S, ...).
AUTH_TIMEOUT_S = 10.0  # a socket must authenticate this soon after it opens
REVOCATION_CHECK_S = 1.0  # how often open sockets' keys are checked again
MAX_ID_CHARS = 256  # a client id: a string this long at most, or an integer
MAX_ID_INT = 2**53  # ...within JSON's safe integers
MAX_DEPTH = 64  # nesting of a message's JSON (objects and arrays)
CANCEL_WAIT_S = 5.0  # how long closing waits for its requests' cancels to go out
# A close the client chose: a close frame with 1000 (normal), 1001 (going away: a page
# left) or no code (daphne reports None; other servers 1005). Anything else (1006: the
# connection dropped without a close frame; a code of the client's own, e.g. 4000 to
# detach on purpose) keeps the socket's requests running for the resume grace.
DELIBERATE_CLOSE_CODES = frozenset({None, 1000, 1001, 1005})
_ENVELOPE = ("type", "id", "stream", "stream_options")


class MessageError(Exception):
    """A message the socket cannot act on: answered with an ``error``, the socket carries on."""

    def __init__(self, error: ApiError, client_id: Any = None) -> None:
        super().__init__(error.message)
        self.error = error
        self.client_id = client_id


@dataclass(slots=True)
class _Running:
    """One request on this socket; ``request_id`` is known once it is queued."""

    task: asyncio.Task[None] | None = None
    request_id: str | None = None
    cancel_requested: bool = field(default=False)
    ended: bool = False  # its terminal event went out: closing the socket cancels nothing


class StreamConsumer(AsyncJsonWebsocketConsumer):
    """Auth by header or a first ``auth`` message; then requests, cancels, resumes."""

    api_key: ApiKey | None = None
    running: dict[Any, _Running]
    shutting: bool = False  # the server is closing the socket
    closing: bool = False  # ...and nothing more may be sent on it
    _auth_timer: asyncio.Task[None] | None = None

    async def dispatch(self, message: dict[str, Any]) -> None:
        """Every handler runs here: an exception in the consumer closes the socket (1011)
        after cancelling its requests, never leaving them running with their slots."""
        try:
            await super().dispatch(message)
        except StopConsumer:
            raise
        except Exception:
            log.exception("websocket consumer failed on %s", message.get("type"))
            await self._shutdown(CLOSE_INTERNAL_ERROR, ApiError(
                INTERNAL_ERROR, "The server had an error processing your message; the socket "
                "is closed and its requests are cancelled."))

    async def connect(self) -> None:
        self.api_key = self.scope.get("api_key")
        self.running = {}
        await self.accept()
        if self.scope.get("auth_error"):
            await self._refuse_auth(self.scope["auth_error"],
                                    self.scope.get("auth_error_code", INVALID_API_KEY))
        elif self.api_key is None:
            self._auth_timer = asyncio.create_task(self._auth_deadline())
        else:
            _watcher().add(self)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None,
                      **kwargs: Any) -> None:
        if self.shutting:
            return
        try:
            content = _decode(text_data if text_data is not None else bytes_data)
            if self.api_key is None:
                await self._first_message(content)
            else:
                await self._handle(content)
        except MessageError as bad:
            if self.api_key is None:  # nothing but a well-formed auth before authenticating
                await self._refuse_auth(NO_KEY)
            else:
                await self._send_error(bad.client_id, bad.error)

    async def disconnect(self, code: int | None) -> None:
        await self._stop_requests(cancel=code in DELIBERATE_CLOSE_CODES and self._may_cancel())

    def _may_cancel(self) -> bool:
        """Whether the socket's key may cancel: a read-only key's requests are resumes of
        others' (it runs none), which it reads and never ends: its ``cancel`` is refused
        and its socket's close leaves them running."""
        return self.api_key is None or not self.api_key.read_only

    # -- messages ----------------------------------------------------------------------------

    async def _first_message(self, content: dict[str, Any]) -> None:
        if content.get("type") == "auth":
            await self._authenticate(content.get("api_key"))
        else:
            await self._refuse_auth(NO_KEY)

    async def _handle(self, content: dict[str, Any]) -> None:
        kind = content.get("type")
        if not isinstance(kind, str):
            raise MessageError(invalid("type", "Every message needs a type (a string): "
                                               "chat.completions, completions, cancel, resume "
                                               "or auth.", "invalid_message"))
        if kind in REQUEST_TYPES or kind == "resume":
            await self._start(_client_id(content), kind, content)
        elif kind == "cancel":
            await self._cancel(_client_id(content))
        elif kind == "auth":
            await self.send_json({"type": "authenticated"})
        else:
            raise MessageError(invalid(
                "type", f"Unknown message type {kind[:64]!r}: use chat.completions, "
                        "completions, cancel or resume.", "invalid_message"),
                _client_id(content, strict=False))

    # -- auth ------------------------------------------------------------------------------

    async def _authenticate(self, raw: Any) -> None:
        try:
            self.api_key = await key_for(raw) if isinstance(raw, str) and raw else None
        except AuthThrottled as refused:
            await self._refuse_auth(str(refused.detail), AUTH_THROTTLED)
            return
        if self.api_key is None:
            await self._refuse_auth(BAD_KEY)
            return
        if self._auth_timer is not None:
            self._auth_timer.cancel()
            self._auth_timer = None
        _watcher().add(self)
        await self.send_json({"type": "authenticated"})

    async def _auth_deadline(self) -> None:
        timeout = float(broker.setting("WS_AUTH_TIMEOUT_S", AUTH_TIMEOUT_S))
        await asyncio.sleep(timeout)
        if self.api_key is None and not self.shutting:
            try:
                await self._refuse_auth(f"No API key within {timeout:g} s of opening the "
                                        "socket. " + NO_KEY)
            except Exception:  # the socket is going either way
                log.warning("closing an unauthenticated websocket failed", exc_info=True)

    async def _refuse_auth(self, message: str, code: str = INVALID_API_KEY) -> None:
        await self._shutdown(CLOSE_UNAUTHENTICATED, ApiError(code, message))

    async def revoked(self) -> None:
        """The key was revoked, expired or its tenant deactivated (the watcher noticed)."""
        try:
            await self._shutdown(CLOSE_UNAUTHENTICATED, ApiError(
                INVALID_API_KEY, "This API key was revoked or has expired (or its tenant "
                "was deactivated); the socket is closed and its requests are cancelled."))
        except Exception:  # the socket is going either way
            log.warning("closing a revoked key's websocket failed", exc_info=True)

    # -- closing -----------------------------------------------------------------------------

    async def _shutdown(self, code: int, error: ApiError | None = None) -> None:
        """Cancel every request on the socket (their cancels are published before the
        client sees the close), tell the client why, close. Runs once."""
        if self.shutting:
            return
        self.shutting = True  # no new request starts from here on
        try:
            await self._stop_requests(cancel=self._may_cancel())
            if error is not None:
                await self._send_error(None, error)
        finally:
            self.closing = True
            await self.close(code=code)

    async def _stop_requests(self, cancel: bool = True) -> None:
        """Stop following every request on the socket. ``cancel``: their cancels are
        published first (so that a lost task cancellation cannot leave one running), then
        their tasks are cancelled and awaited. Else they run on, unread: each reader's
        ``CancelIfAbandoned`` leaves its request to the daemon's resume grace."""
        _watcher().discard(self)
        current = asyncio.current_task()
        if self._auth_timer is not None and self._auth_timer is not current:
            self._auth_timer.cancel()
        running = [run for run in getattr(self, "running", {}).values() if run.task is not current]
        running = [run for run in running if not run.ended]
        started = [run.request_id for run in running if run.request_id is not None and cancel]
        if started:
            await asyncio.gather(*(service.cancel_quietly(r) for r in started))
        tasks = {run.task for run in running if run.task is not None}
        deadline = time.monotonic() + CANCEL_WAIT_S
        while tasks and time.monotonic() < deadline:
            for task in tasks:
                task.cancel()  # again if need be: Python 3.11 can lose a cancellation
            _done, tasks = await asyncio.wait(tasks, timeout=0.2)
        for run in running:  # queued while we waited; or a reader that would not stop and
            # would keep its request watched for ever
            stuck = run.task is not None and not run.task.done()
            if run.request_id is not None and run.request_id not in started and not run.ended \
                    and (cancel or stuck):
                await service.cancel_quietly(run.request_id)

    async def send_json(self, content: Any, close: bool = False) -> None:
        if not self.closing:  # nothing goes out after the close
            await super().send_json(content, close=close)

    # -- requests ----------------------------------------------------------------------------

    async def _start(self, client_id: Any, kind: str, content: dict[str, Any]) -> None:
        if client_id in self.running:
            await self._send_error(client_id, invalid("id", f"Request {client_id!r} is still "
                                                            "running on this socket."))
        elif len(self.running) >= MAX_REQUESTS_PER_SOCKET:
            busy = ApiError("rate_limited", f"At most {MAX_REQUESTS_PER_SOCKET} requests at "
                            "once per socket.", headers={"Retry-After": "1"})
            await self._send_error(client_id, busy, status=busy.status)
        else:
            run = self.running[client_id] = _Running()
            work = self._resume(client_id, run, content) if kind == "resume" else \
                self._request(client_id, run, REQUEST_TYPES[kind], content)
            run.task = asyncio.create_task(self._guarded(client_id, run, work))

    async def _guarded(self, client_id: Any, run: _Running, work: Any) -> None:
        try:
            await work
            run.request_id = None  # ended: nothing of it left to cancel
        except ApiError as error:
            await self._send_error(client_id, error, status=error.status,
                                   request_id=run.request_id)
        except Exception:
            log.exception("websocket request %r failed", client_id)
            if run.request_id is not None:  # it must not keep running (and its slot) unread
                await service.cancel_quietly(run.request_id)
            failed = ApiError(INTERNAL_ERROR, "The server had an error processing your request.")
            await self._send_error(client_id, failed, status=failed.status,
                                   request_id=run.request_id)
        finally:
            if self.running.get(client_id) is run:
                del self.running[client_id]

    async def _request(self, client_id: Any, run: _Running, kind: str,
                       content: dict[str, Any]) -> None:
        body = {k: v for k, v in content.items() if k not in _ENVELOPE}
        await health.fresh_chat_tools(body)
        parsed = parse_request(kind, body)
        queued = await service.enqueue(self.api_key, parsed)
        try:  # its reader's place, held from the enqueue to the end of its events
            run.request_id = queued.request_id
            if run.cancel_requested:
                await broker.publish_cancel(queued.request_id)
            submission = await service.answer(queued)
            await self._relay(client_id, queued.request_id, service.events(submission),
                              parsed.session_id, parsed.shown_model)
        finally:
            queued.release()

    async def _resume(self, client_id: Any, run: _Running, content: dict[str, Any]) -> None:
        request_id = _uuid_text(content.get("request_id"))
        after = content.get("last_event_id") or "0-0"
        if not service.is_event_id(after):
            raise invalid("last_event_id", "last_event_id must be a stream entry id such as 1-0.")
        row = await service.owned_row(self.api_key.tenant, request_id)
        events = await service.resume(self.api_key, row, after)  # 404 expired, 429, 503
        try:  # its place and slot, held from the resume to the end of its events
            run.request_id = request_id
            await self._relay(client_id, request_id, events, model=row.model)
        finally:  # also when cancelled before _relay started them
            await events.aclose()

    async def _relay(self, client_id: Any, request_id: str,
                     events: AsyncIterator[StreamEvent | None],
                     session_id: str | None = None, model: str | None = None) -> None:
        """``session_id``: a session's turn (its accepted and last messages name it);
        ``model``: the model its accepted message names, as the client named it (an
        adapter's ``<base>:<adapter>``)."""
        async with service.CancelIfAbandoned(request_id, cancels=self._may_cancel()) as guard, \
                aclosing(events) as stream:
            async for event in stream:
                if event is not None:
                    if event.is_terminal:  # before it goes out: closing now cancels nothing
                        guard.ended = True
                        run = self.running.get(client_id)
                        if run is not None:
                            run.ended = True
                    message = _message(client_id, request_id, event)
                    if model is not None and event.kind == protocol.ACCEPTED:
                        message["model"] = model
                    if session_id is not None and (event.is_terminal
                                                   or event.kind == protocol.ACCEPTED):
                        message["session_id"] = session_id
                    await self.send_json(message)

    async def _cancel(self, client_id: Any) -> None:
        run = self.running.get(client_id)
        if not self._may_cancel():
            await self._send_error(client_id, ApiError(KEY_READ_ONLY, READ_ONLY), status=403)
        elif run is None:
            await self._send_error(client_id, ApiError(
                "not_found", f"No request {client_id!r} is running on this socket."))
        elif run.request_id is None:
            run.cancel_requested = True  # published as soon as it is queued
        else:
            await broker.publish_cancel(run.request_id)

    async def _send_error(self, client_id: Any, error: ApiError, status: int | None = None,
                          request_id: str | None = None) -> None:
        message: dict[str, Any] = {"type": "error", "id": client_id, **error.body()}
        if status is not None:
            message["status"] = status
        if request_id is not None:
            message["request_id"] = request_id
        await self.send_json(message)


# -- checking a message ------------------------------------------------------------------------


def _decode(raw: str | bytes | None) -> dict[str, Any]:
    """A message as a JSON object, else MessageError naming what is wrong with it."""
    try:
        content = json.loads(raw if raw is not None else "")
    except RecursionError:
        raise MessageError(_bad_message(
            f"The message nests deeper than {MAX_DEPTH} levels.")) from None
    except (ValueError, TypeError):
        raise MessageError(_bad_message("The message is not valid JSON.")) from None
    if not isinstance(content, dict):
        kind = "null" if content is None else type(content).__name__
        raise MessageError(_bad_message(f"Messages must be JSON objects, not {kind}."))
    if _too_deep(content):
        raise MessageError(_bad_message(f"The message nests deeper than {MAX_DEPTH} levels."))
    return content


def _bad_message(message: str) -> ApiError:
    return invalid(None, message, "invalid_message")


def _too_deep(value: Any) -> bool:
    """Whether ``value`` nests objects/arrays more than MAX_DEPTH deep (iterative)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(item, dict):
            stack.extend((child, depth + 1) for child in item.values()
                         if isinstance(child, (dict, list)))
        elif isinstance(item, list):
            stack.extend((child, depth + 1) for child in item if isinstance(child, (dict, list)))
    return False


def _client_id(content: dict[str, Any], strict: bool = True) -> Any:
    """The message's ``id``: a string of at most MAX_ID_CHARS or a safe integer. Anything
    else is a MessageError (``strict``) or None (for echoing it in an error)."""
    value = content.get("id")
    good = (isinstance(value, str) and len(value) <= MAX_ID_CHARS) or (
        isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_ID_INT)
    if good:
        return value
    if not strict:
        return None
    raise MessageError(invalid("id", "Every request needs an id: a string of at most "
                                     f"{MAX_ID_CHARS} characters or an integer."))


def _message(client_id: Any, request_id: str, event: StreamEvent) -> dict[str, Any]:
    """A stream event as the socket's message (``event_id`` resumes after it)."""
    head = {"type": event.kind, "id": client_id, "request_id": request_id,
            "event_id": event.entry_id}
    data = event.data
    if event.kind == protocol.ERROR:
        return {**head, **ApiError.from_event(data).body()}
    if event.kind == protocol.TOKEN:
        message = {**head, "text": data.get("text", ""), "n_tokens": data.get("n_tokens", 0)}
        if data.get("logprobs"):  # a request that asked: its tokens' entries, chat's shape
            message["logprobs"] = [chat_logprob(entry) for entry in data["logprobs"]]
        if "index" in data:  # a choice of several (n > 1)
            message["index"] = data["index"]
        return message
    if event.kind == protocol.DONE:
        done = {**head, "finish_reason": data.get("finish_reason"), "stop": data.get("stop"),
                "usage": data.get("usage") or protocol.usage(0, 0, 0),
                "timings": data.get("timings") or {}}
        if data.get("resumed"):  # continued by another daemon after its own died
            done["resumed"] = data["resumed"]
        if data.get("choices"):  # n > 1: each choice's end
            done["choices"] = data["choices"]
        return done
    return {**head, "model": data.get("model"), "prompt_tokens": data.get("prompt_tokens")}


def _uuid_text(value: Any) -> str:
    if not isinstance(value, str):
        raise invalid("request_id", "request_id must be a request's id (a UUID).")
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise invalid("request_id", "request_id must be a request's id (a UUID).") from None


# -- revoked keys ------------------------------------------------------------------------------


class _RevocationWatcher:
    """One per event loop (process): while sockets are open, checks every
    REVOCATION_CHECK_S that their keys still authenticate (one query for all of them) and
    closes the sockets of keys that do not. A poll, not a notice: it sees every way a key
    stops working (the admin, a bulk update, a shell, another process) without hooks."""

    def __init__(self) -> None:
        self.sockets: set[StreamConsumer] = set()
        self.task: asyncio.Task[None] | None = None

    def add(self, consumer: StreamConsumer) -> None:
        self.sockets.add(consumer)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())

    def discard(self, consumer: StreamConsumer) -> None:
        self.sockets.discard(consumer)

    async def _run(self) -> None:
        while self.sockets:
            await asyncio.sleep(float(broker.setting("WS_REVOCATION_CHECK_S",
                                                     REVOCATION_CHECK_S)))
            try:
                await self.check()
            except Exception:  # the database may be away for a moment: try again next time
                log.warning("checking the open websockets' keys failed", exc_info=True)

    async def check(self) -> None:
        sockets = [s for s in self.sockets if s.api_key is not None and not s.shutting]
        if not sockets:
            return
        usable = await db.run(_usable_keys, {s.api_key.pk for s in sockets})
        for consumer in sockets:
            fields = usable.get(consumer.api_key.pk)
            if fields is None:
                self.sockets.discard(consumer)
                asyncio.create_task(consumer.revoked())
            else:  # the key as it is now: its scope and own limits
                for name, value in fields.items():
                    setattr(consumer.api_key, name, value)


SCOPE_FIELDS = ("expires_at", "allowed_models", "read_only", "requests_per_minute",
                "tokens_per_minute", "monthly_token_budget")


def _usable_keys(ids: set[int]) -> dict[int, dict[str, Any]]:
    """The usable keys among ``ids`` (not revoked, not expired, tenant active): their
    ``SCOPE_FIELDS`` by id."""
    rows = ApiKey.objects.usable().filter(pk__in=ids).values("pk", *SCOPE_FIELDS)
    return {row.pop("pk"): row for row in rows}


_watchers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _RevocationWatcher] = (
    weakref.WeakKeyDictionary()
)


def _watcher() -> _RevocationWatcher:
    loop = asyncio.get_running_loop()
    if loop not in _watchers:
        _watchers[loop] = _RevocationWatcher()
    return _watchers[loop]
