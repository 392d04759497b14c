"""Protocol events as Anthropic Messages bodies, stream events and errors.

The reply of a ``/v1/messages`` request is the chat path's output read the Anthropic way:
its text as a ``text`` block, a tool call (``tools.read_reply``) as a ``tool_use`` block,
``finish_reason`` as ``stop_reason``, and the usage with Anthropic's cache fields
(``usage_of``). Errors, in the body or as a stream's ``error`` event, are Anthropic's
``{"type": "error", "error": {"type", "message"}}`` (``error_body``), with our code and the
field at fault added (``code``, ``param``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.tools import ToolPlan, read_reply
from wire import protocol
from wire.errors import TIMEOUT

PING_FRAME = b'event: ping\ndata: {"type":"ping"}\n\n'
# Anthropic's error types by our HTTP status (a code of its own first: ``_TYPE_OF_CODE``)
_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   504: "timeout_error"}
_TYPE_OF_CODE = {"request_too_large": "request_too_large"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_type(status: int, code: str | None = None) -> str:
    """Anthropic's error type for one of our errors."""
    if code in _TYPE_OF_CODE:
        return _TYPE_OF_CODE[code]
    if status in _TYPE_OF_STATUS:
        return _TYPE_OF_STATUS[status]
    return "api_error" if status >= 500 else "invalid_request_error"


def error_body(status: int, openai_error: dict[str, Any]) -> dict[str, Any]:
    """An error in Anthropic's shape from the OpenAI-shaped ``{"error": {...}}`` the rest
    of the API writes: Anthropic's type, the message, and our ``code``, ``param`` and
    details kept beside them."""
    inner = dict(openai_error.get("error") or {})
    code = inner.pop("code", None)
    inner.pop("type", None)
    message = inner.pop("message", None) or code or "error"
    return {"type": "error",
            "error": {"type": error_type(status, code), "message": message, "code": code,
                      **inner}}


def api_error_body(error: ApiError) -> dict[str, Any]:
    return error_body(error.status, error.body())


def message_id(request_id: str) -> str:
    return f"msg_{request_id.replace('-', '')}"


def usage_of(event: StreamEvent | None, breakpoints: int,
             prompt_tokens: int = 0) -> dict[str, int]:
    """Anthropic's usage from the chat usage of ``event`` (its terminal event; None: the
    stream's start, where only ``prompt_tokens`` is known). ``cache_read_input_tokens``:
    prompt tokens read from the tenant's prefix cache; ``cache_creation_input_tokens``: with
    a ``cache_control`` breakpoint in the request, the prompt tokens computed and kept as a
    reusable prefix (the cache keeps every prompt's prefix; without a breakpoint nothing is
    reported as written); ``input_tokens``: the rest, so that the three add up to the
    prompt."""
    usage = (event.data.get("usage") if event is not None else None) or {}
    details = usage.get("prompt_tokens_details") or {}
    prompt = _count(usage.get("prompt_tokens")) if usage else prompt_tokens
    read = min(prompt, _count(details.get("cached_tokens")))
    created = min(prompt - read, _count(details.get("cache_created_tokens"))) \
        if breakpoints else 0
    return {"input_tokens": prompt - read - created,
            "output_tokens": _count(usage.get("completion_tokens")),
            "cache_read_input_tokens": read, "cache_creation_input_tokens": created}


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def stop_of(event: StreamEvent, tool_call: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a ``done`` event."""
    reason = event.data.get("finish_reason")
    stop = event.data.get("stop")
    if reason == "stop" and isinstance(stop, str) and stop:
        return "stop_sequence", stop
    if tool_call and reason == "stop":
        return "tool_use", None
    return _STOP_REASONS.get(reason, reason or "end_turn"), None


def content_of(text: str, tool_plan: ToolPlan | None) -> tuple[list[dict[str, Any]], bool]:
    """The reply's content blocks, and whether it is a tool call."""
    if tool_plan is None:
        return ([{"type": "text", "text": text}] if text else []), False
    content, calls = read_reply(text, tool_plan)
    inputs = [json.loads(call["function"]["arguments"]) for call in calls]
    if not all(isinstance(value, dict) for value in inputs):  # a tool_use's input is an object
        content, calls, inputs = text, [], []
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for call, value in zip(calls, inputs, strict=True):
        blocks.append({"type": "tool_use", "id": _tool_use_id(call["id"]),
                       "name": call["function"]["name"], "input": value})
    return blocks, bool(calls)


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


@dataclass(slots=True)
class MessageFormatter:
    """One request's reply: the whole message, or its stream events."""

    request_id: str
    model: str
    tool_plan: ToolPlan | None = None
    breakpoints: int = 0
    _held: list[str] = field(default_factory=list)  # a tools reply, sent whole at the end
    _open_text: bool = False  # a text block is open (index 0)
    _blocks: int = 0  # content blocks started

    def _message(self, content: list[dict[str, Any]], stop_reason: str | None,
                 stop_sequence: str | None, usage: dict[str, int]) -> dict[str, Any]:
        return {"id": message_id(self.request_id), "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage}

    def whole(self, text: str, final: StreamEvent) -> dict[str, Any]:
        """The non-streaming body. An ``error`` final event raises ApiError (a ``timeout``
        one with the text made until then and its usage)."""
        if final.kind == protocol.ERROR:
            error = ApiError.from_event(final.data)
            if error.code == TIMEOUT:
                error.details.update(partial_text=text,
                                     usage=usage_of(final, self.breakpoints))
            raise error
        content, called = content_of(text, self.tool_plan)
        reason, sequence = stop_of(final, called)
        return self._message(content, reason, sequence, usage_of(final, self.breakpoints))

    def events(self, event: StreamEvent) -> list[tuple[str, dict[str, Any]]]:
        """The (event name, data) pairs one protocol event becomes (possibly none)."""
        if event.kind == protocol.ACCEPTED:
            prompt = _count(event.data.get("prompt_tokens"))
            usage = usage_of(None, self.breakpoints, prompt)
            return [("message_start", {"type": "message_start",
                                       "message": self._message([], None, None, usage)})]
        if event.kind == protocol.TOKEN:
            text = event.data.get("text", "")
            if self.tool_plan is not None:
                self._held.append(text)
                return []
            return self._text(text)
        if event.kind == protocol.DONE:
            out, called = [], False
            if self.tool_plan is not None:
                content, called = content_of("".join(self._held), self.tool_plan)
                for block in content:
                    out += self._whole_block(block)
            out += self._close_text()
            reason, sequence = stop_of(event, called)
            usage = usage_of(event, self.breakpoints)
            out.append(("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": reason,
                                                    "stop_sequence": sequence},
                                          "usage": usage}))
            out.append(("message_stop", {"type": "message_stop"}))
            return out
        if event.kind == protocol.ERROR:
            return [("error", api_error_body(ApiError.from_event(event.data)))]
        return []

    def _text(self, text: str) -> list[tuple[str, dict[str, Any]]]:
        if not text:
            return []
        out = []
        if not self._open_text:
            out.append(("content_block_start", {"type": "content_block_start",
                                                "index": self._blocks,
                                                "content_block": {"type": "text", "text": ""}}))
            self._open_text = True
        out.append(("content_block_delta", {"type": "content_block_delta",
                                            "index": self._blocks,
                                            "delta": {"type": "text_delta", "text": text}}))
        return out

    def _close_text(self) -> list[tuple[str, dict[str, Any]]]:
        if not self._open_text:
            return []
        self._open_text = False
        self._blocks += 1
        return [("content_block_stop", {"type": "content_block_stop",
                                        "index": self._blocks - 1})]

    def _whole_block(self, block: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if block["type"] == "text":
            return self._text(block["text"]) + self._close_text()
        index = self._blocks
        self._blocks += 1
        start = {**block, "input": {}}
        partial = json.dumps(block["input"], ensure_ascii=False, separators=(",", ":"))
        return [("content_block_start", {"type": "content_block_start", "index": index,
                                         "content_block": start}),
                ("content_block_delta", {"type": "content_block_delta", "index": index,
                                         "delta": {"type": "input_json_delta",
                                                   "partial_json": partial}}),
                ("content_block_stop", {"type": "content_block_stop", "index": index})]


def sse_event(name: str, data: dict[str, Any], entry_id: str | None = None) -> bytes:
    """One SSE event of Anthropic's stream; ``entry_id`` (the Redis entry id of the event
    it ends) lets Last-Event-ID resume after it."""
    payload = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {entry_id}\n" if entry_id else ""
    return f"{head}event: {name}\ndata: {payload}\n\n".encode()
