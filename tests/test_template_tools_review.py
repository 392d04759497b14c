"""Tools through the model's own template, the edges: a literal "root" in a call's grammar
(a tool named so, an enum value), Hermes replies whose JSON holds the markup or that do not
start where the grammar puts a call, history arguments nested deeper than the renderer
goes, the web's read of the daemons' ``chat_tools`` never waiting on Redis inside the event
loop, and the affinity chain of jobs whose tools the template renders. Without a daemon; the
live path is tests/test_template_tools_e2e.py."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from inference import health, tools
from scheduler_daemon.core.chat import tool_grammar
from scheduler_daemon.llama.engine import schema_grammar
from tests.test_template_tools import WEATHER, hermes
from wire import protocol
from wire.errors import InvalidParameter
from wire.grammar_check import check_grammar

ROOT_TOOL = {"type": "function", "function": {
    "name": "root", "description": "Acts as the superuser.",
    "parameters": {"type": "object", "properties": {"as": {"enum": ["root", "user"]}},
                   "required": ["as"]}}}


def call_grammar(plan: tools.ToolPlan) -> str:
    return schema_grammar(json.dumps(plan.schema), "tools", ("name", "arguments"))


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_literal_root_in_the_call_stays_root(choice):
    plan = tools.native(tools.plan({"tools": [ROOT_TOOL], "tool_choice": choice}), "hermes")
    grammar = check_grammar(tool_grammar("hermes", call_grammar(plan), plan.mode), "tools")
    # the tool's name and the enum value are still what the model must write
    assert r'"\"root\""' in grammar and '"tool-call-json\\""' not in grammar
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["tool-call-json"].startswith('"{" space name-kv')
    wrapper = rules["tool-call" if plan.mode == "auto" else "root"]
    assert wrapper == r'"<tool_call>\n" tool-call-json "\n</tool_call>"'


def test_the_wrappers_rules_take_names_the_call_does_not_use():
    call = 'root ::= tool-call\ntool-call ::= "1"\ntool-text ::= "2"\n'
    grammar = check_grammar(tool_grammar("hermes", call, "auto"), "tools")
    rules = dict(line.split(" ::= ", 1) for line in grammar.splitlines())
    assert rules["tool-call"] == '"1"' and rules["tool-text"] == '"2"'
    assert rules["root"] == "tool-call-1 | tool-text-1"
    assert rules["tool-call-json"] == "tool-call"


PLAN = tools.native(tools.plan({"tools": [WEATHER]}), "hermes")


def test_a_string_argument_holding_the_closing_markup_is_part_of_the_call():
    reply = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "a</tool_call>b"}}'
             '\n</tool_call>')
    content, (call,) = tools.read_reply(reply, PLAN)
    assert content is None
    assert json.loads(call["function"]["arguments"]) == {"city": "a</tool_call>b"}


def test_only_a_reply_that_starts_with_a_call_is_one():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    # auto's text begins with any character but "<": what follows it is not constrained
    for text in (f" {call}", f"\n{call}", f"Sure.\n{call}"):
        assert tools.read_reply(text, PLAN) == (text, [])
    # two calls, whitespace between and after: still calls
    content, calls = tools.read_reply(f"{call}\n{call}\n", PLAN)
    assert content is None and len(calls) == 2


def test_a_call_naming_a_tool_outside_the_plan_is_content():
    other = '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'
    assert tools.read_reply(other, PLAN) == (other, [])
    named = tools.native(tools.plan({"tools": [WEATHER, ROOT_TOOL], "tool_choice": {
        "type": "function", "function": {"name": "root"}}}), "hermes")
    weather = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>'
    assert tools.read_reply(weather, named) == (weather, [])


@pytest.mark.parametrize("depth", [65, 600, 990])
def test_history_arguments_nested_deeply_render_as_their_text(depth):
    deep = '{"a":' * depth + "1" + "}" * depth
    text = hermes().render([("user", "hi"), ("assistant", ""), ("tool", "x")], [WEATHER],
                           {1: [{"name": "get_weather", "arguments": deep}]})
    assert json.dumps(deep) in text  # the arguments as a string, not an object


def test_tools_nested_past_the_recursion_limit_are_refused():
    deep: dict = {"type": "object"}
    for _ in range(2000):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "f", "description": "",
                                             "parameters": deep}}
    with pytest.raises(InvalidParameter):
        hermes().segments([("user", "hi")], [tool])


# -- the web's read of the daemons' chat_tools -------------------------------------------------

@pytest.fixture
def blackhole():
    """A Redis URL whose server takes connections and bytes and never answers; the bytes
    received so far (a list of chunks)."""
    server = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []
    conns: list[socket.socket] = []

    def drain(conn: socket.socket) -> None:
        while chunk := conn.recv(4096):
            received.append(chunk)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=drain, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0", received
    server.close()
    for conn in conns:
        conn.close()


@pytest.fixture
def stale_chat_tools(monkeypatch):
    """chat_tools' values as a read longer than its max age ago left them."""
    monkeypatch.setattr(health, "_chat_tools", {"m": "hermes"})
    monkeypatch.setattr(health, "_chat_tools_at", [
        time.monotonic() - 2 * health.CHAT_TOOLS_MAX_AGE_S])
    monkeypatch.setattr(health, "_chat_tools_reading", [], raising=False)


def test_a_stale_read_in_the_event_loop_does_not_wait_on_redis(blackhole, stale_chat_tools,
                                                               settings):
    settings.REDIS_URL, received = blackhole

    async def request() -> tuple[str | None, int]:
        family = health.chat_tools("m")  # what a view's parse_request does
        return family, len(received)  # bytes Redis had got before the call returned

    # the stale value, at once: no command went to the (silent) Redis meanwhile (a read on
    # the loop waited there the socket timeout, 10 s, and then said generic)
    assert asyncio.run(request()) == ("hermes", 0)


def test_the_read_beside_the_loop_brings_the_daemons_word(stale_chat_tools, redis_client):
    redis_client.zadd(protocol.DAEMONS_ZSET, {"d-review": time.time()})
    redis_client.set(protocol.daemon_key("d-review"), json.dumps(
        {"daemon_id": "d-review", "model": "m", "chat_tools": None}))

    async def requests() -> tuple[str | None, str | None]:
        first = health.chat_tools("m")
        await health._chat_tools_reading[0]
        return first, health.chat_tools("m")

    # the daemon now renders no tools: the next request goes generic
    assert asyncio.run(requests()) == ("hermes", None)


def test_a_request_with_tools_sees_the_daemons_as_they_are(stale_chat_tools, redis_client):
    """The async entry points await a fresh view before a body with tools is parsed: the
    request after a daemon changed gets the daemon's word, not the stale value (a daemon
    that came up a moment ago was missed by its first tools request)."""
    redis_client.zadd(protocol.DAEMONS_ZSET, {"d-review": time.time()})
    redis_client.set(protocol.daemon_key("d-review"), json.dumps(
        {"daemon_id": "d-review", "model": "m", "chat_tools": None}))

    async def request(body) -> str | None:
        await health.fresh_chat_tools(body)
        return health.chat_tools("m")  # what its parse_request then reads

    asyncio.run(health.fresh_chat_tools({"model": "m", "messages": []}))
    assert health._chat_tools == {"m": "hermes"}  # no tools: nothing read
    assert asyncio.run(request({"model": "m", "tools": [WEATHER], "messages": []})) is None


# -- the affinity chain of a job whose tools the template renders -------------------------------

def test_jobs_sharing_a_long_tools_prefix_share_their_affinity_chain(monkeypatch):
    from inference.openai_request import CHAT, parse_request

    monkeypatch.setattr(health, "chat_tools", lambda model: "hermes")
    tool = {"type": "function", "function": {**WEATHER["function"],
                                             "description": "The weather. " * 60}}

    def chain(question: str) -> list[str]:
        parsed = parse_request(CHAT, {"model": "m", "tools": [tool], "messages": [
            {"role": "user", "content": question + " Tell me all about it." * 30}]})
        assert parsed.tools is not None  # through the template
        return parsed._routing("tenant-1")["affinity"]

    paris, rome = chain("Weather in Paris?"), chain("Weather in Rome?")
    # the rendered prompts share the tools (hundreds of characters) before the question:
    # their chains share its pieces too, so both go where that prefix is cached
    assert paris[:2] == rome[:2] and paris != rome
