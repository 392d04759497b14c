"""Checking an OpenAI-style request body before anything is queued.

Sampling fields are checked by ``wire.sampling`` and chat messages by ``wire.messages``
(pure Python, no llama_cpp), so the web refuses exactly what the daemon would. Every
refusal is a 400 naming the field. The list of accepted fields is in docs/api.md; anything
else is refused as ``unknown_parameter``.

Text must be valid Unicode (no lone surrogates) wherever it enters, and what may reach the
database (``session``/``user``) has no NUL character (PostgreSQL text cannot hold one). A
prompt's UTF-8 size is capped by ``MAX_PROMPT_BYTES`` before anything tokenizes it.
"""
from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, NoReturn

from django.conf import settings

from inference import tools
from inference.errors import ApiError, invalid
from inference.models import MAX_ADAPTER_SCALE, MIN_ADAPTER_SCALE, is_adapter_scale
from wire import affinity, protocol, sessions
from wire.errors import CONTEXT_LENGTH_EXCEEDED, NO_SESSION, InvalidParameter
from wire.messages import parse_messages
from wire.sampling import FIELD_NAMES, RANGES, SamplingParams, require_text

COMPLETION = "completion"
CHAT = "chat"
MAX_SESSION_CHARS = 200
# JSON bodies nested deeper are refused (a JSON schema needs a handful of levels). Python's
# json module would raise RecursionError near 1000, and deep values break later code.
MAX_JSON_DEPTH = 64

_COMMON = {
    "model", "stream", "stream_options", "n", "max_completion_tokens", "response_format",
    "cache_prompt", "session", "user", "cache_scope", "timeout", "session_id", "continue",
    "lora",
} | FIELD_NAMES


def none_or(*allowed: Any) -> Callable[[Any], bool]:
    """The check of a field accepted but not acted on: absent, null, or one of ``allowed``
    (the values under which ignoring it is right); also used by inference/responses_request."""
    def check(value: Any) -> bool:
        return value is None or any(value == a and type(value) is type(a) for a in allowed)

    return check


def anything(value: Any) -> bool:
    """The check of a field accepted and ignored whatever its value (metadata-like)."""
    return True


def _falsy(value: Any) -> bool:
    return value in (None, False, 0)


# OpenAI fields we do not implement but accept while they ask for nothing we would ignore.
_HARMLESS_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": none_or([]),
    "function_call": none_or("none", "auto"),
    "modalities": none_or(["text"]),
    "store": anything,
    "metadata": anything,
    "service_tier": anything,
    "prompt_cache_key": anything,
    "safety_identifier": anything,
}
_HARMLESS_COMPLETION: dict[str, Callable[[Any], bool]] = {
    "best_of": none_or(1),
    "suffix": none_or(""),
}
_KNOWN = {
    CHAT: (_COMMON | {"messages", "top_logprobs", "tools", "tool_choice",
                      "parallel_tool_calls"}, _HARMLESS_CHAT),
    COMPLETION: (_COMMON | {"prompt", "echo"}, _HARMLESS_COMPLETION),
}


@dataclass(slots=True)
class ParsedRequest:
    """A checked request, ready to become a ``protocol.Job``."""

    kind: str
    model: str
    stream: bool = False
    include_usage: bool = False
    prompt: str | list[int] | None = None
    messages: list[dict[str, str]] | None = None
    params: dict[str, Any] = field(default_factory=dict)
    session: str = ""
    cache_prompt: bool | None = None
    timeout_s: float | None = None  # the client's ``timeout``, at most REQUEST_TIMEOUT_S
    tool_plan: tools.ToolPlan | None = None  # a chat with tools: how its reply is read
    tools: dict[str, Any] | None = None  # the job's tools, for a template that renders them
    # what its affinity chain is cut from when the template renders the tools: the messages
    # as the generic prompt shows them (the tools first, the calls as text), so that jobs
    # sharing a long tools prefix share their chains as the rendered prompts share it
    affinity_messages: list[dict[str, Any]] | None = None
    request_id: str | None = None  # set by an Idempotency-Key claim (None: a new uuid)
    retention_s: int | None = None  # its events' retention (None: the protocol's default)
    echo: bool = False  # a completion's prompt text first in its reply
    n: int = 1  # choices (prefilled once, sampled n ways)
    prompts: list[str | list[int]] | None = None  # a completion's several prompts
    # a session's turn (wire/sessions.py): its id, and how it begins: "new" (made now),
    # "continue" (prompt/messages are only the new turn), "reset" (a full history)
    session_id: str | None = None
    session_mode: str | None = None
    # a tenant's adapter (docs/adapters.md): ``model`` is the base model; what the client
    # sent as ``model``; the adapter ``<base>:<name>`` names, ``lora``'s name and scale;
    # once resolved (inference/adapters.py) the adapter's name and the job's ``adapter``
    model_sent: str = ""
    alias_name: str | None = None
    lora_name: str | None = None
    lora_scale: float | None = None
    adapter_name: str | None = None
    adapter: dict[str, Any] | None = None

    @property
    def shown_model(self) -> str:
        """The model replies and the history name: ``<base>:<adapter>`` or the base."""
        name = self.adapter_name or self.alias_name or self.lora_name
        return f"{self.model}:{name}" if name else self.model

    @property
    def choices(self) -> int:
        """How many choices the reply has: n for each prompt."""
        return self.n * (len(self.prompts) if self.prompts else 1)

    def job(self, request_id: str, tenant_id: str,
            max_queued: int | None = None) -> protocol.Job:
        """The queued form; the cache scope is the tenant, whatever the client sent.
        ``max_queued``: the tenant's own cap on waiting jobs (None: the daemon's default).
        Its deadline starts now: the daemon ends it with ``timeout`` past it."""
        return protocol.Job(
            id=request_id, kind=self.kind, model=self.model, tenant_id=tenant_id,
            cache_scope=tenant_id, prompt=self.prompt, messages=self.messages,
            params=self.params, session=self.session or None, cache_prompt=self.cache_prompt,
            max_queued=max_queued,
            deadline=time.time() + (self.timeout_s or settings.REQUEST_TIMEOUT_S),
            retention_s=self.retention_s or int(settings.STREAM_RETENTION_S),
            watched=settings.RESUME_GRACE_S > 0,  # readers keep its watch key (inference/watch.py)
            echo=self.echo,
            n=self.n,
            prompts=self.prompts,
            session_id=self.session_id,
            continue_session=self.session_mode == "continue",
            adapter=self.adapter,
            tools=self.tools,
            **self._routing(tenant_id),
        )

    def _routing(self, tenant_id: str) -> dict[str, Any]:
        """Its affinity chain and session hash, salted by the tenant (wire/affinity.py):
        generation only (tokenize and embeddings go to whichever daemon has room)."""
        if self.kind not in (protocol.COMPLETION_KIND, protocol.CHAT_KIND):
            return {}
        salt = _tenant_salt(tenant_id)
        text = affinity.prompt_text(self.prompt, self.affinity_messages or self.messages,
                                    self.prompts)
        chain = affinity.job_chain(salt, text, protocol.adapter_tag(self.adapter))
        return {"affinity": chain or None,
                "session_hash": affinity.session_hash(salt, self.session) if self.session
                else None}


def _tenant_salt(tenant_id: str) -> bytes:
    return _salt(settings.SECRET_KEY, tenant_id)


@functools.lru_cache(maxsize=4096)
def _salt(secret: str, tenant_id: str) -> bytes:
    return affinity.tenant_salt(secret, tenant_id)


def load_json(raw: bytes | str) -> Any:
    """A request body's JSON; ApiError 400 ``parse_error`` when it is not JSON (not UTF-8,
    NaN/Infinity, nested deeper than MAX_JSON_DEPTH)."""
    try:
        # Strict UTF-8 (RFC 8259): json.loads would guess UTF-16/32 for bytes, and decode
        # UTF-8-encoded surrogates ("surrogatepass") into text no encoder takes back.
        text = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        value = json.loads(text or "null", parse_constant=_no_constant)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise ApiError("parse_error", "We could not parse the JSON body of your request.") from None
    if _brackets(raw) > MAX_JSON_DEPTH and _nested_deeper(value, MAX_JSON_DEPTH):
        raise ApiError("parse_error",
                       f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep.")
    return value


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def _brackets(raw: bytes | str) -> int:
    """How many ``[`` and ``{`` the text holds: a bound on its depth, quick to count."""
    if isinstance(raw, str):
        return raw.count("[") + raw.count("{")
    return raw.count(b"[") + raw.count(b"{")


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether lists/objects nest more than ``limit`` levels (iterative: no recursion)."""
    stack = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


def parse_request(kind: str, body: Any) -> ParsedRequest:
    """Check a completions (``kind`` "completion") or chat body; raise ApiError (400)."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    refuse_unknown(body, *_KNOWN[kind])
    parsed = ParsedRequest(kind=kind, model=_model(body.get("model")))
    _adapter_choice(parsed, body.get("lora"))
    parsed.stream = flag(body, "stream", False)
    parsed.include_usage = _include_usage(body.get("stream_options"))
    if _present(body, "n"):
        if type(body["n"]) is not int or not 1 <= body["n"] <= protocol.MAX_CHOICES:
            raise invalid("n", f"n must be an integer from 1 to {protocol.MAX_CHOICES}.")
        parsed.n = body["n"]
    parsed.session = _session(body)
    cache_prompt = body.get("cache_prompt")
    parsed.cache_prompt = None if cache_prompt is None else flag(body, "cache_prompt", True)
    if kind == CHAT:
        parsed.messages = _messages(body.get("messages"))
        parsed.tool_plan = _tool_plan(body)
    else:
        prompt = _prompt(body.get("prompt"))
        if isinstance(prompt, tuple):  # several prompts
            parsed.prompts = list(prompt)
        else:
            parsed.prompt = prompt
        parsed.echo = flag(body, "echo", False)
    if parsed.choices > protocol.MAX_CHOICES:
        raise invalid("n" if parsed.prompts is None else "prompt",
                      f"At most {protocol.MAX_CHOICES} choices in all (prompts x n).")
    parsed.params = _sampling(_chat_logprobs(body) if kind == CHAT else body)
    if parsed.echo and parsed.params.get("logprobs") is not None:
        raise invalid("echo", "echo with logprobs is not built here (it needs the prompt's "
                              "own logprobs); send one of them.", "unsupported_parameter")
    if parsed.tool_plan is not None:
        if parsed.n > 1:
            raise invalid("n", "n > 1 with tools is not built here; send n=1.",
                          "unsupported_parameter")
        if any(name in parsed.params for name in ("grammar", "json_schema")):
            name = next(n for n in ("grammar", "json_schema", "response_format")
                        if body.get(n) is not None)
            raise invalid(name, f"{name} cannot be combined with tools (the tool call has a "
                                "grammar of its own); send tool_choice \"none\" to use it.")
        _with_tools(parsed, body["messages"])
        # the grammar every reply follows (bounds checked by tools.plan, compiled by the daemon)
        parsed.params["json_schema"] = parsed.tool_plan.schema
    parsed.timeout_s = _timeout(body.get("timeout"))
    _session_turn(parsed, body)
    return parsed


def _adapter_choice(parsed: ParsedRequest, lora: Any) -> None:
    """``"model": "<base>:<adapter>"`` and ``"lora": {"name": ..., "scale": ...}`` (both
    optional; the scale a finite number in (0, MAX_ADAPTER_SCALE]); which adapter they name
    is resolved with the tenant's rows when the request is queued (inference/adapters.py)."""
    parsed.model_sent = parsed.model
    if ":" in parsed.model:
        parsed.model, _, parsed.alias_name = parsed.model.rpartition(":")
    if lora is None:
        return
    if not isinstance(lora, dict) or not set(lora) <= {"name", "scale"}:
        raise invalid("lora", 'lora must be an object {"name": <adapter>, "scale": <number>} '
                              "(scale optional).")
    name, scale = lora.get("name"), lora.get("scale")
    if not isinstance(name, str) or not name:
        raise invalid("lora", "lora.name must be the name of one of your adapters.")
    parsed.lora_name = _text("lora", name, nul=False)
    if scale is not None:
        if not is_adapter_scale(scale):
            raise invalid("lora", f"lora.scale must be a number more than {MIN_ADAPTER_SCALE:g} "
                                  f"and at most {MAX_ADAPTER_SCALE:g}.")
        parsed.lora_scale = float(scale)


def _session_turn(parsed: ParsedRequest, body: dict[str, Any]) -> None:
    """``session_id`` and ``continue`` (docs/api.md, "Sessions"): ``"new"`` opens a session,
    an id with ``continue: true`` sends only the new turn, an id without it a full history
    that replaces the session's. A string that is no id of ours is no session (404)."""
    session_id, cont = body.get("session_id"), flag(body, "continue", False)
    if session_id is None:
        if cont:
            raise invalid("continue", "continue needs a session_id.")
        return
    if not isinstance(session_id, str):
        raise invalid("session_id", 'session_id must be a string: "new" or a session\'s id.')
    if session_id == "new":
        if cont:
            raise invalid("continue", 'A new session has nothing to continue: send '
                                      '"continue": false with the full history.')
        parsed.session_id, parsed.session_mode = sessions.new_id(), "new"
    elif not sessions.is_id(session_id):
        raise ApiError(NO_SESSION, "No such session: send the full history with "
                                   '"session_id": "new".', param="session_id")
    else:
        parsed.session_id, parsed.session_mode = session_id, "continue" if cont else "reset"
    if parsed.choices > 1:
        raise invalid("n", "A session's turn has one choice.", "unsupported_parameter")
    if parsed.tool_plan is not None:
        raise invalid("tools", "Sessions with tools are not built here; send the full "
                               "history without session_id.", "unsupported_parameter")
    if parsed.session_mode == "continue":
        if parsed.echo:
            raise invalid("echo", "echo cannot be combined with continue.",
                          "unsupported_parameter")
        if parsed.kind == COMPLETION and not (isinstance(parsed.prompt, str) and parsed.prompt):
            raise invalid("prompt", "A continued completion's prompt is the new text (a "
                                    "non-empty string).")
    if not parsed.session:  # its turns go to the daemon and slot that hold it
        parsed.session = parsed.session_id


TOKENIZE = protocol.TOKENIZE_KIND
DETOKENIZE = protocol.DETOKENIZE_KIND
_VOCAB_FIELDS = {
    TOKENIZE: {"model", "content", "add_special", "with_pieces"},
    DETOKENIZE: {"model", "tokens"},
}


def parse_vocab_request(kind: str, body: Any) -> ParsedRequest:
    """A ``/v1/tokenize`` body (``content``, ``add_special`` false, ``with_pieces`` false)
    or a ``/v1/detokenize`` one (``tokens``: ids), llama-server's shapes plus ``model``
    (default: the first of MODELS); raise ApiError (400). The daemon checks the ids
    against its vocabulary."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    for name in body:
        if name not in _VOCAB_FIELDS[kind]:
            raise invalid(name, f"Unrecognized request argument supplied: {name}",
                          "unknown_parameter")
    parsed = ParsedRequest(kind=kind, model=_model(body.get("model")),
                           retention_s=protocol.ANSWER_RETENTION_S)  # its answer is read once
    if kind == TOKENIZE:
        content = body.get("content")
        if content is None:
            raise invalid("content", "content is required.", "missing_required_parameter")
        if not isinstance(content, str):
            raise invalid("content", "content must be a string.")
        _check_size("content", len(_text("content", content).encode("utf-8")))
        parsed.prompt = content
        parsed.params = {"add_special": flag(body, "add_special", False),
                         "with_pieces": flag(body, "with_pieces", False)}
    else:
        tokens = body.get("tokens")
        if tokens is None:
            raise invalid("tokens", "tokens is required.", "missing_required_parameter")
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise invalid("tokens", "tokens must be a list of token ids (integers >= 0).")
        if len(tokens) > protocol.MAX_DETOKENIZE_TOKENS:
            raise invalid("tokens", f"at most {protocol.MAX_DETOKENIZE_TOKENS} tokens.")
        parsed.prompt = tokens
    return parsed


EMBEDDING = protocol.EMBEDDING_KIND
_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "user", "dimensions"}


def parse_embeddings_request(body: Any) -> tuple[ParsedRequest, str]:
    """A ``/v1/embeddings`` body: ``input`` a string, a list of strings, a list of token
    ids or a list of such lists (at most MAX_EMBEDDING_INPUTS, none empty, their text at
    most MAX_PROMPT_BYTES); ``encoding_format`` ``float`` (default) or ``base64``. Returns
    the request (its ``prompt``: the list of inputs) and the encoding. ApiError 400."""
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.")
    for name in body:
        if name not in _EMBEDDING_FIELDS:
            raise invalid(name, f"Unrecognized request argument supplied: {name}",
                          "unknown_parameter")
    if body.get("dimensions") is not None:
        raise invalid("dimensions", "dimensions is not supported: vectors have the model's "
                                    "size.", "unsupported_parameter")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise invalid("encoding_format", 'encoding_format must be "float" or "base64".')
    parsed = ParsedRequest(kind=EMBEDDING, model=_model(body.get("model")),
                           retention_s=protocol.ANSWER_RETENTION_S)  # its answer is read once
    parsed.session = _session(body)
    value = body.get("input")
    if value is None:
        raise invalid("input", "input is required.", "missing_required_parameter")
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and all(type(t) is int for t in value)):
        value = [value]  # one input: a string or one list of token ids
    if not isinstance(value, list) or not 0 < len(value) <= protocol.MAX_EMBEDDING_INPUTS:
        raise invalid("input", f"input must be a string or a list of 1 to "
                               f"{protocol.MAX_EMBEDDING_INPUTS} inputs.")
    size = 0
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if isinstance(item, str):
            if not item:
                raise invalid(where, f"{where} must not be empty.")
            size += len(_text(where, item).encode("utf-8"))
        elif not (isinstance(item, list) and item
                  and all(type(t) is int and t >= 0 for t in item)):
            raise invalid(where, f"{where} must be a non-empty string or list of token ids.")
        elif len(item) > protocol.EMBEDDING_N_CTX:
            raise ApiError(CONTEXT_LENGTH_EXCEEDED, f"{where} has {len(item)} tokens; an input "
                           f"has at most {protocol.EMBEDDING_N_CTX}.", where)
    ids = sum(len(item) for item in value if isinstance(item, list))
    if ids > protocol.MAX_EMBEDDING_TOKENS:
        raise ApiError(CONTEXT_LENGTH_EXCEEDED, f"input has {ids} tokens; a request has at most "
                       f"{protocol.MAX_EMBEDDING_TOKENS}.", "input")
    _check_size("input", size)
    parsed.prompt = value
    return parsed, encoding


def _timeout(value: Any) -> float | None:
    """Seconds > 0, capped by the server's REQUEST_TIMEOUT_S (None: the server's)."""
    if value is None:
        return None
    # ints are compared as ints: a 400-digit one would overflow float()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise invalid("timeout", "timeout must be a number of seconds greater than 0.")
    if isinstance(value, float) and not math.isfinite(value):  # 1e999 parses as inf
        raise invalid("timeout", "timeout must be a finite number of seconds.")
    return float(min(value, settings.REQUEST_TIMEOUT_S))


def _present(body: dict[str, Any], name: str) -> bool:
    return body.get(name) is not None


def refuse_unknown(body: dict[str, Any], known: Collection[str],
                   harmless: dict[str, Callable[[Any], bool]]) -> None:
    """A field neither ``known`` nor ``harmless`` is a 400 ``unknown_parameter``; a harmless
    one (accepted, not acted on) whose check fails, ``unsupported_parameter``."""
    for name, value in body.items():
        if name in known:
            continue
        if name not in harmless:
            raise invalid(name, f"Unrecognized request argument supplied: {name}",
                          "unknown_parameter")
        if not harmless[name](value):
            raise invalid(name, f"{name}={value!r:.200} is not supported by this server.",
                          "unsupported_parameter")


def _model(value: Any) -> str:
    if value is None:
        return settings.MODELS[0]
    if not isinstance(value, str) or not value:
        raise invalid("model", "model must be a non-empty string.")
    return _text("model", value, nul=False)


def _text(name: str, value: str, nul: bool = True) -> str:
    """``value`` if it is valid Unicode (and, unless ``nul``, holds no NUL character)."""
    try:
        require_text(name, value)
    except InvalidParameter as exc:
        _refuse(exc)
    if not nul and "\x00" in value:
        raise invalid(name, f"{name} must not contain NUL characters.")
    return value


def _refuse(exc: InvalidParameter) -> NoReturn:
    raise invalid(exc.param, exc.message) from None


def _check_size(param: str, size: int) -> None:
    """The prompt's text is at most MAX_PROMPT_BYTES of UTF-8 (checked before tokenizing)."""
    limit = settings.MAX_PROMPT_BYTES
    if size > limit:
        raise ApiError(
            CONTEXT_LENGTH_EXCEEDED, f"The {param} text is {size} bytes (UTF-8); this server "
            f"takes at most {limit} bytes (MAX_PROMPT_BYTES).", param,
            prompt_bytes=size, max_prompt_bytes=limit,
        )


def flag(body: dict[str, Any], name: str, default: bool) -> bool:
    """A true-or-false field (``default`` when absent or null), else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(name, f"{name} must be true or false.")
    return value


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid("stream_options", "stream_options must be an object.")
    return flag(options, "include_usage", False) if "include_usage" in options else False


def _session(body: dict[str, Any]) -> str:
    """``session``, else OpenAI's ``user`` (cut to MAX_SESSION_CHARS); both are checked."""
    found = []
    for name in ("session", "user"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise invalid(name, f"{name} must be a string.")
        if name == "session" and len(value) > MAX_SESSION_CHARS:
            raise invalid(name, f"session must have at most {MAX_SESSION_CHARS} characters.")
        found.append(_text(name, value, nul=False))
    return found[0][:MAX_SESSION_CHARS] if found else ""


def _messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise invalid("messages", "messages is required.", "missing_required_parameter")
    try:
        pairs = parse_messages(value)
    except InvalidParameter as exc:
        _refuse(exc)
    _check_size("messages", sum(len(text.encode("utf-8")) for _, text in pairs))
    return [{"role": role, "content": text} for role, text in pairs]


def _prompt(value: Any) -> str | list[int] | tuple[str | list[int], ...]:
    """A string, token ids, or (a tuple) several of them: OpenAI's batch forms."""
    if value is None:
        raise invalid("prompt", "prompt is required.", "missing_required_parameter")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]  # OpenAI's batch form with a single prompt
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        items: list[str | list[int]] = []
        for i, item in enumerate(value):
            where = f"prompt[{i}]"
            if isinstance(item, str) and item:
                items.append(_text(where, item))
            elif isinstance(item, list) and item and all(type(t) is int and t >= 0
                                                         for t in item):
                items.append(item)
            else:
                raise invalid(where, f"{where} must be a non-empty string or list of token "
                                     "ids.")
        total = sum(len(p.encode("utf-8")) for p in items if isinstance(p, str))
        _check_size("prompt", total)
        return items[0] if len(items) == 1 else tuple(items)
    if isinstance(value, str):
        if not value:
            raise invalid("prompt", "prompt must not be empty.", "empty_prompt")
        _check_size("prompt", len(_text("prompt", value).encode("utf-8")))
        return value
    if isinstance(value, list) and all(type(t) is int and t >= 0 for t in value):
        if not value:
            raise invalid("prompt", "prompt must not be empty.", "empty_prompt")
        return value
    raise invalid("prompt", "prompt must be a string or a list of token ids "
                            "(batches of several prompts are not supported).")


def _with_tools(parsed: ParsedRequest, raw_messages: list[Any]) -> None:
    """The tools shown to the model: through its template when its daemons say it renders
    them (``health.chat_tools``: the job carries them, the history's calls in their own
    shape), else by the generic prompt, a system message (inference/tools.py)."""
    from inference.health import chat_tools  # reads the daemons' snapshots (Redis)

    plan, messages = parsed.tool_plan, parsed.messages or []
    family = chat_tools(parsed.model) if plan is not None else None
    if plan is not None and family in tools.FAMILIES:
        generic = plan
        try:
            parsed.tool_plan = plan = tools.native(plan, family)
        except InvalidParameter as exc:
            _refuse(exc)
        parsed.tools = tools.job_tools(plan)
        parsed.affinity_messages = tools.with_tools(messages, generic)
        parsed.messages = tools.native_messages(raw_messages, messages)
        size = len(json.dumps(parsed.tools, ensure_ascii=False).encode("utf-8")) + sum(
            len(c["arguments"].encode("utf-8")) for m in parsed.messages
            for c in m.get("tool_calls", ()))
    elif plan is not None:
        parsed.messages = tools.with_tools(messages, plan)
        size = 0
    else:
        return
    _check_size("messages", size + sum(len(m["content"].encode("utf-8"))
                                       for m in parsed.messages))


def _tool_plan(body: dict[str, Any]) -> tools.ToolPlan | None:
    try:
        return tools.plan(body)
    except InvalidParameter as exc:
        _refuse(exc)


def _chat_logprobs(body: dict[str, Any]) -> dict[str, Any]:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` (0-20) as the one sampling
    field ``logprobs`` (alternatives per token; absent: none computed). Completions send
    that field as it is (``logprobs``: an integer)."""
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise invalid("logprobs", "logprobs must be true or false.")
    body = {k: v for k, v in body.items() if k not in ("logprobs", "top_logprobs")}
    if top is not None and not wanted:
        raise invalid("top_logprobs", "top_logprobs needs logprobs set to true.")
    if wanted:
        if top is not None:
            try:
                _ranged_int("top_logprobs", top, "logprobs")
            except InvalidParameter as exc:
                _refuse(exc)
        body["logprobs"] = 0 if top is None else top
    return body


def _ranged_int(name: str, value: Any, field: str) -> int:
    lo, hi = RANGES[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise InvalidParameter(name, f"{name} must be an integer from {lo} to {hi}.")
    return value


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields as sent (aliases resolved), checked by SamplingParams."""
    params = {name: body[name] for name in FIELD_NAMES if body.get(name) is not None}
    renamed: dict[str, str] = {}
    alias = body.get("max_completion_tokens")
    if alias is not None:
        if "max_tokens" in params and params["max_tokens"] != alias:
            raise invalid("max_completion_tokens", "max_tokens and max_completion_tokens differ.")
        params["max_tokens"], renamed["max_tokens"] = alias, "max_completion_tokens"
    schema = _response_format_schema(body.get("response_format"))
    if schema is not None:
        if "json_schema" in params:
            raise invalid("response_format", "Give json_schema or response_format, not both.")
        params["json_schema"], renamed["json_schema"] = schema, "response_format"
    if "grammar" in params and "json_schema" in params:
        raise invalid("grammar", "Give a grammar or a JSON schema, not both.")
    try:
        SamplingParams.from_dict(params)
    except InvalidParameter as exc:
        param = renamed.get(exc.param or "", exc.param)
        message = exc.message.replace(f"{exc.param}:", f"{param}:", 1)
        raise invalid(param, message, exc.code) from None
    return params


def _response_format_schema(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format as a JSON schema (None: plain text)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        return schema if isinstance(schema, dict) else {"type": "object"}
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else value.get("schema")
        if isinstance(schema, dict):
            return schema
        raise invalid("response_format", "response_format.json_schema.schema must be an object.")
    raise invalid("response_format",
                  "response_format.type must be 'text', 'json_object' or 'json_schema'.")
