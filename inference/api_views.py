"""The OpenAI-compatible completion endpoints and the SSE resume endpoint.

DRF views with async handlers (adrf): a request waits on Redis for seconds, which an async
handler does on the event loop. Under ASGI Django cancels the view (or its streaming
response's iterator) when the client disconnects; the cancellation reaches
``service.CancelIfAbandoned``, which leaves the request to be resumed within RESUME_GRACE_S
(the daemon cancels it after that). Authentication,
permissions and errors are the API's defaults (REST_FRAMEWORK in config/settings.py).
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from adrf.views import APIView
from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse, StreamingHttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.request import Request

from inference import health, idempotency, service
from inference.broker import StreamEvent
from inference.errors import ApiError, invalid
from inference.openai_format import (
    DONE_FRAME,
    KEEPALIVE_FRAME,
    OPEN_FRAME,
    Formatter,
    embeddings_body,
    sse_frame,
)
from inference.openai_request import (
    CHAT,
    COMPLETION,
    DETOKENIZE,
    TOKENIZE,
    load_json,
    parse_embeddings_request,
    parse_request,
    parse_vocab_request,
)
from inference.openapi import (
    IDEMPOTENCY_KEY,
    REQUEST_ID,
    RETRY_AFTER,
    SSE,
    ChatCompletionRequestSerializer,
    ChatCompletionSerializer,
    CompletionRequestSerializer,
    CompletionSerializer,
    DetokenizeRequestSerializer,
    DetokenizeResponseSerializer,
    EmbeddingsRequestSerializer,
    EmbeddingsResponseSerializer,
    TokenizeRequestSerializer,
    TokenizeResponseSerializer,
    error_responses,
)

SSE_MEDIA_TYPE = "text/event-stream"


def _completion_schema(kind: str) -> Any:
    chat = kind == CHAT
    return extend_schema(
        operation_id="chat_completions_create" if chat else "completions_create",
        summary="Create a chat completion" if chat else "Create a completion",
        description="OpenAI-compatible. ``stream: true`` answers with server-sent events.",
        tags=["completions"],
        request=ChatCompletionRequestSerializer if chat else CompletionRequestSerializer,
        parameters=[IDEMPOTENCY_KEY, REQUEST_ID, RETRY_AFTER],
        responses={
            (200, "application/json"): ChatCompletionSerializer if chat else CompletionSerializer,
            (200, SSE_MEDIA_TYPE): SSE,
            **error_responses(400, 401, 404, 405, 409, 429, 500, 503, 504),
        },
    )


class CompletionView(APIView):
    """POST a completion request; the reply is JSON, or SSE with ``stream: true``."""

    kind: str

    async def post(self, request: Request) -> JsonResponse | StreamingHttpResponse:
        body = json_body(request)
        await health.fresh_chat_tools(body)
        parsed = parse_request(self.kind, body)
        service.check_scope(request.auth, parsed)  # a replay too
        key = idempotency.key_digest(request.headers)
        if key is None:
            submission = await service.submit(request.auth, parsed)
        else:  # a retry of the key's request gets that request (a Replay), not a new one
            submission = await idempotency.submit(request.auth, parsed, key,
                                                  idempotency.body_digest(self.kind, body))
        # the model as the client named it: "<base>:<adapter>" for an adapter's reply
        formatter = Formatter(self.kind, submission.request_id, parsed.shown_model,
                              submission.created, parsed.include_usage, parsed.tool_plan,
                              parsed.choices, parsed.session_id)
        replay = submission if isinstance(submission, idempotency.Replay) else None
        if parsed.stream:
            return _sse_response(formatter, replay.events() if replay else
                                 service.events(submission))
        collected = await (replay.collect(parsed.choices) if replay
                           else service.collect(submission, parsed.choices))
        # Django's JsonResponse: a DRF Response is rendered on a thread (one more hop).
        response = JsonResponse(formatter.whole(collected.texts, collected.final,
                                                collected.logprobs))
        response["X-Request-Id"] = submission.request_id
        return response


class ChatCompletionsView(CompletionView):
    """POST /v1/chat/completions"""

    kind = CHAT

    @_completion_schema(CHAT)
    async def post(self, request: Request) -> JsonResponse | StreamingHttpResponse:
        return await super().post(request)


class CompletionsView(CompletionView):
    """POST /v1/completions"""

    kind = COMPLETION

    @_completion_schema(COMPLETION)
    async def post(self, request: Request) -> JsonResponse | StreamingHttpResponse:
        return await super().post(request)


class VocabularyView(APIView):
    """POST a tokenize or detokenize request: answered by a daemon of the model, from its
    own vocabulary (the web never loads a model), without a slot."""

    kind: str

    async def post(self, request: Request) -> JsonResponse:
        parsed = parse_vocab_request(self.kind, json_body(request))
        submission = await service.submit(request.auth, parsed)
        response = JsonResponse(service.vocab_answer(await service.vocab_end(submission)))
        response["X-Request-Id"] = submission.request_id
        return response


class EmbeddingsView(APIView):
    """POST /v1/embeddings: computed by a daemon of the model, in its loop (never here)."""

    @extend_schema(operation_id="embeddings", summary="Embeddings of texts or token ids",
                   tags=["embeddings"], request=EmbeddingsRequestSerializer,
                   parameters=[REQUEST_ID, RETRY_AFTER],
                   responses={200: EmbeddingsResponseSerializer,
                              **error_responses(400, 401, 404, 405, 429, 500, 503)})
    async def post(self, request: Request) -> JsonResponse:
        parsed, encoding = parse_embeddings_request(json_body(request))
        submission = await service.submit(request.auth, parsed)
        end = await service.vocab_end(submission)
        result = service.vocab_answer(end)
        usage = end.data.get("usage") or {}
        response = JsonResponse(embeddings_body(submission.model, result["vectors"], encoding,
                                                int(usage.get("prompt_tokens") or 0)))
        response["X-Request-Id"] = submission.request_id
        return response


class TokenizeView(VocabularyView):
    """POST /v1/tokenize"""

    kind = TOKENIZE

    @extend_schema(operation_id="tokenize", summary="Text to the model's token ids",
                   tags=["vocabulary"], request=TokenizeRequestSerializer,
                   parameters=[REQUEST_ID, RETRY_AFTER],
                   responses={200: TokenizeResponseSerializer,
                              **error_responses(400, 401, 404, 405, 429, 500, 503)})
    async def post(self, request: Request) -> JsonResponse:
        return await super().post(request)


class DetokenizeView(VocabularyView):
    """POST /v1/detokenize"""

    kind = DETOKENIZE

    @extend_schema(operation_id="detokenize", summary="The model's token ids to text",
                   tags=["vocabulary"], request=DetokenizeRequestSerializer,
                   parameters=[REQUEST_ID, RETRY_AFTER],
                   responses={200: DetokenizeResponseSerializer,
                              **error_responses(400, 401, 404, 405, 429, 500, 503)})
    async def post(self, request: Request) -> JsonResponse:
        return await super().post(request)


class RequestEventsView(APIView):
    """GET /v1/requests/<id>/events: the request's stream as SSE, after Last-Event-ID."""

    @extend_schema(
        operation_id="requests_events",
        summary="A request's events as SSE, after Last-Event-ID (resume)",
        tags=["requests"],
        parameters=[
            OpenApiParameter("Last-Event-ID", OpenApiTypes.STR, OpenApiParameter.HEADER,
                             description="resume after this stream entry id (1712345678901-0)"),
            OpenApiParameter("last_event_id", OpenApiTypes.STR,
                             description="the same, as a query parameter"),
            OpenApiParameter("include_usage", OpenApiTypes.BOOL,
                             description="add the usage chunk at the end"),
            RETRY_AFTER,
        ],
        responses={(200, SSE_MEDIA_TYPE): SSE, **error_responses(400, 401, 404, 405, 429, 503)},
    )
    async def get(self, request: Request, pk: uuid.UUID) -> StreamingHttpResponse:
        api_key = request.auth
        row = await service.owned_row(api_key.tenant, str(pk))
        after = (request.headers.get("Last-Event-ID")
                 or request.query_params.get("last_event_id") or "0-0")
        if not service.is_event_id(after):
            raise invalid("last_event_id", "Last-Event-ID must be a stream entry id such as 1-0.")
        include_usage = request.query_params.get("include_usage", "").lower() in (
            "1", "true", "yes")
        formatter = Formatter(row.kind, str(pk), row.model, int(row.created.timestamp()),
                              include_usage)
        return _sse_response(formatter, await service.resume(api_key, row, after),
                             cancels=not api_key.read_only)  # a read-only key only reads


def json_body(request: Request) -> Any:
    """The body as JSON, whatever its Content-Type (curl -d sends a form type); every way
    it can be wrong is a 400 in the API's shape."""
    try:
        raw = request.body
    except RequestDataTooBig:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        raise ApiError("request_too_large", f"The request body is larger than {limit} bytes.",
                       limit_bytes=limit) from None
    return load_json(raw)


def _sse_response(formatter: Formatter, events: AsyncIterator[StreamEvent | None],
                  cancels: bool = True) -> StreamingHttpResponse:
    response = StreamingHttpResponse(_sse(formatter, events, cancels),
                                     content_type=SSE_MEDIA_TYPE)
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
    response["X-Request-Id"] = formatter.request_id
    return response


async def _sse(formatter: Formatter, events: AsyncIterator[StreamEvent | None],
               cancels: bool = True) -> AsyncIterator[bytes]:
    """SSE frames, one write per event (its chunks, and ``[DONE]`` after the last, go out
    together); a client that goes away mid-stream has its request cancelled unless it
    resumes within the grace (service.streamed)."""
    ended = False
    async with aclosing(service.streamed(formatter.request_id, events, OPEN_FRAME,
                                         KEEPALIVE_FRAME, cancels)) as stream:
        async for event in stream:
            if isinstance(event, bytes):
                yield event
                continue
            frames = b"".join(sse_frame(event.entry_id, payload)
                              for payload in formatter.chunks(event))
            if event.is_terminal:  # the stream ends after it
                frames, ended = frames + DONE_FRAME, True
            if frames:
                yield frames
        if not ended:
            yield DONE_FRAME


def _session_schema(operation: str, summary: str) -> Any:
    return extend_schema(operation_id=operation, summary=summary, tags=["sessions"],
                         responses={200: OpenApiTypes.OBJECT,
                                    **error_responses(401, 404, 405, 429, 503)})


class SessionView(APIView):
    """GET or DELETE /v1/sessions/<id>: one of the tenant's sessions (docs/api.md,
    "Sessions"); another tenant's, an unknown or an expired one is 404 ``no_session``."""

    @_session_schema("sessions_retrieve", "A session: its model, turns, tokens held, expiry")
    async def get(self, request: Request, session_id: str) -> JsonResponse:
        found = await service.session_info(request.auth, session_id)
        return JsonResponse({"object": "session", "id": session_id, **found})

    @_session_schema("sessions_destroy", "Delete a session (its next turn sends the history)")
    async def delete(self, request: Request, session_id: str) -> JsonResponse:
        await service.delete_session(request.auth, session_id)
        return JsonResponse({"object": "session.deleted", "id": session_id, "deleted": True})
