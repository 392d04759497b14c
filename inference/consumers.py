"""The websocket API (/ws/v1/stream): several streamed requests on one socket.

Tokens are read from Redis by one task per request (``service.follow``), never through the
channel layer. Closing the socket cancels every request still running on it. The message
shapes are in docs/api.md.
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from channels.generic.websocket import AsyncJsonWebsocketConsumer

from inference import broker, service
from inference.api_errors import ApiError, invalid
from inference.auth import BAD_KEY, NO_KEY, key_for
from inference.broker import StreamEvent
from inference.openai_request import CHAT, COMPLETION, parse_request
from scheduler_daemon import protocol

log = logging.getLogger(__name__)

REQUEST_TYPES = {"chat.completions": CHAT, "completions": COMPLETION}
MAX_REQUESTS_PER_SOCKET = 32
CLOSE_UNAUTHENTICATED = 4401
_ENVELOPE = ("type", "id", "stream", "stream_options")


@dataclass(slots=True)
class _Running:
    """One request on this socket; ``request_id`` is known once it is queued."""

    task: asyncio.Task[None] | None = None
    request_id: str | None = None
    cancel_requested: bool = field(default=False)


class StreamConsumer(AsyncJsonWebsocketConsumer):
    """Auth by header or a first ``auth`` message; then requests, cancels, resumes."""

    async def connect(self) -> None:
        self.api_key = self.scope.get("api_key")
        self.running: dict[Any, _Running] = {}
        await self.accept()
        if self.scope.get("auth_error"):
            await self._refuse_auth(self.scope["auth_error"])

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None,
                      **kwargs: Any) -> None:
        try:
            content = json.loads(text_data or bytes_data or b"")
        except ValueError:
            await self._send_error(None, invalid(None, "Messages must be JSON objects.",
                                                 "invalid_message"))
            return
        await self.receive_json(content)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        kind = content.get("type") if isinstance(content, dict) else None
        if self.api_key is None:
            if kind == "auth":
                await self._authenticate(content.get("api_key"))
            else:
                await self._refuse_auth(NO_KEY)
            return
        client_id = content.get("id")
        if kind in REQUEST_TYPES or kind == "resume":
            await self._start(client_id, kind, content)
        elif kind == "cancel":
            await self._cancel(client_id)
        elif kind == "auth":
            await self.send_json({"type": "authenticated"})
        else:
            await self._send_error(client_id, invalid(
                "type", f"Unknown message type {kind!r}: use chat.completions, completions, "
                        "cancel or resume.", "invalid_message"))

    async def disconnect(self, code: int) -> None:
        tasks = [run.task for run in self.running.values() if run.task is not None]
        for task in tasks:
            task.cancel()  # each request's CancelIfAbandoned publishes its cancel
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- auth ------------------------------------------------------------------------------

    async def _authenticate(self, raw: Any) -> None:
        self.api_key = await key_for(raw) if isinstance(raw, str) and raw else None
        if self.api_key is None:
            await self._refuse_auth(BAD_KEY)
        else:
            await self.send_json({"type": "authenticated"})

    async def _refuse_auth(self, message: str) -> None:
        await self._send_error(None, ApiError(401, message, "invalid_api_key"))
        await self.close(code=CLOSE_UNAUTHENTICATED)

    # -- requests ----------------------------------------------------------------------------

    async def _start(self, client_id: Any, kind: str, content: dict[str, Any]) -> None:
        if not isinstance(client_id, (str, int)) or isinstance(client_id, bool):
            await self._send_error(client_id, invalid("id", "Every request needs an id "
                                                            "(a string or an integer)."))
        elif client_id in self.running:
            await self._send_error(client_id, invalid("id", f"Request {client_id!r} is still "
                                                            "running on this socket."))
        elif len(self.running) >= MAX_REQUESTS_PER_SOCKET:
            await self._send_error(client_id, ApiError(
                429, f"At most {MAX_REQUESTS_PER_SOCKET} requests at once per socket.",
                "rate_limited"))
        else:
            run = self.running[client_id] = _Running()
            work = self._resume(client_id, run, content) if kind == "resume" else \
                self._request(client_id, run, REQUEST_TYPES[kind], content)
            run.task = asyncio.create_task(self._guarded(client_id, run, work))

    async def _guarded(self, client_id: Any, run: _Running, work: Any) -> None:
        try:
            await work
        except ApiError as error:
            await self._send_error(client_id, error, status=error.status,
                                   request_id=run.request_id)
        except Exception:
            log.exception("websocket request %r failed", client_id)
            await self._send_error(client_id, ApiError(
                500, "The server had an error processing your request.", "internal_error"))
        finally:
            self.running.pop(client_id, None)

    async def _request(self, client_id: Any, run: _Running, kind: str,
                       content: dict[str, Any]) -> None:
        body = {k: v for k, v in content.items() if k not in _ENVELOPE}
        queued = await service.enqueue(self.api_key, parse_request(kind, body))
        run.request_id = queued.request_id
        if run.cancel_requested:
            await broker.publish_cancel(queued.request_id)
        submission = await service.answer(queued)
        await self._relay(client_id, queued.request_id, service.events(submission))

    async def _resume(self, client_id: Any, run: _Running, content: dict[str, Any]) -> None:
        request_id = _uuid_text(content.get("request_id"))
        after = content.get("last_event_id") or "0-0"
        if not service.is_event_id(after):
            raise invalid("last_event_id", "last_event_id must be a stream entry id such as 1-0.")
        row = await service.owned_row(self.api_key.tenant, request_id)
        run.request_id = request_id
        await self._relay(client_id, request_id, service.follow(request_id, after, row.model))

    async def _relay(self, client_id: Any, request_id: str,
                     events: AsyncIterator[StreamEvent | None]) -> None:
        async with service.CancelIfAbandoned(request_id), aclosing(events) as stream:
            async for event in stream:
                if event is not None:
                    await self.send_json(_message(client_id, request_id, event))

    async def _cancel(self, client_id: Any) -> None:
        run = self.running.get(client_id)
        if run is None:
            await self._send_error(client_id, ApiError(
                404, f"No request {client_id!r} is running on this socket.", "not_found"))
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


def _message(client_id: Any, request_id: str, event: StreamEvent) -> dict[str, Any]:
    """A stream event as the socket's message (``event_id`` resumes after it)."""
    head = {"type": event.kind, "id": client_id, "request_id": request_id,
            "event_id": event.entry_id}
    data = event.data
    if event.kind == protocol.ERROR:
        return {**head, **ApiError.from_event(data).body()}
    if event.kind == protocol.TOKEN:
        return {**head, "text": data.get("text", ""), "n_tokens": data.get("n_tokens", 0)}
    if event.kind == protocol.DONE:
        return {**head, "finish_reason": data.get("finish_reason"), "stop": data.get("stop"),
                "usage": data.get("usage") or protocol.usage(0, 0, 0),
                "timings": data.get("timings") or {}}
    return {**head, "model": data.get("model"), "prompt_tokens": data.get("prompt_tokens")}


def _uuid_text(value: Any) -> str:
    try:
        return str(uuid.UUID(str(value)))
    except ValueError:
        raise invalid("request_id", "request_id must be a request's id (a UUID).") from None
