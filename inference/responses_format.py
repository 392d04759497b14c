"""A request's events as OpenAI Response objects and the Responses API's typed stream events.

One ``ResponseFormatter`` per request: ``whole`` builds the non-streaming Response from the
collected text and the terminal event; ``events`` turns each stream event into typed events
(``response.created``, ``response.output_text.delta``, ... ``response.completed``), each with
its ``sequence_number``; ``frame`` writes one as SSE (``event:`` + ``data:``). Item ids derive
from the request id, so a replay (Idempotency-Key) answers the same ids.

The text a model writes under tools is held until its end (as on chat: a call is read from the
whole output, ``tools.read_reply``), then sent as a message and/or function_call items.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.openai_format import usage_of
from inference.responses_request import ResponsesCall
from inference.tools import ToolPlan, read_reply
from wire import protocol
from wire.errors import TIMEOUT
from wire.sampling import SamplingParams

_DEFAULTS = SamplingParams()


def response_id(request_id: str) -> str:
    """A response's id: ``resp_`` and its request's id (hex)."""
    return f"resp_{uuid.UUID(request_id).hex}"


def usage(chat_usage: dict[str, Any]) -> dict[str, Any]:
    """Chat's usage as the Responses API's."""
    details = chat_usage.get("prompt_tokens_details") or {}
    prompt = int(chat_usage.get("prompt_tokens") or 0)
    completion = int(chat_usage.get("completion_tokens") or 0)
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": int(details.get("cached_tokens") or 0),
                                     "cache_write_tokens": int(
                                         details.get("cache_created_tokens") or 0)},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


@dataclass(slots=True)
class Output:
    """What a finished request answered: the Response's output items, and the same turn as
    chat messages (the stored conversation's next entry)."""

    items: list[dict[str, Any]]
    messages: list[dict[str, Any]]


@dataclass(slots=True)
class ResponseFormatter:
    """Builds one request's Response objects and stream events."""

    request_id: str
    model: str
    created: int
    call: ResponsesCall
    params: dict[str, Any]  # the chat request's sampling fields (the echoed ones)
    tool_plan: ToolPlan | None = None
    _sequence: int = field(default=0, repr=False)
    _text: list[str] = field(default_factory=list, repr=False)
    _message_open: bool = field(default=False, repr=False)
    finished: Output | None = None  # a stream's output, once its end is formatted

    @property
    def id(self) -> str:
        return response_id(self.request_id)

    @property
    def _hex(self) -> str:
        return uuid.UUID(self.request_id).hex

    # -- whole ------------------------------------------------------------------------------

    def whole(self, text: str, final: StreamEvent) -> tuple[dict[str, Any], Output]:
        """The Response of a finished request and its output; an ``error`` final event
        raises ApiError (a ``timeout`` one with the text made until then and its usage)."""
        if final.kind == protocol.ERROR:
            error = ApiError.from_event(final.data)
            if error.code == TIMEOUT:
                error.details.update(partial_text=text, usage=usage(usage_of(final)))
            raise error
        output = self.output(text, final)
        return self.body(final, output.items), output

    def output(self, text: str, final: StreamEvent) -> Output:
        """The output items of ``text`` (a message, and/or a call read from a tools reply)."""
        status = "completed" if final.data.get("finish_reason") == "stop" else "incomplete"
        content: str | None = text
        calls: list[dict[str, Any]] = []
        if self.tool_plan is not None:
            content, calls = read_reply(text, self.tool_plan)
        items = []
        if content is not None or not calls:
            items.append(self._message(content or "", status))
        for i, call in enumerate(calls):
            items.append(self._function_call(i, call["id"], call["function"]["name"],
                                             call["function"]["arguments"]))
        message: dict[str, Any] = {"role": "assistant", "content": content or ""}
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
        return Output(items, [message])

    def body(self, final: StreamEvent | None, items: list[dict[str, Any]],
             status: str | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        """The Response object: ``final`` gives its status and usage (None: in progress)."""
        reason = final.data.get("finish_reason") if final is not None else None
        incomplete = None
        if status is None:
            if final is None:
                status = "in_progress"
            elif reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            elif reason == "cancelled":
                status = "cancelled"
            else:
                status = "completed"
        call = self.call
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": error, "incomplete_details": incomplete,
            "instructions": call.instructions, "max_output_tokens": self.params.get(
                "max_tokens"),
            "model": self.model, "output": items,
            "parallel_tool_calls": call.chat_fields.get("parallel_tool_calls", True),
            "previous_response_id": call.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": call.store,
            "temperature": self.params.get("temperature", _DEFAULTS.temperature),
            "text": {"format": call.text_format}, "tool_choice": call.tool_choice,
            "tools": call.tools, "top_p": self.params.get("top_p", _DEFAULTS.top_p),
            "truncation": "disabled",
            "usage": usage(usage_of(final)) if final is not None and status != "failed"
            else None,
            "user": call.chat_fields.get("user"), "metadata": call.metadata,
            "background": False,
        }

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": f"msg_{self._hex}", "role": "assistant",
                "status": status, "content": [self._part(text)]}

    @staticmethod
    def _part(text: str) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _function_call(self, index: int, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{self._hex}_{index}", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    # -- streamed -------------------------------------------------------------------------------

    def events(self, event: StreamEvent) -> list[dict[str, Any]]:
        """The typed stream events one protocol event becomes (possibly none)."""
        if event.kind == protocol.ACCEPTED:
            created = self.body(None, [])
            return [self._event("response.created", response=created),
                    self._event("response.in_progress", response=created)]
        if event.kind == protocol.TOKEN:
            text = event.data.get("text", "")
            if (event.data.get("index") or 0) != 0 or not text:
                return []
            self._text.append(text)
            if self.tool_plan is not None:  # read whole at the end
                return []
            return [*self._open_message(), self._delta(text)]
        if event.kind == protocol.DONE:
            return self._finish(event)
        if event.kind == protocol.ERROR:
            error = ApiError.from_event(event.data)
            items = []
            if self._message_open:
                items.append(self._message("".join(self._text), "incomplete"))
            failed = self.body(None, items, status="failed",
                               error={"code": error.code, "message": error.message})
            return [self._event("response.failed", response=failed)]
        return []

    def _finish(self, final: StreamEvent) -> list[dict[str, Any]]:
        output = self.finished = self.output("".join(self._text), final)
        out: list[dict[str, Any]] = []
        for index, item in enumerate(output.items):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if not self._message_open:
                    out += self._open_message()
                    if text:
                        out.append(self._delta(text))
                out += [
                    self._event("response.output_text.done", item_id=item["id"],
                                output_index=index, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=item["id"],
                                output_index=index, content_index=0, part=self._part(text)),
                ]
            else:
                added = {**item, "arguments": "", "status": "in_progress"}
                out += [
                    self._event("response.output_item.added", output_index=index, item=added),
                    self._event("response.function_call_arguments.delta", item_id=item["id"],
                                output_index=index, delta=item["arguments"]),
                    self._event("response.function_call_arguments.done", item_id=item["id"],
                                output_index=index, name=item["name"],
                                arguments=item["arguments"]),
                ]
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        body = self.body(final, output.items)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        out.append(self._event(kind, response=body))
        return out

    def _open_message(self) -> list[dict[str, Any]]:
        if self._message_open:
            return []
        self._message_open = True
        item = {**self._message("", "in_progress"), "content": []}
        return [self._event("response.output_item.added", output_index=0, item=item),
                self._event("response.content_part.added", item_id=item["id"], output_index=0,
                            content_index=0, part=self._part(""))]

    def _delta(self, text: str) -> dict[str, Any]:
        return self._event("response.output_text.delta", item_id=f"msg_{self._hex}",
                           output_index=0, content_index=0, delta=text, logprobs=[])

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event


def frame(entry_id: str | None, event: dict[str, Any]) -> bytes:
    """One typed event as SSE: ``event: <type>``, ``data: <JSON>``; the id is the Redis
    entry's (a client may resume the request's stream after it: /v1/requests/<id>/events)."""
    data = json.dumps(event, separators=(",", ":"), ensure_ascii=False)
    head = f"id: {entry_id}\n" if entry_id else ""
    return f"{head}event: {event['type']}\ndata: {data}\n\n".encode()
