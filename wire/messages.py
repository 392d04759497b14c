"""Chat messages as the wire carries them: an OpenAI ``messages`` list checked into
(role, text) pairs. The web checks them; the daemon renders them with the model's template
(scheduler_daemon/chat.py)."""

from __future__ import annotations

from typing import Any

from .errors import InvalidParameter
from .sampling import require_text

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
MAX_MESSAGES = 1024


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
        out.append((role, _content_text(message.get("content"), f"{where}.content")))
    return out


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
