"""Tools / function calling on /v1/chat/completions (#16), with the official ``openai`` SDK
against the live stack and the chat model (SmolLM2-135M-Instruct): named and required
calls forced by the grammar, the tool result's turn, the SDK's stream helper, refusals."""
from __future__ import annotations

import json

import openai
import pytest

from config.models import SMOLLM2
from tests.live_service import openai_client

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
SOLO = {"cache_prompt": False}  # no cache hit: the same logits twice (streamed and whole)


def test_a_named_tool_choice_gives_a_call_whose_arguments_parse(web, chat_daemon):
    reply = openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=ASK, tools=[WEATHER, TIME], tool_choice=NAMED,
        temperature=0, max_tokens=48, extra_body=SOLO)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments)["city"], str)


def test_the_tool_results_turn_is_accepted_and_answered(web, chat_daemon):
    api = openai_client(web)
    first = api.chat.completions.create(model=SMOLLM2, messages=ASK, tools=[WEATHER],
                                        tool_choice=NAMED, temperature=0, max_tokens=48)
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id,
                "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}]
    second = api.chat.completions.create(model=SMOLLM2, messages=history, tools=[WEATHER],
                                         tool_choice="none", temperature=0, max_tokens=32)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    auto = api.chat.completions.create(model=SMOLLM2, messages=history, tools=[WEATHER],
                                       temperature=0, max_tokens=48)
    message = auto.choices[0].message  # the model's choice: an answer or another call
    if message.tool_calls:
        assert message.tool_calls[0].function.name == "get_weather"
        assert auto.choices[0].finish_reason == "tool_calls"
    else:
        assert isinstance(message.content, str)


def test_the_sdks_stream_helper_assembles_the_same_call(web, chat_daemon):
    api = openai_client(web)
    whole = api.chat.completions.create(model=SMOLLM2, messages=ASK, tools=[WEATHER],
                                        tool_choice=NAMED, temperature=0, max_tokens=48,
                                        extra_body=SOLO)
    with api.chat.completions.stream(model=SMOLLM2, messages=ASK, tools=[WEATHER],
                                     tool_choice=NAMED, temperature=0, max_tokens=48,
                                     extra_body=SOLO) as stream:
        streamed = stream.get_final_completion()
    (a,), (b,) = whole.choices[0].message.tool_calls, streamed.choices[0].message.tool_calls
    assert (b.function.name, json.loads(b.function.arguments)) == (
        a.function.name, json.loads(a.function.arguments))
    assert streamed.choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools(web, chat_daemon):
    reply = openai_client(web).chat.completions.create(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "Call get_time for the Asia/Tokyo time zone."}],
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=48)
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.function.arguments), dict)


@pytest.mark.parametrize("extra, param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "maxLength": 100000}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_are_400s_naming_the_field(web, chat_daemon, extra, param):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).chat.completions.create(model=SMOLLM2, messages=ASK, max_tokens=4,
                                            extra_body=extra)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_history_call_with_bad_arguments_is_refused_by_field(web, chat_daemon):
    bad = [*ASK, {"role": "assistant", "tool_calls": [{"id": "x", "type": "function",
                                                      "function": {"name": "f"}}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).chat.completions.create(model=SMOLLM2, messages=bad, max_tokens=4)
    assert caught.value.body["param"] == "messages[1].tool_calls[0].function"
