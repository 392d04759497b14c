"""Chat messages to prompt text with the model's template.

Which template: a configured one (``CHAT_TEMPLATE``: jinja2 text, or the name of a
llama.cpp built-in), else the GGUF's ``tokenizer.chat_template``, else the llama.cpp
built-in named for the model's architecture (Gemma 3 270M ships no template: ``gemma``).

Tools: a jinja template that renders the ``tools`` variable, and whose tool-call format
this service parses (``TOOL_FAMILIES``: Hermes/Qwen's ``<tool_call>`` JSON ``</tool_call>``),
gets a job's tools and its history's calls in its own shape (``tools_family``, published
in the daemon's snapshot as ``chat_tools``). Every tenant string inside them that is more
than a plain word (``PLAIN_WORD``) is a content piece, like message text: a description
holding ``<|im_end|>`` is those characters, never the special token.

A default system prompt (the catalog's, ``default_system``) is the first message of a
conversation whose messages have no system or developer message of their own.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import Sequence
from typing import Any, Protocol

from jinja2 import TemplateError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from wire.errors import InvalidParameter
from wire.messages import MAX_MESSAGES, MAX_TOOL_CALLS, ROLES

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


def message_calls(messages: list[Any]) -> dict[int, list[dict[str, Any]]]:
    """The assistant messages' ``tool_calls`` (a jobs with tools, for a template that
    renders them): message index -> ``[{"name", "arguments"}]``, names and arguments
    strings (arguments as the client sent them: JSON text, parsed when they render)."""
    calls: dict[int, list[dict[str, Any]]] = {}
    for i, message in enumerate(messages):
        raw = message.get("tool_calls") if isinstance(message, dict) else None
        if raw is None:
            continue
        if message.get("role") != "assistant" or not isinstance(raw, list) \
                or not 0 < len(raw) <= MAX_TOOL_CALLS \
                or not all(isinstance(c, dict) and set(c) == {"name", "arguments"}
                           and isinstance(c["name"], str) and isinstance(c["arguments"], str)
                           for c in raw):
            raise InvalidParameter(f"messages[{i}].tool_calls",
                                   "must be a list of {name, arguments} strings")
        calls[i] = raw
    return calls



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

    def __init__(self, source: TemplateSource, configured: str = "",
                 default_system: str = "") -> None:
        self._source = source
        self.default_system = default_system
        template = configured or source.model_chat_template() or ""
        uses_tools = False
        if template and "{" not in template:
            self.builtin, self._jinja = template, None
        elif template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            env.filters["tojson"] = _tojson  # transformers' (no HTML escaping)
            self.builtin, self._jinja = None, env.from_string(template)
            uses_tools = "tools" in meta.find_undeclared_variables(env.parse(template))
        else:
            self.builtin, self._jinja = source.builtin_template_name(), None
        self.kind = "jinja" if self._jinja else f"builtin:{self.builtin}"
        self.tools_family = self._tools_family(template) if uses_tools else None
        log.info("chat template: %s, tools: %s", self.kind, self.tools_family or "generic")

    def _tools_family(self, template: str) -> str | None:
        """The tool-call format this template asks for, when it renders tools (a probe
        tool's name is in its output) and the format is one this service parses."""
        family = next((name for name, mark in TOOL_FAMILIES.items() if mark in template), None)
        if family is None:
            return None
        probe = {"type": "function", "function": {"name": _PROBE, "description": "",
                                                  "parameters": {"type": "object"}}}
        try:
            text = self._render_text([("user", "?")], tools=[probe])
        except InvalidParameter:
            return None
        return family if _PROBE in text else None

    def render(self, messages: list[tuple[str, str]], tools: list[dict[str, Any]] | None = None,
               calls: dict[int, list[dict[str, Any]]] | None = None) -> str:
        """Prompt text (markup and content together)."""
        return "".join(text for text, _ in self.segments(messages, tools, calls))

    def segments(self, messages: list[tuple[str, str]], tools: list[dict[str, Any]] | None = None,
                 calls: dict[int, list[dict[str, Any]]] | None = None) -> list[tuple[str, bool]]:
        """The prompt as (text, is_content) pieces in order: markup pieces come from the
        template, content pieces are message text (and tenant text in ``tools`` and the
        history's ``calls``) exactly as the template placed it. ``tools``: OpenAI tool
        objects, for a template that renders them (``tools_family``); ``calls``: message
        index -> its tool calls (``message_calls``). The default system prompt comes first
        when no message is a system or developer one."""
        if self.default_system and not any(r in ("system", "developer") for r, _ in messages):
            messages = [("system", self.default_system), *messages]
            calls = {i + 1: c for i, c in (calls or {}).items()}
        return self._segments(messages, tools, calls)

    def _segments(self, messages: list[tuple[str, str]], tools: list[dict[str, Any]] | None = None,
                  calls: dict[int, list[dict[str, Any]]] | None = None) -> list[tuple[str, bool]]:
        """``segments`` without the default system prompt.

        Each content is wrapped in markers made of private-use characters and a fresh random
        nonce (no client can guess them), rendered, then cut apart at the markers."""
        if (tools or calls) and self.tools_family is None:
            raise InvalidParameter("tools", "this model's chat template does not render tools")
        nonce = secrets.token_hex(8)
        opening = f"{_MARK_OPEN}{nonce}{_MARK_END}"
        closing = f"{_MARK_CLOSE}{nonce}{_MARK_END}"

        def wrap(value: Any) -> Any:
            return _wrap_strings(value, opening, closing)

        # an empty content stays empty: a template's ``if message.content`` sees it so
        wrapped = [(role, f"{opening}{content}{closing}" if content else "")
                   for role, content in messages]
        try:
            text = self._render_text(
                wrapped, tools=None if tools is None else [wrap(t) for t in tools],
                calls={i: [{"type": "function", "function": {
                    "name": wrap(c["name"]), "arguments": wrap(_arguments(c["arguments"]))}}
                    for c in each] for i, each in (calls or {}).items()})
        except RecursionError:  # tools nested deeper than the web lets through (a rogue job)
            raise InvalidParameter("tools", "nest too deeply to render") from None
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
        if rest:
            pieces.append((rest, False))
        if any(not is_content and _MARKS.search(text) for text, is_content in pieces):
            # a marker left in the markup (or escaped there: ``| string``, an ASCII
            # ``tojson``) would leave tenant text among the markup's special tokens
            raise InvalidParameter("messages", "the chat template mangled message content")
        return pieces

    def continuation_segments(self, messages: list[tuple[str, str]]) -> list[tuple[str, bool]]:
        """The pieces that follow an assistant's reply in a conversation, for ``messages``
        (a session's new turn): the reply's closing markup, each message, and the opening of
        the assistant's next turn. Cut from the template's rendering of a stand-in exchange
        (a user's message and the assistant's reply) followed by ``messages``, after the
        reply's content: whatever the template puts at a conversation's start (a BOS, a
        default system prompt) stays in the stand-in's part."""
        stand_in = [("user", "?"), ("assistant", "!")]
        pieces = self._segments(stand_in + messages)
        contents = [i for i, (_, is_content) in enumerate(pieces) if is_content]
        tail = pieces[contents[1] + 1:] if len(contents) > 1 else None
        wanted = sum(1 for _, content in messages if content)
        if tail is None or sum(1 for _, c in tail if c) != wanted or pieces[contents[1]][0] != "!":
            raise InvalidParameter("messages", "this model's chat template cannot continue "
                                   "a conversation with these messages; send the full history")
        return tail

    def _render_text(self, messages: list[tuple[str, str]],
                     tools: list[dict[str, Any]] | None = None,
                     calls: dict[int, list[dict[str, Any]]] | None = None) -> str:
        """The template's text. A template's leading BOS is dropped when the tokenizer adds
        one (Gemma); a model whose tokenizer adds none keeps it (SmolLM2: its BOS is
        ``<|im_start|>``, the first turn's own marker)."""
        if self._jinja is None:
            return self._source.apply_builtin_template(self.builtin, messages)
        bos = self._source.token_text(self._source.bos_token)
        shown = [{"role": r, "content": c} for r, c in messages]
        for i, each in (calls or {}).items():
            shown[i]["tool_calls"] = each
        extra = {} if tools is None else {"tools": tools}
        try:
            text = self._jinja.render(
                messages=shown,
                **extra,
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
_MARKS = re.compile(r"[\ue000-\ue002]|\\[uU]0*[eE]00[0-2]")


# The tool-call formats parsed back (inference/tools.py), each known by its template's text.
TOOL_FAMILIES = {"hermes": "<tool_call>"}
# Tenant strings of these characters only (names, JSON-schema keywords) stay in the markup,
# where a template may compare them; they cannot spell a special token's text.
PLAIN_WORD = re.compile(r"[A-Za-z0-9_$-]*")
_PROBE = "probe_tool_7f3c"


def _wrap_strings(value: Any, opening: str, closing: str) -> Any:
    """``value`` with every string (keys too) that is not a plain word between the content
    markers: the template may place them anywhere, the tokenizer reads them as text."""
    if isinstance(value, str):
        return value if PLAIN_WORD.fullmatch(value) else f"{opening}{value}{closing}"
    if isinstance(value, dict):
        return {_wrap_strings(k, opening, closing): _wrap_strings(v, opening, closing)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_wrap_strings(v, opening, closing) for v in value]
    return value


def _arguments(text: str) -> Any:
    """A history call's arguments as the object templates show (``| tojson``), or the text
    as it is when it is not a JSON object."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) and _depth(value) <= MAX_ARGUMENTS_DEPTH else text


MAX_ARGUMENTS_DEPTH = 64  # deeper arguments render as their text (the renderer recurses)


def _depth(value: Any) -> int:
    """How deeply lists and objects nest in ``value`` (counted without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                   else item))
    return deepest


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson`` filter (jinja2's escapes HTML), never ASCII-escaped: the
    content markers must come through as they are."""
    return json.dumps(value, ensure_ascii=False, indent=indent,
                      separators=tuple(separators) if separators else None, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def tool_grammar(family: str, call_gbnf: str, mode: str) -> str:
    """The grammar of a reply in ``family``'s format, from the GBNF of one call's JSON
    (``{"name": ..., "arguments": ...}``, llama.cpp's conversion of the job's schema):
    ``mode`` "call": one call; "auto": one call, or text that does not begin with ``<``
    (the call's first character; a reply that is not a call is free text). The call's
    ``root`` is renamed as a rule only: a literal ``"root"`` (a tool's name, an enum value)
    stays what it says; the wrapper's rules take names the call's grammar does not use."""
    if family not in TOOL_FAMILIES:
        raise InvalidParameter("tools", f"no grammar for the tool-call format {family!r}")
    taken = set(_RULE_DEF.findall(call_gbnf))
    call_rule, call_json, text_rule = (_fresh(name, taken) for name in
                                       ("tool-call", "tool-call-json", "tool-text"))
    body = "".join(call_json if token == "root" else token
                   for token in _GBNF_TOKEN.findall(call_gbnf))
    call = rf'"<tool_call>\n" {call_json} "\n</tool_call>"'
    if mode == "auto":
        return f"root ::= {call_rule} | {text_rule}\n{call_rule} ::= {call}\n" \
               f"{text_rule} ::= [^<] [^\\x00]*\n{body}"
    return f"root ::= {call}\n{body}"


def _fresh(name: str, taken: set[str]) -> str:
    """``name``, or ``name`` with a number, unused in ``taken`` (then taken)."""
    fresh, i = name, 0
    while fresh in taken:
        i += 1
        fresh = f"{name}-{i}"
    taken.add(fresh)
    return fresh


_RULE_DEF = re.compile(r"^\s*([A-Za-z0-9-]+)\s*::=", re.MULTILINE)
# GBNF's lexemes, so that a rule name is told from the same letters in a literal, a
# character class or a comment: each of those is one token, a name another
_GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*|[A-Za-z0-9-]+'
                         r'|[^"\[#A-Za-z0-9-]+|.', re.DOTALL)
