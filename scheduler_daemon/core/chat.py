"""Chat messages to prompt text with the model's template.

Which template: a configured one (``CHAT_TEMPLATE``: jinja2 text, or the name of a
llama.cpp built-in), else the GGUF's ``tokenizer.chat_template``, else the llama.cpp
built-in named for the model's architecture (Gemma 3 270M ships no template: ``gemma``).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wire.errors import InvalidParameter
from wire.messages import MAX_MESSAGES, ROLES

log = logging.getLogger(__name__)


def message_pairs(messages: Any) -> list[tuple[str, str]]:
    """(role, text) pairs of messages in the shape the web sends (``wire.messages``: a
    non-empty list of ``{"role", "content"}`` with text content). The web validated them;
    this checks only the shape, so a rogue job is refused instead of crashing a template.
    Text that is not valid Unicode is refused where it is measured (``core``)."""
    if not isinstance(messages, list) or not 0 < len(messages) <= MAX_MESSAGES:
        raise InvalidParameter("messages", f"must be a list of 1 to {MAX_MESSAGES} messages")
    pairs = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(role, str) or role not in ROLES:
            raise InvalidParameter(f"messages[{i}].role", f"must be one of {sorted(ROLES)}")
        if not isinstance(content, str):
            raise InvalidParameter(f"messages[{i}].content", "must be a string")
        pairs.append((role, content))
    return pairs



class TemplateSource(Protocol):
    def model_chat_template(self) -> str | None: ...
    def builtin_template_name(self) -> str: ...
    def apply_builtin_template(self, name: str, messages: Sequence[tuple[str, str]]) -> str: ...
    def token_text(self, token: int) -> str: ...
    @property
    def bos_token(self) -> int: ...
    @property
    def eos_token(self) -> int: ...
    @property
    def adds_bos(self) -> bool: ...


class ChatRenderer:
    """Renders messages for one model, ending with the assistant's turn to speak.

    ``segments`` keeps the template's own markup apart from what the messages say, so that
    message content is tokenized as plain text: a user who types the model's turn markers
    (``<end_of_turn>``) gets those characters, not a forged turn boundary.
    """

    def __init__(self, source: TemplateSource, configured: str = "") -> None:
        self._source = source
        template = configured or source.model_chat_template() or ""
        if template and "{" not in template:
            self.builtin, self._jinja = template, None
        elif template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self.builtin, self._jinja = None, env.from_string(template)
        else:
            self.builtin, self._jinja = source.builtin_template_name(), None
        self.kind = "jinja" if self._jinja else f"builtin:{self.builtin}"
        log.info("chat template: %s", self.kind)

    def render(self, messages: list[tuple[str, str]]) -> str:
        """Prompt text (markup and content together)."""
        return "".join(text for text, _ in self.segments(messages))

    def segments(self, messages: list[tuple[str, str]]) -> list[tuple[str, bool]]:
        """The prompt as (text, is_content) pieces in order: markup pieces come from the
        template, content pieces are message text exactly as the template placed it.

        Each content is wrapped in markers made of private-use characters and a fresh random
        nonce (no client can guess them), rendered, then cut apart at the markers."""
        nonce = secrets.token_hex(8)
        opening = f"{_MARK_OPEN}{nonce}{_MARK_END}"
        closing = f"{_MARK_CLOSE}{nonce}{_MARK_END}"
        wrapped = [(role, f"{opening}{content}{closing}") for role, content in messages]
        text = self._render_text(wrapped)
        pieces: list[tuple[str, bool]] = []
        rest = text
        while rest:
            start = rest.find(opening)
            if start < 0:
                break
            end = rest.find(closing, start + len(opening))
            if end < 0:
                raise InvalidParameter("messages", "the chat template mangled message content")
            if start:
                pieces.append((rest[:start], False))
            content = rest[start + len(opening) : end]
            if opening in content:
                raise InvalidParameter("messages", "the chat template mangled message content")
            if content:
                pieces.append((content, True))
            rest = rest[end + len(closing) :]
        if closing in rest:
            raise InvalidParameter("messages", "the chat template mangled message content")
        if rest:
            pieces.append((rest, False))
        return pieces

    def continuation_segments(self, messages: list[tuple[str, str]]) -> list[tuple[str, bool]]:
        """The pieces that follow an assistant's reply in a conversation, for ``messages``
        (a session's new turn): the reply's closing markup, each message, and the opening of
        the assistant's next turn. Cut from the template's rendering of a stand-in exchange
        (a user's message and the assistant's reply) followed by ``messages``, after the
        reply's content: whatever the template puts at a conversation's start (a BOS, a
        default system prompt) stays in the stand-in's part."""
        stand_in = [("user", "?"), ("assistant", "!")]
        pieces = self.segments(stand_in + messages)
        contents = [i for i, (_, is_content) in enumerate(pieces) if is_content]
        tail = pieces[contents[1] + 1:] if len(contents) > 1 else None
        wanted = sum(1 for _, content in messages if content)
        if tail is None or sum(1 for _, c in tail if c) != wanted or pieces[contents[1]][0] != "!":
            raise InvalidParameter("messages", "this model's chat template cannot continue "
                                   "a conversation with these messages; send the full history")
        return tail

    def _render_text(self, messages: list[tuple[str, str]]) -> str:
        """The template's text. A template's leading BOS is dropped when the tokenizer adds
        one (Gemma); a model whose tokenizer adds none keeps it (SmolLM2: its BOS is
        ``<|im_start|>``, the first turn's own marker)."""
        if self._jinja is None:
            return self._source.apply_builtin_template(self.builtin, messages)
        bos = self._source.token_text(self._source.bos_token)
        try:
            text = self._jinja.render(
                messages=[{"role": r, "content": c} for r, c in messages],
                add_generation_prompt=True,
                bos_token=bos,
                eos_token=self._source.token_text(self._source.eos_token),
            )
        except TemplateError as exc:
            raise InvalidParameter("messages", f"the chat template refused them: {exc}") from None
        if bos and self._source.adds_bos and text.startswith(bos):
            return text[len(bos) :]
        return text


# Content markers (Unicode private use area) around each message while the template runs.
_MARK_OPEN, _MARK_CLOSE, _MARK_END = "\ue000", "\ue001", "\ue002"


def _raise(message: str) -> None:
    raise TemplateError(message)
