"""Chat messages as the wire carries them: an OpenAI ``messages`` list checked into
(role, text) pairs. The web checks them; the daemon renders them with the model's template
(scheduler_daemon/core/chat.py)."""

from __future__ import annotations

import json
from typing import Any

from .errors import InvalidParameter
from .sampling import require_text

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 1024
MAX_TOOL_CALLS = 64  # per assistant message of the history


def parse_messages(messages: Any) -> list[tuple[str, str]]:
    """Check an OpenAI ``messages`` list; return (role, text) pairs."""
    if not isinstance(messages, list) or not messages:
        raise InvalidParameter("messages", "must be a non-empty list")
    if len(messages) > MAX_MESSAGES:
        raise InvalidParameter("messages", f"at most {MAX_MESSAGES} messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidParameter(where, "must be an object with role and content")
        role = message.get("role")
        if not isinstance(role, str) or role not in ROLES:  # a dict or list is unhashable
            raise InvalidParameter(f"{where}.role", f"must be one of {sorted(ROLES)}")
        content = message.get("content")
        calls = message.get("tool_calls") if role == "assistant" else None
        if calls is None:
            out.append((role, _content_text(content, f"{where}.content")))
            continue
        # an earlier turn's calls, shown to the model as it is asked to write them
        text = _tool_calls_text(calls, f"{where}.tool_calls")
        if content not in (None, ""):
            text = f"{_content_text(content, f'{where}.content')}\n{text}"
        out.append((role, text))
    return out


def _tool_calls_text(calls: Any, where: str) -> str:
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_TOOL_CALLS:
        raise InvalidParameter(where, f"must be a list of 1 to {MAX_TOOL_CALLS} calls")
    lines = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise InvalidParameter(f"{where}[{i}].function",
                                   "must have a name and arguments (a string)")
        require_text(f"{where}[{i}].function.name", name)
        require_text(f"{where}[{i}].function.arguments", arguments)
        lines.append(call_text(name, arguments))
    return "\n".join(lines)


def call_text(name: str, arguments: str) -> str:
    """A call as the model is asked to write one (inference/tools.py): ``{"name": ...,
    "parameters": {...}}``; arguments that are not JSON are shown as the string they are."""
    try:
        parameters = json.loads(arguments)
    except (ValueError, RecursionError):
        parameters = arguments
    return json.dumps({"name": name, "parameters": parameters}, ensure_ascii=False,
                      separators=(",", ":"))


def _content_text(content: Any, where: str) -> str:
    """A message's text; it must be valid Unicode (``sampling.require_text``)."""
    if isinstance(content, str):
        return require_text(where, content)
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise InvalidParameter(
                    where, "only text parts ({'type': 'text', 'text': ...}) are supported"
                )
            parts.append(require_text(f"{where}[{i}].text", part["text"]))
        return "".join(parts)
    raise InvalidParameter(where, "must be a string or a list of text parts")
