"""Tools (function calling) on /v1/chat/completions, built on what the daemon already does:
a generic tool prompt and a JSON schema the output must follow (its grammar).

Neither bundled model's template knows tools (SmolLM2's ChatML, Gemma's built-in), so tools
are rendered the way llama-server's generic handler does it: a system message that lists
the functions and says how to call one. The call is a JSON object in the shape Llama 3.1
uses, ``{"name": ..., "parameters": {...}}`` (the grammar's properties come in key order:
``name`` first, then the arguments). ``tool_choice``:

- ``"none"`` (or no tools): a plain reply; the tools are not shown to the model;
- a named function, or ``"required"``: the output is a call, forced by the grammar (one
  alternative per allowed function: its name and its parameters' schema), so the
  arguments always parse;
- ``"auto"`` (the default with tools): ``{"tool_call": <a call>}`` or ``{"response":
  "<text>"}``, the model's choice, under the grammar as well.

The reply is one call at most per turn (``parallel_tool_calls`` is accepted; a turn never
has several calls). History: an assistant message with ``tool_calls`` is shown to the model
as the calls in the same JSON (``wire.messages.call_text``), a ``tool`` message as its
content.

A model whose chat template renders tools itself, in a tool-call format parsed here (its
daemons' snapshots say ``chat_tools``: ``"hermes"``, Hermes/Qwen's ``<tool_call>`` JSON
``</tool_call>``), gets them through its template instead (``native``): the job carries the
tools (``job_tools``) and the history's calls in their own shape (``native_messages``), no
generic prompt is added, and the grammar (made by the daemon from ``schema``, the JSON of one
call ``{"name": ..., "arguments": {...}}``) forces the family's format: a call for a named or
required choice, a call or text that does not begin with ``<`` for ``auto``. ``read_reply``
reads that format back. A template that renders tools in a format not parsed here keeps the
generic prompt (the daemon publishes no ``chat_tools`` for it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from wire.errors import InvalidParameter
from wire.sampling import require_text
from wire.schema_check import check_json_schema

MAX_TOOLS = 64
MAX_DESCRIPTION_CHARS = 4096
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class Function:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a tools request does: the system text to show, the schema its output follows,
    and how its output is read back (``mode``: "call" or "auto"; ``family``: "generic",
    the JSON this module asks for, or the template's tool-call format, "hermes").
    ``functions``: every tool of the request (``names``: those a call may name)."""

    mode: str
    names: tuple[str, ...]
    system_text: str
    schema: dict[str, Any]
    family: str = "generic"
    functions: tuple[Function, ...] = ()


def plan(body: dict[str, Any]) -> ToolPlan | None:
    """The request's tools, checked (``InvalidParameter`` names the field); None when the
    reply is plain text (no tools, an empty list, or ``tool_choice: "none"``)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidParameter("parallel_tool_calls", "must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise InvalidParameter("tool_choice", "names a tool, but tools is empty")
        return None
    functions = _functions(tools)
    if choice is None or choice == "auto":
        mode, allowed = "auto", functions
    elif choice == "none":
        return None
    elif choice == "required":
        mode, allowed = "call", functions
    else:
        name = _named_choice(choice)
        allowed = [f for f in functions if f.name == name]
        if not allowed:
            raise InvalidParameter("tool_choice", f"names {name!r}, which is not in tools")
        mode = "call"
    call_schema = _call_schema(allowed)
    if mode == "auto":
        schema = {"anyOf": [
            {"type": "object", "properties": {"tool_call": call_schema},
             "required": ["tool_call"]},
            {"type": "object", "properties": {"response": {"type": "string"}},
             "required": ["response"]},
        ]}
    else:
        schema = call_schema
    check_json_schema(schema, "tools")  # the bounds the daemon's grammar compile has
    return ToolPlan(mode, tuple(f.name for f in allowed), _system_text(functions, mode),
                    schema, functions=tuple(functions))


FAMILIES = ("hermes",)  # the tool-call formats read_reply parses (a template's own)


def native(tool_plan: ToolPlan, family: str) -> ToolPlan:
    """``tool_plan`` for a model whose template renders tools and asks for calls in
    ``family``'s format: no system text; the schema of one call, ``{"name": <an allowed
    name>, "arguments": <its parameters' schema>}`` (the daemon wraps its grammar in the
    family's markup)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown tool-call format {family!r}")
    allowed = [f for f in tool_plan.functions if f.name in tool_plan.names]
    alternatives = [{"type": "object", "properties": {"name": {"const": f.name},
                                                      "arguments": f.parameters},
                     "required": ["name", "arguments"]} for f in allowed]
    schema = alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}
    check_json_schema(schema, "tools")
    return replace(tool_plan, system_text="", schema=schema, family=family)


def job_tools(tool_plan: ToolPlan) -> dict[str, Any]:
    """The job's ``tools`` (wire/protocol.py ``Job.tools``) for a template that renders them:
    every function as an OpenAI tool object, and the mode."""
    return {"mode": tool_plan.mode, "functions": [
        {"type": "function", "function": {"name": f.name, "description": f.description,
                                          "parameters": f.parameters}}
        for f in tool_plan.functions]}


def native_messages(raw: list[Any], checked: list[dict[str, str]]) -> list[dict[str, Any]]:
    """The checked messages (``wire.messages``: their calls folded into text) with each
    assistant message's ``tool_calls`` as ``[{"name", "arguments"}]`` of its own and its
    text alone as content: the shape a template renders calls from. ``raw``: the request's
    messages, already checked."""
    out: list[dict[str, Any]] = []
    for message, pair in zip(raw, checked, strict=True):
        calls = message.get("tool_calls") if message.get("role") == "assistant" else None
        if calls is None:
            out.append(pair)
            continue
        content = message.get("content")
        if isinstance(content, list):  # text parts (checked)
            content = "".join(part["text"] for part in content)
        out.append({"role": "assistant", "content": content or "", "tool_calls": [
            {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
            for c in calls]})
    return out


def _functions(tools: Any) -> list[Function]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidParameter("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions, seen = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise InvalidParameter(f"{where}.type", 'only "function" tools are supported')
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidParameter(f"{where}.function", "must be an object")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidParameter(f"{where}.function.name",
                                   "must be 1 to 64 letters, digits, _ or -")
        if name in seen:
            raise InvalidParameter(f"{where}.function.name", f"{name!r} is given twice")
        seen.add(name)
        description = function.get("description", "")
        if not isinstance(description, str) or len(description) > MAX_DESCRIPTION_CHARS:
            raise InvalidParameter(f"{where}.function.description",
                                   f"must be a string of at most {MAX_DESCRIPTION_CHARS} "
                                   "characters")
        require_text(f"{where}.function.description", description)
        parameters = function.get("parameters")
        if parameters is None:
            parameters = EMPTY_PARAMETERS
        field = f"{where}.function.parameters"
        parameters = json.loads(check_json_schema(parameters, field))
        if parameters.get("type", "object") != "object":
            raise InvalidParameter(field, 'must be a schema of "type": "object"')
        functions.append(Function(name, description, parameters))
    return functions


def _named_choice(choice: Any) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function"
            and isinstance(name, str)):
        raise InvalidParameter("tool_choice", 'must be "none", "auto", "required" or '
                               '{"type": "function", "function": {"name": ...}}')
    return name


def _call_schema(functions: list[Function]) -> dict[str, Any]:
    alternatives = [{"type": "object", "properties": {"name": {"const": f.name},
                                                      "parameters": f.parameters},
                     "required": ["name", "parameters"]} for f in functions]
    return alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives}


def _system_text(functions: list[Function], mode: str) -> str:
    listed = json.dumps([{"name": f.name, "description": f.description,
                          "parameters": f.parameters} for f in functions],
                        ensure_ascii=False, separators=(",", ":"))
    how = ('To call a function, answer with {"name": <function name>, "parameters": '
           '<its arguments>} and nothing else.')
    if mode == "auto":
        how = ('To call a function, answer with {"tool_call": {"name": <function name>, '
               '"parameters": <its arguments>}}; to answer without one, with {"response": '
               '<your answer>}. Answer with that JSON object and nothing else.')
    return f"You can call these functions (JSON schemas of their parameters):\n{listed}\n{how}"


def with_tools(messages: list[dict[str, str]], tool_plan: ToolPlan) -> list[dict[str, str]]:
    """The checked messages with the tool prompt first: merged into a leading system
    message, or as one of its own."""
    if messages and messages[0]["role"] in ("system", "developer"):
        first = {"role": messages[0]["role"],
                 "content": f"{messages[0]['content']}\n\n{tool_plan.system_text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tool_plan.system_text}, *messages]


def read_reply(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a tools request's output. Text that is not the JSON the
    grammar forces (a reply cut by max_tokens) is content, with no call."""
    if tool_plan.family == "hermes":
        return _read_hermes(text, tool_plan.names)
    mode = tool_plan.mode
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text, []
    if mode == "auto" and isinstance(value, dict):
        if isinstance(value.get("response"), str):
            return value["response"], []
        value = value.get("tool_call")
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)
            and "parameters" in value):
        return text, []
    call = _call(value["name"], value["parameters"])
    return (text, []) if call is None else (None, [call])


def _read_hermes(text: str, names: tuple[str, ...]) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes/Qwen calls: ``<tool_call>`` ``{"name": ..., "arguments": {...}}``
    ``</tool_call>`` blocks from the reply's first character (where the grammar puts a call;
    a text reply begins with anything but ``<``) and nothing else after them, each naming one
    of ``names``; anything else is content. The JSON is read as JSON: a string argument
    holding ``</tool_call>`` is part of the call."""
    rest, calls = text, []
    while rest.startswith(_OPEN):
        body = rest[len(_OPEN):].lstrip()
        try:
            value, end = _JSON.raw_decode(body)
        except (ValueError, RecursionError):
            return text, []
        after = body[end:].lstrip()
        call = _call(value.get("name"), value.get("arguments")) \
            if isinstance(value, dict) and "arguments" in value \
            and value.get("name") in names else None
        if call is None or not after.startswith(_CLOSE):
            return text, []
        calls.append(call)
        rest = after[len(_CLOSE):].lstrip()
    return (None, calls) if calls and not rest else (text, [])


_JSON = json.JSONDecoder()
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    """A chat ``tool_calls`` entry, or None when the name is no string or the arguments
    are not strict JSON."""
    if not isinstance(name, str):
        return None
    try:  # 1e999 parses as inf, which strict JSON cannot hold: such text stays content
        text = json.dumps(arguments, ensure_ascii=False, separators=(",", ":"),
                          allow_nan=False)
    except ValueError:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": text}}
