"""inference/tools.py without a model: the plans, the schema the output must follow, and
how an output is read back (a pure-policy test next to tests/test_tools_e2e.py)."""
from __future__ import annotations

import json

import pytest

from inference import tools
from wire.errors import InvalidParameter
from wire.messages import parse_messages

F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}


def test_no_tools_or_none_is_a_plain_reply():
    assert tools.plan({}) is None and tools.plan({"tools": []}) is None
    assert tools.plan({"tools": [F], "tool_choice": "none"}) is None


def test_a_named_choice_allows_that_function_only():
    plan = tools.plan({"tools": [F, G], "tool_choice": {"type": "function",
                                                         "function": {"name": "g"}}})
    assert (plan.mode, plan.names) == ("call", ("g",))
    assert plan.schema["properties"]["name"] == {"const": "g"}
    assert '"name":"f"' in plan.system_text  # every tool is shown, only g may be called


def test_required_is_any_of_the_calls_and_auto_may_answer_instead():
    required = tools.plan({"tools": [F, G], "tool_choice": "required"})
    assert [a["properties"]["name"]["const"] for a in required.schema["anyOf"]] == ["f", "g"]
    auto = tools.plan({"tools": [F]})
    assert auto.mode == "auto"
    assert [list(a["properties"]) for a in auto.schema["anyOf"]] == [["tool_call"], ["response"]]


def test_reading_replies_back():
    call, auto = tools.plan({"tools": [F], "tool_choice": "required"}), tools.plan({"tools": [F]})
    content, calls = tools.read_reply('{"name":"f","parameters":{"x":1}}', call)
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"x":1}'}
    assert tools.read_reply('{"response":"hi"}', auto) == ("hi", [])
    _, calls = tools.read_reply('{"tool_call":{"name":"f","parameters":{}}}', auto)
    assert calls[0]["function"]["name"] == "f"
    assert tools.read_reply('{"name":"f","param', call) == ('{"name":"f","param', [])


def test_the_tool_prompt_joins_a_leading_system_message():
    plan = tools.plan({"tools": [F]})
    merged = tools.with_tools([{"role": "system", "content": "Be brief."},
                               {"role": "user", "content": "x"}], plan)
    assert merged[0]["content"].startswith("Be brief.\n\n") and len(merged) == 2
    added = tools.with_tools([{"role": "user", "content": "x"}], plan)
    assert added[0] == {"role": "system", "content": plan.system_text}


def test_history_calls_are_shown_as_the_model_writes_them():
    pairs = parse_messages([
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x":2}'}}]},
        {"role": "tool", "tool_call_id": "1", "content": "4"}])
    assert pairs[1] == ("assistant", '{"name":"f","parameters":{"x":2}}')
    assert pairs[2] == ("tool", "4")
    assert json.loads(pairs[1][1])["parameters"] == {"x": 2}


@pytest.mark.parametrize("body, param", [
    ({"tools": "f"}, "tools"),
    ({"tools": [F] * 65}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "description": "\ud800"}}]},
     "tools[0].function.description"),
    ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_plans_name_the_field(body, param):
    with pytest.raises(InvalidParameter) as caught:
        tools.plan(body)
    assert caught.value.param == param


def test_arguments_that_strict_json_cannot_hold_stay_content():
    text = '{"name":"f","parameters":{"x":1e999}}'  # the grammar allows it; it parses as inf
    call = tools.plan({"tools": [F], "tool_choice": "required"})
    assert tools.read_reply(text, call) == (text, [])
