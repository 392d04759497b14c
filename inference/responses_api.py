"""POST /v1/responses, GET and DELETE /v1/responses/<id> (OpenAI's Responses API).

A Responses body becomes a chat request (inference/responses_request.py) and runs as one:
``service.submit`` (or an Idempotency-Key's ``idempotency.submit``), ``service.collect`` or
``service.events``: the admission, limits, history, cancel, resume and failure rules are
chat's. Its events become a Response object or typed SSE events
(inference/responses_format.py); with ``store`` (the default) the response and its
conversation are kept (inference/responses_store.py) for GET and ``previous_response_id``.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from adrf.views import APIView
from django.http import JsonResponse, StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request

from inference import db, health, idempotency, responses_request, responses_store, service
from inference.api_views import json_body
from inference.broker import StreamEvent
from inference.openai_format import KEEPALIVE_FRAME, OPEN_FRAME
from inference.openapi import IDEMPOTENCY_KEY, REQUEST_ID, RETRY_AFTER, SSE, error_responses
from inference.responses_format import Output, ResponseFormatter, frame
from inference.responses_openapi import (
    DeletedResponseSerializer,
    ResponseRequestSerializer,
    ResponseSerializer,
)
from wire import protocol

SSE_MEDIA_TYPE = "text/event-stream"
IDEMPOTENCY_KIND = "responses"  # a key's body digest names the endpoint

Keep = Callable[[Output, dict[str, Any]], Awaitable[None]]


class ResponsesView(APIView):
    """POST /v1/responses: a Response, or its typed events as SSE with ``stream: true``."""

    @extend_schema(
        operation_id="responses_create", summary="Create a model response (OpenAI Responses)",
        description="``stream: true`` answers with typed server-sent events "
                    "(``response.created`` ... ``response.completed``).",
        tags=["responses"], request=ResponseRequestSerializer,
        parameters=[IDEMPOTENCY_KEY, REQUEST_ID, RETRY_AFTER],
        responses={(200, "application/json"): ResponseSerializer, (200, SSE_MEDIA_TYPE): SSE,
                   **error_responses(400, 401, 404, 405, 409, 429, 500, 503, 504)})
    async def post(self, request: Request) -> JsonResponse | StreamingHttpResponse:
        body = json_body(request)
        await health.fresh_chat_tools(body)
        call = responses_request.read(body)
        tenant_id = request.auth.tenant_id
        earlier: list[dict[str, Any]] = []
        if call.previous_response_id is not None:
            earlier = await db.run(responses_store.conversation, tenant_id,
                                   call.previous_response_id)
        parsed = responses_request.parse(call, earlier)
        service.check_scope(request.auth, parsed)  # a replay too
        key = idempotency.key_digest(request.headers)
        if key is None:
            submission = await service.submit(request.auth, parsed)
        else:  # a retry of the key's request gets that request (a Replay), not a new one
            submission = await idempotency.submit(
                request.auth, parsed, key, idempotency.body_digest(IDEMPOTENCY_KIND, body))
        formatter = ResponseFormatter(submission.request_id, parsed.shown_model,
                                      submission.created, call, parsed.params,
                                      parsed.tool_plan)

        async def keep(output: Output, response: dict[str, Any]) -> None:
            if call.store:
                await db.run(responses_store.save, tenant_id, formatter.id,
                             submission.request_id, parsed.shown_model,
                             [*earlier, *call.input, *output.messages], response)

        replay = submission if isinstance(submission, idempotency.Replay) else None
        if parsed.stream:
            events = replay.events() if replay else service.events(submission)
            reply = StreamingHttpResponse(_sse(formatter, events, keep),
                                          content_type=SSE_MEDIA_TYPE)
            reply["Cache-Control"] = "no-cache"
            reply["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
        else:
            collected = await (replay.collect() if replay else service.collect(submission))
            response, output = formatter.whole(collected.text, collected.final)
            await keep(output, response)
            reply = JsonResponse(response)
        reply["X-Request-Id"] = submission.request_id
        return reply


def _detail_schema(operation: str, summary: str, serializer: type) -> Any:
    return extend_schema(operation_id=operation, summary=summary, tags=["responses"],
                         responses={200: serializer,
                                    **error_responses(401, 404, 405, 429, 503)})


class ResponseDetailView(APIView):
    """GET or DELETE /v1/responses/<id>: one of the tenant's stored responses; another
    tenant's, an unknown or an expired one is 404 ``not_found``."""

    @_detail_schema("responses_retrieve", "A stored response", ResponseSerializer)
    async def get(self, request: Request, response_id: str) -> JsonResponse:
        return JsonResponse(await db.run(responses_store.retrieve, request.auth.tenant_id,
                                         response_id))

    @_detail_schema("responses_destroy", "Delete a stored response",
                    DeletedResponseSerializer)
    async def delete(self, request: Request, response_id: str) -> JsonResponse:
        await db.run(responses_store.delete, request.auth.tenant_id, response_id)
        return JsonResponse({"id": response_id, "object": "response", "deleted": True})




async def _sse(formatter: ResponseFormatter, events: AsyncIterator[StreamEvent | None],
               keep: Keep) -> AsyncIterator[bytes]:
    """The typed events, one write per protocol event; a stored response is saved before
    its ``response.completed`` goes out. A client that goes away mid-stream leaves its
    request to be resumed (``/v1/requests/<id>/events``) within the grace, as on chat."""
    async with aclosing(service.streamed(formatter.request_id, events, OPEN_FRAME,
                                         KEEPALIVE_FRAME)) as stream:
        async for event in stream:
            if isinstance(event, bytes):
                yield event
                continue
            typed = formatter.events(event)
            if formatter.finished is not None and event.kind == protocol.DONE:
                await keep(formatter.finished, typed[-1]["response"])
            frames = b"".join(frame(event.entry_id, item) for item in typed)
            if frames:
                yield frames
