"""The OpenAI-compatible completion endpoints and the SSE resume endpoint.

Async views (not DRF's sync APIView): a request waits on Redis for seconds, and under
ASGI Django cancels an async view or its streaming iterator when the client disconnects,
which is how a vanished client's request gets cancelled.
"""
from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference import broker, service
from inference.api_errors import ApiError, invalid
from inference.auth import authenticate_request
from inference.broker import StreamEvent
from inference.openai_format import (
    DONE_FRAME,
    KEEPALIVE_FRAME,
    OPEN_FRAME,
    Formatter,
    sse_frame,
)
from inference.openai_request import CHAT, COMPLETION, load_json, parse_request

KEEPALIVE_IDLE_TICKS = 15  # an SSE comment after this many idle seconds

View = Callable[..., Awaitable[HttpResponse]]


def api_endpoint(method: str) -> Callable[[View], View]:
    """CSRF-exempt (keys, not cookies), one method, ApiError as an OpenAI error reply."""

    def decorate(view: View) -> View:
        @csrf_exempt
        @functools.wraps(view)
        async def wrapper(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if request.method != method:
                error = ApiError(405, f"Method {request.method} not allowed.", "method_not_allowed")
                response = error.response()
                response["Allow"] = method
                return response
            try:
                return await view(request, *args, **kwargs)
            except ApiError as error:
                return error.response()

        return wrapper

    return decorate


@api_endpoint("POST")
async def chat_completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/chat/completions"""
    return await _complete(request, CHAT)


@api_endpoint("POST")
async def completions(request: HttpRequest) -> HttpResponse:
    """POST /v1/completions"""
    return await _complete(request, COMPLETION)


@api_endpoint("GET")
async def request_events(request: HttpRequest, pk: uuid.UUID) -> HttpResponse:
    """GET /v1/requests/<id>/events: the request's stream as SSE, after Last-Event-ID."""
    api_key = await authenticate_request(request)
    row = await service.owned_row(api_key.tenant, str(pk))
    after = request.headers.get("Last-Event-ID") or request.GET.get("last_event_id") or "0-0"
    if not service.is_event_id(after):
        raise invalid("last_event_id", "Last-Event-ID must be a stream entry id such as 1-0.")
    if row.finished and not await broker.stream_exists(str(pk)):
        raise ApiError(404, "The events of this request have expired.", "events_expired")
    include_usage = request.GET.get("include_usage", "").lower() in ("1", "true", "yes")
    formatter = Formatter(row.kind, str(pk), row.model, int(row.created.timestamp()), include_usage)
    return _sse_response(formatter, await service.resume(api_key, row, after))  # 404/429/503


async def _complete(request: HttpRequest, kind: str) -> HttpResponse:
    api_key = await authenticate_request(request)
    parsed = parse_request(kind, _json_body(request))
    submission = await service.submit(api_key, parsed)
    formatter = Formatter(kind, submission.request_id, submission.model, submission.created,
                          parsed.include_usage)
    if parsed.stream:
        return _sse_response(formatter, service.events(submission))
    text, final = await service.collect(submission)
    response = JsonResponse(formatter.whole(text, final))
    response["X-Request-Id"] = submission.request_id
    return response


def _json_body(request: HttpRequest) -> Any:
    """The body as JSON; every way it can be wrong is a 400 in the API's shape."""
    try:
        raw = request.body
    except RequestDataTooBig:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raise ApiError(400, f"The request body is larger than {limit} bytes.",
                       "request_too_large", limit_bytes=limit) from None
    return load_json(raw)


def _sse_response(formatter: Formatter,
                  events: AsyncIterator[StreamEvent | None]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_sse(formatter, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    response["X-Request-Id"] = formatter.request_id
    return response


async def _sse(formatter: Formatter,
               events: AsyncIterator[StreamEvent | None]) -> AsyncIterator[bytes]:
    """SSE frames; a client that goes away mid-stream cancels the request."""
    idle = 0
    async with service.CancelIfAbandoned(formatter.request_id), aclosing(events) as stream:
        yield OPEN_FRAME  # the server sends headers with the first body bytes: send them now
        async for event in stream:
            if event is None:
                idle += 1
                if idle % KEEPALIVE_IDLE_TICKS == 0:
                    yield KEEPALIVE_FRAME
                continue
            for payload in formatter.chunks(event):
                yield sse_frame(event.entry_id, payload)
        yield DONE_FRAME
