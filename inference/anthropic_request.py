"""An Anthropic Messages body checked and translated into a chat-completions body.

``/v1/messages`` runs over the chat path (``openai_request.parse_request(CHAT, ...)``, then
``service``): this module checks what only Anthropic's shape has (content blocks,
``tool_use``/``tool_result``, ``cache_control``, custom tools, ``tool_choice``) and writes
the chat body the chat path checks again (sampling ranges, Unicode, sizes, schemas). Every
refusal is an ``ApiError`` naming the field in Anthropic's terms (``messages[2].content[0]``).

Mapped as Anthropic does: consecutive messages of one role are one turn (their text joined
by a blank line); a leading assistant message is kept as it is. Refused (400): image and
document blocks, thinking blocks, server tools (a ``type`` other than ``custom``), a last
message from the assistant (a prefill: the chat path has no way to continue a turn), more
than ``MAX_BREAKPOINTS`` ``cache_control`` breakpoints, and any field Anthropic does not
define for the endpoint (``unknown_parameter``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from inference.errors import ApiError, invalid
from inference.openai_request import flag
from wire.errors import InvalidParameter
from wire.sampling import require_text

MESSAGES = "messages"
COUNT_TOKENS = "count_tokens"
MAX_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks in one request
MAX_METADATA_USER_CHARS = 256
TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")
CACHE_TTLS = ("5m", "1h")
# Anthropic's own fields of each endpoint; anything else is refused as unknown.
_FIELDS = {
    MESSAGES: {"model", "max_tokens", "messages", "system", "tools", "tool_choice",
               "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata",
               "cache_control", "thinking", "service_tier", "output_config", "speed",
               "inference_geo", "diagnostics", "container", "user_profile_id",
               "workspace_id"},
    COUNT_TOKENS: {"model", "messages", "system", "tools", "tool_choice", "cache_control",
                   "thinking", "output_config"},
}
EFFORTS = (None, "low", "medium", "high", "xhigh", "max")
_TOOL_FIELDS = {"name", "description", "input_schema", "cache_control", "type", "strict"}
_CHOICE_TYPES = {"auto": "auto", "any": "required", "none": "none"}


@dataclass(slots=True)
class Translated:
    """A checked Anthropic body: the chat body it became, and what the reply needs."""

    chat_body: dict[str, Any]
    stream: bool
    breakpoints: int  # cache_control blocks (the usage's cache_creation_input_tokens)


def translate(kind: str, body: Any) -> Translated:
    """Check a ``/v1/messages`` (``kind`` MESSAGES) or ``count_tokens`` body; the chat body
    it stands for. Raises ApiError (400)."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    for name in body:
        if name not in _FIELDS[kind]:
            raise invalid(name, f"{name}: Extra inputs are not permitted", "unknown_parameter")
    model = body.get("model")
    if model is None:
        raise invalid("model", "model: Field required", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model must be a non-empty string.")
    breakpoints = _Breakpoints()
    breakpoints.check("cache_control", body.get("cache_control"))
    _thinking(body.get("thinking"))
    chat: dict[str, Any] = {"model": model}
    messages = _system(body.get("system"), breakpoints)
    messages += _messages(body.get("messages"), breakpoints)
    chat["messages"] = messages
    tools = _tools(body.get("tools"), breakpoints)
    if tools is not None:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    stream = False
    if kind == MESSAGES:
        _max_tokens(body, chat)
        stream = flag(body, "stream", False)
        _sampling(body, chat)
        _metadata(body.get("metadata"), chat)
        _hosting(body)
    _output_config(body.get("output_config"), chat)
    return Translated(chat, stream, breakpoints.count)


def _hosting(body: dict[str, Any]) -> None:
    """Fields about Anthropic's hosting (tier, speed, region, workspace, diagnostics):
    checked for their type, and meaning nothing here; a container is refused."""
    tier = body.get("service_tier")
    if tier is not None and tier not in ("auto", "standard_only"):
        raise invalid("service_tier", 'service_tier must be "auto" or "standard_only".')
    if body.get("speed") not in (None, "standard", "fast"):
        raise invalid("speed", 'speed must be "standard" or "fast".')
    for name in ("inference_geo", "user_profile_id", "workspace_id"):
        if body.get(name) is not None:
            _text(name, body[name], empty=True)
    diagnostics = body.get("diagnostics")
    if diagnostics is not None:
        if not isinstance(diagnostics, dict):
            raise invalid("diagnostics", "diagnostics must be an object.")
        _fields("diagnostics", diagnostics, {"previous_message_id"})
        if diagnostics.get("previous_message_id") is not None:
            _text("diagnostics.previous_message_id", diagnostics["previous_message_id"],
                  empty=True)
    if body.get("container") is not None:
        raise invalid("container", "Containers (code execution) are not supported here.",
                      "unsupported_parameter")


def _output_config(value: Any, chat: dict[str, Any]) -> None:
    """``output_config``: its ``format`` (a JSON schema) as chat's ``response_format``, the
    grammar the reply follows; ``effort`` is accepted and means nothing here."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("output_config", "output_config must be an object.")
    _fields("output_config", value, {"effort", "format"})
    if value.get("effort") not in EFFORTS:
        raise invalid("output_config.effort", "output_config.effort must be one of low, "
                                              "medium, high, xhigh, max.")
    output_format = value.get("format")
    if output_format is None:
        return
    if (not isinstance(output_format, dict) or output_format.get("type") != "json_schema"
            or not isinstance(output_format.get("schema"), dict)
            or not set(output_format) <= {"type", "schema"}):
        raise invalid("output_config.format", 'output_config.format must be {"type": '
                                              '"json_schema", "schema": {...}}.')
    chat["response_format"] = {"type": "json_schema",
                               "json_schema": {"schema": output_format["schema"]}}


class _Breakpoints:
    """``cache_control`` values checked and counted (at most MAX_BREAKPOINTS)."""

    def __init__(self) -> None:
        self.count = 0

    def check(self, where: str, value: Any) -> None:
        if value is None:
            return
        if (not isinstance(value, dict) or value.get("type") != "ephemeral"
                or not set(value) <= {"type", "ttl"}
                or value.get("ttl", "5m") not in CACHE_TTLS):
            raise invalid(where, f'{where} must be {{"type": "ephemeral"}}, with an optional '
                                 f'"ttl" of "5m" or "1h".')
        self.count += 1
        if self.count > MAX_BREAKPOINTS:
            raise invalid(where, f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control "
                                 "may be provided.")


def _thinking(value: Any) -> None:
    if value is None:
        return
    # adaptive: the model decides whether to think, and these models do not
    if isinstance(value, dict) and value.get("type") in ("disabled", "adaptive") \
            and set(value) <= {"type", "display"}:
        return
    raise invalid("thinking", 'Extended thinking is not supported here; send {"type": '
                              '"disabled"} or leave thinking out.', "unsupported_parameter")


def _text(where: str, value: Any, empty: bool = False) -> str:
    """A string of valid Unicode (non-empty unless ``empty``)."""
    if not isinstance(value, str):
        raise invalid(where, f"{where} must be a string.")
    if not value and not empty:
        raise invalid(where, f"{where}: text content blocks must be non-empty.")
    try:
        return require_text(where, value)
    except InvalidParameter as exc:
        raise invalid(exc.param, exc.message) from None


def _blocks(where: str, value: Any) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise invalid(where, f"{where} must be a string or a non-empty list of content blocks.")
    return value


def _block_type(where: str, block: Any, allowed: tuple[str, ...]) -> str:
    kind = block.get("type") if isinstance(block, dict) else None
    if not isinstance(kind, str):
        raise invalid(where, f"{where} must be an object with a type.")
    if kind in ("image", "document", "search_result", "container_upload"):
        raise invalid(f"{where}.type", f"{kind} blocks are not supported here (text only).",
                      "unsupported_parameter")
    if kind in ("thinking", "redacted_thinking"):
        raise invalid(f"{where}.type", "thinking blocks are not supported here (extended "
                                       "thinking is off).", "unsupported_parameter")
    if kind not in allowed:
        raise invalid(f"{where}.type", f"{where}.type must be one of {', '.join(allowed)}.")
    return kind


def _fields(where: str, block: dict[str, Any], allowed: set[str]) -> None:
    for name in block:
        if name not in allowed:
            raise invalid(f"{where}.{name}", f"{where}.{name}: Extra inputs are not permitted",
                          "unknown_parameter")


def _text_block(where: str, block: dict[str, Any], breakpoints: _Breakpoints) -> str:
    _fields(where, block, {"type", "text", "cache_control", "citations"})
    if block.get("citations") not in (None, []):
        raise invalid(f"{where}.citations", "citations are not supported here.",
                      "unsupported_parameter")
    breakpoints.check(f"{where}.cache_control", block.get("cache_control"))
    return _text(f"{where}.text", block.get("text"))


def _system(value: Any, breakpoints: _Breakpoints) -> list[dict[str, Any]]:
    """``system``: a string or text blocks (joined by a blank line), as a system message."""
    if value is None:
        return []
    if isinstance(value, str):
        text = _text("system", value, empty=True)
    else:
        parts = []
        for i, block in enumerate(_blocks("system", value)):
            where = f"system[{i}]"
            _block_type(where, block, ("text",))
            parts.append(_text_block(where, block, breakpoints))
        text = "\n\n".join(parts)
    return [{"role": "system", "content": text}] if text else []


def _messages(value: Any, breakpoints: _Breakpoints) -> list[dict[str, Any]]:
    """Anthropic's turns as chat messages: a user turn's ``tool_result`` blocks become
    ``tool`` messages (in their place among its text), an assistant turn's ``tool_use``
    blocks its ``tool_calls``; consecutive turns of one role are one turn."""
    if value is None:
        raise invalid("messages", "messages: Field required", "missing_required_parameter")
    if not isinstance(value, list) or not value:
        raise invalid("messages", "messages must be a non-empty list.")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"{where} must be an object with role and content.")
        _fields(where, message, {"role", "content"})
        role = message.get("role")
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", f'{where}.role must be "user" or "assistant".')
        content = message.get("content")
        if content is None:
            raise invalid(f"{where}.content", f"{where}.content: Field required",
                          "missing_required_parameter")
        turn = (_user_turn if role == "user" else _assistant_turn)(
            f"{where}.content", content, breakpoints)
        for item in turn:
            _append(out, item)
    if value[-1].get("role") == "assistant":
        raise invalid(f"messages[{len(value) - 1}]", "A final assistant message (a prefill) is "
                      "not supported here: end with a user message.", "unsupported_parameter")
    return out


def _append(out: list[dict[str, Any]], message: dict[str, Any]) -> None:
    """Add a chat message, merged into the one before when both are plain text of one role."""
    last = out[-1] if out else None
    if (last is not None and last["role"] == message["role"] != "tool"
            and "tool_calls" not in last and "tool_calls" not in message
            and isinstance(last["content"], str) and isinstance(message["content"], str)):
        last["content"] = f"{last['content']}\n\n{message['content']}"
        return
    out.append(message)


def _user_turn(where: str, content: Any, breakpoints: _Breakpoints) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": _text(where, content)}]
    turn: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(where, content)):
        at = f"{where}[{i}]"
        kind = _block_type(at, block, ("text", "tool_result"))
        if kind == "text":
            _append(turn, {"role": "user", "content": _text_block(at, block, breakpoints)})
        else:
            turn.append(_tool_result(at, block, breakpoints))
    return turn


def _tool_result(where: str, block: dict[str, Any],
                 breakpoints: _Breakpoints) -> dict[str, Any]:
    _fields(where, block, {"type", "tool_use_id", "content", "is_error", "cache_control"})
    breakpoints.check(f"{where}.cache_control", block.get("cache_control"))
    tool_use_id = block.get("tool_use_id")
    if not isinstance(tool_use_id, str) or not TOOL_USE_ID.fullmatch(tool_use_id):
        raise invalid(f"{where}.tool_use_id", f"{where}.tool_use_id must be 1 to 256 letters, "
                                              "digits, _ or -.")
    is_error = block.get("is_error")
    if is_error is not None and not isinstance(is_error, bool):
        raise invalid(f"{where}.is_error", f"{where}.is_error must be true or false.")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = _text(f"{where}.content", content, empty=True)
    else:
        if not isinstance(content, list):
            raise invalid(f"{where}.content", f"{where}.content must be a string or a list "
                                              "of text blocks.")
        parts = []
        for i, part in enumerate(content):
            at = f"{where}.content[{i}]"
            _block_type(at, part, ("text",))
            parts.append(_text_block(at, part, breakpoints))
        text = "\n\n".join(parts)
    if is_error:
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": tool_use_id, "content": text}


def _assistant_turn(where: str, content: Any,
                    breakpoints: _Breakpoints) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "assistant", "content": _text(where, content)}]
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for i, block in enumerate(_blocks(where, content)):
        at = f"{where}[{i}]"
        kind = _block_type(at, block, ("text", "tool_use"))
        if kind == "text":
            texts.append(_text_block(at, block, breakpoints))
        else:
            calls.append(_tool_use(at, block, breakpoints))
    message: dict[str, Any] = {"role": "assistant", "content": "\n\n".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    elif message["content"] is None:  # pragma: no cover (a non-empty list has a block)
        message["content"] = ""
    return [message]


def _tool_use(where: str, block: dict[str, Any], breakpoints: _Breakpoints) -> dict[str, Any]:
    # caller and toolset_name: what the SDK's ToolUseBlock sends back (a direct call only)
    _fields(where, block, {"type", "id", "name", "input", "cache_control", "caller",
                           "toolset_name"})
    breakpoints.check(f"{where}.cache_control", block.get("cache_control"))
    if block.get("caller") not in (None, {"type": "direct"}) or block.get(
            "toolset_name") is not None:
        raise invalid(f"{where}.caller", "Only direct tool calls are supported here.",
                      "unsupported_parameter")
    call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not TOOL_USE_ID.fullmatch(call_id):
        raise invalid(f"{where}.id", f"{where}.id must be 1 to 256 letters, digits, _ or -.")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.name", f"{where}.name must be a non-empty string.")
    _text(f"{where}.name", name)
    if not isinstance(arguments, dict):
        raise invalid(f"{where}.input", f"{where}.input must be an object.")
    try:  # 1e999 parses as inf: no strict JSON holds it
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise invalid(f"{where}.input", f"{where}.input must be JSON (no NaN or Infinity).") \
            from None
    _text(f"{where}.input", text, empty=True)  # no lone surrogate in a key or a value
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _tools(value: Any, breakpoints: _Breakpoints) -> list[dict[str, Any]] | None:
    """Custom tools (``name``, ``description``, ``input_schema``) as chat's function tools;
    their checks (names, sizes, schema bounds) are the chat path's."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("tools", "tools must be a list.")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise invalid(where, f"{where} must be an object.")
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise invalid(f"{where}.type", f"{where}.type: server tools ({kind!r}) are not "
                          'supported here; only custom tools (no type, or "custom").',
                          "unsupported_parameter")
        _fields(where, tool, _TOOL_FIELDS)
        breakpoints.check(f"{where}.cache_control", tool.get("cache_control"))
        strict = tool.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise invalid(f"{where}.strict", f"{where}.strict must be true or false.")
        schema = tool.get("input_schema")
        if schema is None:
            raise invalid(f"{where}.input_schema", f"{where}.input_schema: Field required",
                          "missing_required_parameter")
        if not isinstance(schema, dict) or schema.get("type") != "object":
            # as Anthropic: a tool_use block's input is an object, so is the schema
            raise invalid(f"{where}.input_schema", f"{where}.input_schema.type: Input "
                          "should be 'object'")
        function: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none"):
        raise invalid("tool_choice", 'tool_choice must be {"type": "auto" | "any" | "tool" | '
                                     '"none"} ("tool" with a name).')
    allowed = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _fields("tool_choice", value, allowed)
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("tool_choice.disable_parallel_tool_use",
                          "disable_parallel_tool_use must be true or false.")
        chat["parallel_tool_calls"] = not parallel  # a turn has one call at most either way
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str) or not name:
            raise invalid("tool_choice.name", 'tool_choice {"type": "tool"} needs the name '
                                              "of a tool.")
        chat["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        chat["tool_choice"] = _CHOICE_TYPES[kind]


def _max_tokens(body: dict[str, Any], chat: dict[str, Any]) -> None:
    value = body.get("max_tokens")
    if value is None:
        raise invalid("max_tokens", "max_tokens: Field required", "missing_required_parameter")
    if type(value) is not int or value < 1:
        raise invalid("max_tokens", "max_tokens must be an integer of at least 1.")
    chat["max_tokens"] = value




def _sampling(body: dict[str, Any], chat: dict[str, Any]) -> None:
    """``temperature`` (0 to 1, as Anthropic's), ``top_p``, ``top_k`` and ``stop_sequences``
    as chat's fields (their types and ranges checked by the chat path)."""
    temperature = body.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
                or not 0 <= temperature <= 1:
            raise invalid("temperature", "temperature must be a number from 0 to 1.")
        chat["temperature"] = temperature
    for name in ("top_p", "top_k"):
        if body.get(name) is not None:
            chat[name] = body[name]
    stops = body.get("stop_sequences")
    if stops is not None:
        if not isinstance(stops, list):
            raise invalid("stop_sequences", "stop_sequences must be a list of strings.")
        if stops:
            chat["stop"] = stops


def _metadata(value: Any, chat: dict[str, Any]) -> None:
    """``metadata.user_id``: the chat's ``user`` (the request's session for routing)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("metadata", "metadata must be an object.")
    _fields("metadata", value, {"user_id"})
    user = value.get("user_id")
    if user is None:
        return
    if not isinstance(user, str) or len(user) > MAX_METADATA_USER_CHARS:
        raise invalid("metadata.user_id", f"metadata.user_id must be a string of at most "
                                          f"{MAX_METADATA_USER_CHARS} characters.")
    if user:
        chat["user"] = user


def rename(error: ApiError) -> ApiError:
    """A chat-path refusal named in Anthropic's terms: chat's fields (``stop``,
    ``tools[0].function.parameters``) as this body's (``stop_sequences``,
    ``tools[0].input_schema``)."""
    param = error.param or ""
    for pattern, replacement in _RENAMES:
        new = pattern.sub(replacement, param)
        if new != param:
            error.message = error.message.replace(param, new)
            error.param = new
            break
    return error


_RENAMES = (
    (re.compile(r"^stop$"), "stop_sequences"),
    (re.compile(r"^response_format"), "output_config.format"),
    (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
    (re.compile(r"^tools\[(\d+)\]\.function\.(name|description)"), r"tools[\1].\2"),
    (re.compile(r"^tools\[(\d+)\]\.function$"), r"tools[\1]"),
)
