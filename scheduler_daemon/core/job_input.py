"""A wire job (``wire.protocol.Job``) as the core's arguments: the daemon trusts the shape.

The web validated the request before queueing it (``inference/openai_request.py``: every
sampling field through ``SamplingParams.from_dict``, messages through
``wire.messages.parse_messages``, sizes) and sends what it validated. The daemon does not
validate again; it re-checks only the wire shape, cheaply, so that a job written by
something else (a rogue writer, a bug, an old web) is refused with the field's name
instead of crashing a thread:

- the scalar fields have their wire types (``cache_scope`` and ``session`` strings,
  ``cache_prompt`` a bool, ``max_queued`` a non-negative int, ``deadline`` a finite
  number);
- the sampling fields go through ``SamplingParams.from_dict`` except the grammar and the
  JSON schema, whose bounds are checked once, where they are compiled
  (``llama.engine.LlamaEngine.grammar_for``); here they only have to be a string (a schema: or
  an object);
- messages and prompts are checked where they are measured and tokenized (``core``);
- a chat's ``tools`` (for a template that renders them) have their shape: a mode and at
  most MAX_TOOLS function tools, names of NAME's characters, parameters objects.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

from wire import protocol
from wire.affinity import HASH_BYTES
from wire.errors import InvalidParameter
from wire.sampling import SamplingParams

ADAPTER_ID = re.compile(r"ad_[0-9a-f]{16}")
SHA256 = re.compile(r"[0-9a-f]{64}")
ROUTE = re.compile(rf"[0-9a-f]{{{2 * HASH_BYTES}}}")  # an affinity hash, as hex
COMPILED_FIELDS = ("grammar", "json_schema")  # bounded by the engine when it compiles them
KINDS = ("completion", "chat")
MAX_TOOLS = 64
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
TOOL_MODES = ("call", "auto")


def submit_arguments(job: protocol.Job) -> dict[str, Any]:
    """Keyword arguments for ``InferenceCore.enqueue``; ``InvalidParameter`` names a field
    whose wire shape is wrong."""
    if job.kind not in KINDS:
        raise InvalidParameter("kind", f"must be one of {list(KINDS)}")
    chat = job.kind == "chat"
    if (job.messages if chat else (job.prompt if job.prompts is None else job.prompts)) is None:
        raise InvalidParameter("messages" if chat else "prompt", f"a {job.kind} job needs it")
    _check_type("cache_scope", job.cache_scope, str)
    _check_type("session", job.session, str, optional=True)
    _check_type("cache_prompt", job.cache_prompt, bool, optional=True)
    _check_type("session_id", job.session_id, str, optional=True)
    _check_type("continue_session", job.continue_session, bool)
    max_queued = job.max_queued
    if max_queued is not None and (type(max_queued) is not int or max_queued < 0):
        raise InvalidParameter("max_queued", "must be a non-negative integer")
    return {
        "prompt": None if chat else job.prompt,
        "messages": job.messages if chat else None,
        "params": sampling_params(job.params),
        "request_id": job.id,
        "cache_scope": job.cache_scope,
        "session": job.session,
        "cache_prompt": job.cache_prompt,
        "max_queued": max_queued,
        "deadline": _deadline(job.deadline),
        "n": job.n,  # checked by the core (an integer of 1 to MAX_CHOICES)
        "prompts": job.prompts if not chat else None,  # checked by the core as well
        "keep_tokens": job.session_id is not None,
        "adapter": adapter_spec(job.adapter),
        # an adapter's jobs' affinity chains start with its head hash (wire/affinity.py)
        "route": _route(job),
        "tools": tool_spec(job.tools) if chat else None,
    }


def tool_spec(raw: Any) -> dict[str, Any] | None:
    """A chat job's tools: ``{"mode", "functions"}`` (OpenAI function tools) checked for
    shape, with ``size``: the UTF-8 bytes of their text (counted with the prompt's)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"mode", "functions"} \
            or raw["mode"] not in TOOL_MODES or not isinstance(raw["functions"], list) \
            or not 0 < len(raw["functions"]) <= MAX_TOOLS:
        raise InvalidParameter("tools", f"must be an object of a mode {list(TOOL_MODES)} and "
                                        f"1 to {MAX_TOOLS} functions")
    size = 0
    for i, tool in enumerate(raw["functions"]):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and set(tool) == {"type", "function"}
                and tool["type"] == "function" and isinstance(function, dict)
                and set(function) == {"name", "description", "parameters"}
                and isinstance(function["name"], str) and TOOL_NAME.fullmatch(function["name"])
                and isinstance(function["description"], str)
                and isinstance(function["parameters"], dict)):
            raise InvalidParameter(f"tools[{i}]", "must be a function tool of name, "
                                                  "description and parameters")
        try:
            size += len(json.dumps(function, ensure_ascii=False).encode("utf-8"))
        except (ValueError, RecursionError):  # a lone surrogate, a nesting too deep
            raise InvalidParameter(f"tools[{i}]", "is not valid JSON text") from None
    return {"mode": raw["mode"], "functions": raw["functions"], "size": size}


def _route(job: protocol.Job) -> str | None:
    """An adapter job's affinity head (its chain's first hash), if it has that shape."""
    chain = job.affinity
    if job.adapter and isinstance(chain, list) and chain and isinstance(chain[0], str) \
            and ROUTE.fullmatch(chain[0]):
        return chain[0]
    return None


def adapter_spec(raw: Any) -> dict[str, Any] | None:
    """The job's adapter: ``{"id", "path", "sha256", "scale"}`` of their wire types (the
    file itself is checked where it is loaded: core/adapters.py)."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"id", "path", "sha256", "scale"}:
        raise InvalidParameter("adapter", "must be an object of id, path, sha256 and scale")
    ok = (isinstance(raw["id"], str) and ADAPTER_ID.fullmatch(raw["id"]) is not None
          and isinstance(raw["path"], str) and raw["path"].startswith("/")
          and "\0" not in raw["path"]
          and isinstance(raw["sha256"], str) and SHA256.fullmatch(raw["sha256"]) is not None
          and type(raw["scale"]) in (int, float) and math.isfinite(raw["scale"]))
    if not ok:
        raise InvalidParameter("adapter", "has a field of the wrong shape")
    return dict(raw, scale=float(raw["scale"]))


def sampling_params(raw: Any) -> SamplingParams:
    """The job's ``params`` (the sampling fields as the client sent them, aliases resolved)."""
    if not isinstance(raw, dict):
        raise InvalidParameter("params", "must be an object")
    params = SamplingParams.from_dict({k: v for k, v in raw.items() if k not in COMPILED_FIELDS})
    grammar, schema = raw.get("grammar"), raw.get("json_schema")
    _check_type("grammar", grammar, str, optional=True)
    if isinstance(schema, dict):
        try:
            schema = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        except (ValueError, RecursionError):
            raise InvalidParameter("json_schema", "is not a JSON object") from None
    _check_type("json_schema", schema, str, optional=True)
    return dataclasses.replace(params, grammar=grammar, json_schema=schema)


def _deadline(value: Any) -> float | None:
    """A finite number of unix seconds as a float (a huge int would overflow later)."""
    if value is None:
        return None
    try:
        deadline = float(value) if type(value) in (int, float) else math.nan
    except OverflowError:
        deadline = math.nan
    if not math.isfinite(deadline):
        raise InvalidParameter("deadline", "must be a number (unix seconds)")
    return deadline


def _check_type(field: str, value: Any, kind: type, optional: bool = False) -> None:
    if value is None and optional:
        return
    if type(value) is not kind:
        raise InvalidParameter(field, f"must be a {kind.__name__}")
