"""A ``POST /v1/responses`` body (OpenAI's Responses API) checked and turned into a chat body.

The chat body then goes through ``openai_request.parse_request(CHAT, ...)``, so a response is
a chat completion for admission, limits, history, cancel and resume. What this module checks
is the Responses shape (every field's type, the input items, flat function tools,
``text.format``); what the chat parser checks after it (Unicode, sizes, sampling ranges,
tools' schemas) comes back with the Responses field's name in ``param`` (``_param``).

Fields are refused as ``unknown_parameter`` unless known here, as the chat endpoint does;
OpenAI fields this server does not implement are accepted while they ask for nothing it
would ignore (``_HARMLESS``). llama-server's sampling extras (``top_k``, ``seed``, ``stop``...)
pass through as on chat.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from inference import tools
from inference.errors import ApiError, invalid
from inference.openai_request import (
    CHAT,
    ParsedRequest,
    anything,
    flag,
    none_or,
    parse_request,
    refuse_unknown,
)
from wire.messages import MAX_MESSAGES
from wire.sampling import FIELD_NAMES

RESPONSE_ID = re.compile(r"resp_[0-9a-f]{32}", re.ASCII)
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_CALL_ID_CHARS = 256
FORMAT_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}", re.ASCII)
INPUT_ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")

# llama-server's extras, as on chat (max_tokens is max_output_tokens here; the output's
# format is text.format)
_EXTRAS = (FIELD_NAMES - {"max_tokens", "json_schema", "grammar", "logprobs"}) | {
    "cache_prompt", "timeout"}
_KNOWN = {
    "model", "input", "instructions", "tools", "tool_choice", "text", "max_output_tokens",
    "stream", "store", "previous_response_id", "metadata", "user", "parallel_tool_calls",
} | _EXTRAS


def _no_reasoning(value: Any) -> bool:
    return value is None or (isinstance(value, dict)
                             and all(v is None for v in value.values()))


# OpenAI fields not implemented here, accepted while they ask for nothing we would ignore.
_HARMLESS: dict[str, Callable[[Any], bool]] = {
    "include": none_or([]),
    "background": none_or(False),
    "reasoning": _no_reasoning,
    "truncation": none_or("disabled"),
    "max_tool_calls": none_or(1),
    "top_logprobs": none_or(0),
    "service_tier": anything,
    "prompt_cache_key": anything,
    "safety_identifier": anything,
    "stream_options": anything,
}


@dataclass(slots=True)
class ResponsesCall:
    """A checked Responses body: what the chat body is built from, and what the Response
    object echoes back."""

    model: str | None
    input: list[dict[str, Any]]  # this turn's chat messages (no instructions)
    sources: list[str]  # per message of ``input``: the item it came from ("input[3]")
    instructions: str | None = None
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    tools: list[dict[str, Any]] = field(default_factory=list)  # as sent (flat)
    tool_choice: Any = "auto"
    text_format: dict[str, Any] = field(default_factory=lambda: {"type": "text"})
    chat_fields: dict[str, Any] = field(default_factory=dict)  # passed on as they are

    def chat_body(self, earlier: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
        """The chat body: instructions, the earlier conversation (a previous response's),
        this turn's input; and the Responses field each chat message came from."""
        messages, sources = [], []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
            sources.append("instructions")
        messages += earlier
        sources += ["previous_response_id"] * len(earlier)
        messages += self.input
        sources += self.sources
        body = {"messages": messages, **self.chat_fields}
        if self.model is not None:
            body["model"] = self.model
        return body, sources


def read(body: Any) -> ResponsesCall:
    """Check a Responses body (ApiError 400 naming the field)."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    refuse_unknown(body, _KNOWN, _HARMLESS)
    model = body.get("model")
    previous = _previous_id(body.get("previous_response_id"))
    messages, sources = _input(body.get("input"), previous is not None)
    call = ResponsesCall(model=model, input=messages, sources=sources,
                         previous_response_id=previous)
    call.instructions = _optional_str(body, "instructions")
    call.store = flag(body, "store", True)
    call.metadata = _metadata(body.get("metadata"))
    chat = call.chat_fields
    for name in ("stream", "user", "parallel_tool_calls", "temperature", "top_p", *_EXTRAS):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    _tools(call, body.get("tools"), body.get("tool_choice"))
    _text(call, body.get("text"))
    return call


def parse(call: ResponsesCall, earlier: list[dict[str, Any]]) -> ParsedRequest:
    """The chat request of ``call`` after ``earlier`` (a previous response's conversation),
    checked by the chat parser; its errors name the Responses field."""
    body, sources = call.chat_body(earlier)
    try:
        return parse_request(CHAT, body)
    except ApiError as exc:
        param = _param(exc.param, sources)
        message = exc.message
        if param != exc.param and exc.param:
            message = message.replace(exc.param, param or "")
        raise ApiError(exc.code, message, param, status=exc.status, headers=exc.headers,
                       **exc.details) from None


_CHAT_NAMES = {"max_tokens": "max_output_tokens", "response_format": "text.format",
               "json_schema": "text.format", "messages": "input"}
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)", re.DOTALL)
_TOOL = re.compile(r"tools\[(\d+)\]\.function(.*)", re.DOTALL)
_ITEM = re.compile(r"input\[\d+\]")


def _param(param: str | None, sources: list[str]) -> str | None:
    """A chat field's name as the Responses field it came from."""
    if param is None:
        return None
    if param in _CHAT_NAMES:
        return _CHAT_NAMES[param]
    found = _MESSAGE.fullmatch(param)
    if found:
        index, rest = int(found[1]), found[2]
        if index >= len(sources):
            return "input"
        source = sources[index]
        # a message item's content parts are the chat message's, one for one
        if _ITEM.fullmatch(source) and rest.startswith((".content", ".role")):
            return source + rest
        return source
    found = _TOOL.fullmatch(param)
    if found:
        return f"tools[{found[1]}]{found[2]}"
    return param






def _optional_str(body: dict[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise invalid(name, f"{name} must be a string.")
    return value


def _previous_id(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise invalid("previous_response_id", "previous_response_id must be a string "
                                              "(a response's id).")
    return value


def _metadata(value: Any) -> dict[str, str]:
    """At most 16 string keys (64 characters) to string values (512), valid Unicode with no
    NUL (they are stored)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"metadata must be an object of at most {MAX_METADATA_KEYS} "
                                  "string keys and values.")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS or not isinstance(item, str) or len(
                item) > MAX_METADATA_VALUE_CHARS:
            raise invalid("metadata", f"metadata keys have at most {MAX_METADATA_KEY_CHARS} "
                                      f"characters, values are strings of at most "
                                      f"{MAX_METADATA_VALUE_CHARS}.")
        _stored_text("metadata", key)
        _stored_text("metadata", item)
    return dict(value)


def _stored_text(param: str, text: str) -> str:
    """Text that is stored as it is: valid Unicode, no NUL."""
    if "\x00" in text:
        raise invalid(param, f"{param} must not contain NUL characters.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(param, f"{param} must be valid Unicode (no lone surrogates).") from None
    return text


# -- input -------------------------------------------------------------------------------------


def _input(value: Any, continuing: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """This turn's input as chat messages, and the item each came from."""
    if value is None:
        raise invalid("input", "input is required.", "missing_required_parameter")
    if isinstance(value, str):
        return [{"role": "user", "content": value}], ["input"]
    if not isinstance(value, list) or not value or len(value) > MAX_MESSAGES:
        raise invalid("input", f"input must be a string or a list of 1 to {MAX_MESSAGES} "
                               "items.")
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    calls: list[dict[str, Any]] | None = None  # the assistant turn consecutive calls join
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(where, f"{where} must be an object (a message, a function_call or "
                                 "a function_call_output).")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "function_call":
            call = _function_call(item, where)
            if calls is None:
                calls = [call]
                messages.append({"role": "assistant", "content": None, "tool_calls": calls})
                sources.append(where)
            else:  # consecutive calls: one assistant turn
                calls.append(call)
            continue
        calls = None
        if kind == "message":
            messages.append(_message(item, where))
            sources.append(where)
        elif kind == "function_call_output":
            messages.append(_call_output(item, where))
            sources.append(f"{where}.output")
        else:
            raise invalid(f"{where}.type", f"{where}.type must be \"message\", "
                          "\"function_call\" or \"function_call_output\" (other item types "
                          "are not supported here).", "unsupported_parameter")
    return messages, sources


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or role not in INPUT_ROLES:
        raise invalid(f"{where}.role", f"{where}.role must be one of {list(INPUT_ROLES)}.")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise invalid(f"{where}.content", f"{where}.content must be a string or a list of "
                                          "input_text / output_text parts.")
    parts = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            raise invalid(f"{at}.type", f"{at} must be an input_text or output_text part "
                                        "(other content is not supported here).",
                          "unsupported_parameter")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{at}.text", f"{at}.text must be a string.")
        parts.append({"type": "text", "text": part["text"]})
    return {"role": role, "content": parts}


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _call_id(item, where)
    name = item.get("name")
    if not isinstance(name, str) or not tools.NAME.fullmatch(name):
        raise invalid(f"{where}.name", f"{where}.name must be 1 to 64 letters, digits, _ or -.")
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.arguments", f"{where}.arguments must be a string (JSON).")
    _valid_text(f"{where}.arguments", arguments)
    return {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _call_output(item: dict[str, Any], where: str) -> dict[str, Any]:
    call_id = _call_id(item, where)
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            at = f"{where}.output[{j}]"
            if not isinstance(part, dict) or part.get("type") != "input_text" or not isinstance(
                    part.get("text"), str):
                raise invalid(at, f"{at} must be an input_text part (other content is not "
                                  "supported here).", "unsupported_parameter")
            texts.append(part["text"])
        output = "".join(texts)
    if not isinstance(output, str):
        raise invalid(f"{where}.output", f"{where}.output must be a string or a list of "
                                         "input_text parts.")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _call_id(item: dict[str, Any], where: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id or len(call_id) > MAX_CALL_ID_CHARS:
        raise invalid(f"{where}.call_id", f"{where}.call_id must be a non-empty string of at "
                                          f"most {MAX_CALL_ID_CHARS} characters.")
    return _stored_text(f"{where}.call_id", call_id)


def _valid_text(param: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(param, f"{param} must be valid Unicode (no lone surrogates).") from None


# -- tools and the output's format ---------------------------------------------------------------


def _tools(call: ResponsesCall, value: Any, choice: Any) -> None:
    """Flat function tools as chat's nested ones; ``tool_choice`` likewise."""
    if value is not None:
        if not isinstance(value, list) or len(value) > tools.MAX_TOOLS:
            raise invalid("tools", f"tools must be a list of at most {tools.MAX_TOOLS} tools.")
        nested = []
        for i, tool in enumerate(value):
            where = f"tools[{i}]"
            if not isinstance(tool, dict):
                raise invalid(where, f"{where} must be an object.")
            if tool.get("type") != "function":
                raise invalid(f"{where}.type", 'Only "function" tools are supported here.',
                              "unsupported_parameter")
            if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
                raise invalid(f"{where}.strict", f"{where}.strict must be true or false.")
            function = {"name": tool.get("name")}
            if tool.get("description") is not None:
                function["description"] = tool["description"]
            if tool.get("parameters") is not None:
                function["parameters"] = tool["parameters"]
            nested.append({"type": "function", "function": function})
        call.tools = value
        call.chat_fields["tools"] = nested
    if choice is None:
        call.tool_choice = "auto"
        return
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        call.chat_fields["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(
            choice.get("name"), str) and set(choice) <= {"type", "name"}:
        call.chat_fields["tool_choice"] = {"type": "function",
                                           "function": {"name": choice["name"]}}
    else:
        raise invalid("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                                     '{"type": "function", "name": ...}.')
    call.tool_choice = choice


def _text(call: ResponsesCall, value: Any) -> None:
    """``text.format``: text (the default), json_object, or json_schema (its ``schema``
    constrains the output: chat's ``response_format``)."""
    if value is None:
        return
    if not isinstance(value, dict) or not set(value) <= {"format", "verbosity"}:
        raise invalid("text", 'text must be an object {"format": {...}}.')
    if value.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", 'text.verbosity other than "medium" is not '
                      "supported by this server.", "unsupported_parameter")
    spec = value.get("format")
    if spec is None:
        return
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "text" and set(spec) == {"type"}:
        pass
    elif kind == "json_object" and set(spec) == {"type"}:
        call.chat_fields["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and set(spec) <= {"type", "name", "schema", "strict",
                                                 "description"}:
        name, schema = spec.get("name"), spec.get("schema")
        if name is not None and not (isinstance(name, str) and FORMAT_NAME.fullmatch(name)):
            raise invalid("text.format.name", "text.format.name must be 1 to 64 letters, "
                                              "digits, _ or -.")
        if not isinstance(schema, dict):
            raise invalid("text.format.schema", "text.format.schema must be an object (a JSON "
                                                "schema).")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise invalid("text.format.strict", "text.format.strict must be true or false.")
        if spec.get("description") is not None and not isinstance(spec["description"], str):
            raise invalid("text.format.description",
                          "text.format.description must be a string.")
        call.chat_fields["response_format"] = {"type": "json_schema",
                                               "json_schema": {"schema": schema}}
    else:
        raise invalid("text.format", 'text.format must be {"type": "text"}, {"type": '
                      '"json_object"} or {"type": "json_schema", "name": ..., "schema": '
                      "{...}}.")
    call.text_format = spec
