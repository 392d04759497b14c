"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API.

A request's body is checked and translated into a chat body (inference/anthropic_request.py)
and goes the chat path: ``openai_request.parse_request`` checks it again, ``service``
admits, queues and follows it (its limits, history, cancel, resume and failures are chat's),
and inference/anthropic_format.py writes the reply: the message, or Anthropic's stream
events. Errors on these endpoints, the key's refusals too, are answered in Anthropic's
shape (``AnthropicErrors``). Headers ``anthropic-version`` (any value, not required) and
``anthropic-beta`` are accepted and ignored.
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from adrf.views import APIView
from django.http import JsonResponse, StreamingHttpResponse
from drf_spectacular.utils import extend_schema
from rest_framework.request import Request
from rest_framework.response import Response

from inference import anthropic_format, health, idempotency, service
from inference.anthropic_format import PING_FRAME, MessageFormatter, sse_event
from inference.anthropic_openapi import (
    CountTokensRequestSerializer,
    CountTokensSerializer,
    MessageSerializer,
    MessagesRequestSerializer,
    anthropic_errors,
)
from inference.anthropic_request import COUNT_TOKENS, MESSAGES, rename, translate
from inference.api_views import SSE_MEDIA_TYPE, json_body
from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.errors import exception_handler as api_exception_handler
from inference.openai_request import CHAT, TOKENIZE, ParsedRequest, parse_request
from inference.openapi import IDEMPOTENCY_KEY, REQUEST_ID, RETRY_AFTER, SSE

log = logging.getLogger(__name__)
ANTHROPIC_NO_KEY = ("You didn't provide an API key. Send it as 'x-api-key: sk-...' or "
                    "'Authorization: Bearer sk-...'.")


def anthropic_exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    """The API's handler (status, headers, DRF's own exceptions), its body re-shaped as
    Anthropic's; anything else is logged and answered 500 ``api_error`` in that shape."""
    response = api_exception_handler(exc, context)
    if response is None:
        log.error("unexpected error in %s", context.get("view"), exc_info=exc)
        error = ApiError("internal_error", "The server had an error processing your request.")
        return Response(anthropic_format.api_error_body(error), status=error.status)
    body = anthropic_format.error_body(response.status_code, response.data)
    if body["error"]["code"] == "invalid_api_key" and response.status_code == 401 \
            and "Authorization" not in context["request"].headers \
            and "X-Api-Key" not in context["request"].headers:
        body["error"]["message"] = ANTHROPIC_NO_KEY
    response.data = body
    return response


class AnthropicErrors:
    """A view whose errors, from authentication on, are in Anthropic's shape."""

    def get_exception_handler(self) -> Callable[[Exception, dict[str, Any]], Response]:
        return anthropic_exception_handler


def _parse(kind: str, body: Any) -> tuple[ParsedRequest, int, bool]:
    """The body checked, as the chat request it stands for; its breakpoints and stream."""
    translated = translate(kind, body)
    try:
        parsed = parse_request(CHAT, translated.chat_body)
    except ApiError as error:
        raise rename(error) from None
    return parsed, translated.breakpoints, translated.stream


class MessagesView(AnthropicErrors, APIView):
    """POST /v1/messages: a message, or Anthropic's SSE events with ``stream: true``."""

    @extend_schema(
        operation_id="messages_create", summary="Create a message (Anthropic Messages API)",
        description="Anthropic-compatible: ``x-api-key`` or ``Authorization: Bearer``; "
        "``stream: true`` answers with Anthropic's server-sent events. Errors in "
        "Anthropic's shape.",
        tags=["messages"], request=MessagesRequestSerializer,
        parameters=[IDEMPOTENCY_KEY, REQUEST_ID, RETRY_AFTER],
        responses={(200, "application/json"): MessageSerializer, (200, SSE_MEDIA_TYPE): SSE,
                   **anthropic_errors(400, 401, 404, 405, 409, 429, 500, 503, 504)},
    )
    async def post(self, request: Request) -> JsonResponse | StreamingHttpResponse:
        body = json_body(request)
        await health.fresh_chat_tools(body)
        parsed, breakpoints, stream = _parse(MESSAGES, body)
        service.check_scope(request.auth, parsed)  # a replay too
        key = idempotency.key_digest(request.headers)
        if key is None:
            submission = await service.submit(request.auth, parsed)
        else:  # a retry of the key's request gets that request (a Replay), not a new one
            submission = await idempotency.submit(request.auth, parsed, key,
                                                  idempotency.body_digest(MESSAGES, body))
        formatter = MessageFormatter(submission.request_id, parsed.shown_model,
                                     parsed.tool_plan, breakpoints)
        replay = submission if isinstance(submission, idempotency.Replay) else None
        if stream:
            events = replay.events() if replay else service.events(submission)
            response = StreamingHttpResponse(_sse(formatter, events),
                                             content_type=SSE_MEDIA_TYPE)
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"  # nginx: pass each event on at once
        else:
            collected = await (replay.collect() if replay else service.collect(submission))
            response = JsonResponse(formatter.whole(collected.texts[0], collected.final))
        return _ids(response, submission.request_id)


class CountTokensView(AnthropicErrors, APIView):
    """POST /v1/messages/count_tokens: the prompt's tokens as the model sees it."""

    @extend_schema(
        operation_id="messages_count_tokens",
        summary="Count a message request's input tokens (Anthropic Messages API)",
        description="The rendered prompt's tokens with the model's own chat template (and "
        "the tool prompt), counted by a daemon of the model from its vocabulary, as "
        "/v1/tokenize is: no slot, no prefill.",
        tags=["messages"], request=CountTokensRequestSerializer,
        parameters=[REQUEST_ID, RETRY_AFTER],
        responses={200: CountTokensSerializer,
                   **anthropic_errors(400, 401, 404, 405, 429, 500, 503)},
    )
    async def post(self, request: Request) -> JsonResponse:
        body = json_body(request)
        await health.fresh_chat_tools(body)
        parsed, _, _ = _parse(COUNT_TOKENS, body)
        # the chat's messages (and its tools) as a tokenize job: the daemon renders and
        # counts them on its vocabulary thread, as it would render the chat
        parsed.kind, parsed.params = TOKENIZE, {}
        submission = await service.submit(request.auth, parsed)
        answer = service.vocab_answer(await service.vocab_end(submission))
        counted = answer.get("input_tokens")
        if type(counted) is not int:
            raise ApiError("internal_error", "The daemon did not count the prompt.")
        return _ids(JsonResponse({"input_tokens": counted}), submission.request_id)


def _ids(response: JsonResponse | StreamingHttpResponse,
         request_id: str) -> JsonResponse | StreamingHttpResponse:
    response["X-Request-Id"] = request_id
    response["request-id"] = request_id  # the header Anthropic's clients read
    return response


async def _sse(formatter: MessageFormatter,
               events: AsyncIterator[StreamEvent | None]) -> AsyncIterator[bytes]:
    """Anthropic's SSE events, one write per protocol event; ``ping`` after
    SSE_KEEPALIVE_S idle; a client that goes away mid-stream has its request cancelled
    unless it resumes (/v1/requests/<id>/events) within the grace."""
    async with aclosing(service.streamed(formatter.request_id, events, PING_FRAME,
                                         PING_FRAME)) as stream:
        async for event in stream:
            if isinstance(event, bytes):
                yield event
                continue
            pairs = formatter.events(event)
            frames = b"".join(
                sse_event(name, data, event.entry_id if i == len(pairs) - 1 else None)
                for i, (name, data) in enumerate(pairs))
            if frames:
                yield frames
