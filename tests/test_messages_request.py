"""/v1/messages without a daemon (issue 37): an Anthropic body translated into the chat
body the chat path runs, the reply read back as Anthropic's (usage, stop reasons, stream
events), and every refusal, authentication's too, in Anthropic's error shape."""
from __future__ import annotations

import json

import pytest
from django.test import Client

from inference.anthropic_format import MessageFormatter, error_type, usage_of
from inference.anthropic_request import COUNT_TOKENS, MESSAGES, translate
from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.tools import plan
from wire import protocol

HELLO = [{"role": "user", "content": "Hi"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def body(**fields):
    return {"model": "m", "max_tokens": 8, "messages": HELLO, **fields}


# -- the translation --------------------------------------------------------------------------


def test_system_blocks_tool_use_and_tool_result_become_chat_messages():
    got = translate(MESSAGES, body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Use tools."}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                 "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And now?"}]},
        ],
        tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
        stop_sequences=["\n\n"], temperature=0.5, top_k=5, metadata={"user_id": "u1"},
        stream=True))
    assert got.stream and got.breakpoints == 1
    chat = got.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"]}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert (chat["stop"], chat["temperature"], chat["top_k"], chat["user"],
            chat["max_tokens"]) == (["\n\n"], 0.5, 5, "u1", 8)


def test_consecutive_turns_of_one_role_are_one_turn():
    chat = translate(MESSAGES, body(messages=[
        {"role": "user", "content": "a"}, {"role": "user", "content": [
            {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}])).chat_body
    assert chat["messages"] == [{"role": "user", "content": "a\n\nb\n\nc"}]


@pytest.mark.parametrize(("choice", "chat"), [
    ({"type": "auto"}, "auto"), ({"type": "any"}, "required"), ({"type": "none"}, "none")])
def test_tool_choice(choice, chat):
    assert translate(MESSAGES, body(tools=[WEATHER], tool_choice=choice)).chat_body[
        "tool_choice"] == chat


def test_count_tokens_takes_no_max_tokens():
    assert translate(COUNT_TOKENS, {"model": "m", "messages": HELLO}).chat_body == {
        "model": "m", "messages": HELLO}
    with pytest.raises(ApiError) as refused:
        translate(COUNT_TOKENS, body())
    assert refused.value.param == "max_tokens" and refused.value.code == "unknown_parameter"


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"model": None}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                 "cache_control": {"type": "lasting"}}]}]},
     "messages[0].content[0].cache_control"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]},
     "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result",
                                                 "tool_use_id": "a b"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}] * 5},
     "system[4].cache_control"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "x"}]}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"temperature": 1.5}, "temperature"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"stop": ["x"]}, "stop"),
])
def test_refusals_name_the_field(fields, param):
    with pytest.raises(ApiError) as refused:
        translate(MESSAGES, {**body(), **fields} if None not in fields.values()
                  else {k: v for k, v in body().items() if k not in fields})
    assert refused.value.status == 400 and refused.value.param == param


# -- the reply ----------------------------------------------------------------------------------


def done(reason="stop", stop=None, prompt=10, cached=0, created=0, completion=3):
    return StreamEvent("2-0", protocol.DONE, {
        "finish_reason": reason, "stop": stop,
        "usage": protocol.usage(prompt, cached, completion, created)})


def test_usage_maps_the_prefix_cache_onto_anthropics_fields():
    assert usage_of(done(prompt=100, cached=60, created=40), breakpoints=0) == {
        "input_tokens": 40, "output_tokens": 3, "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 0}
    assert usage_of(done(prompt=100, cached=60, created=40), breakpoints=1) == {
        "input_tokens": 0, "output_tokens": 3, "cache_read_input_tokens": 60,
        "cache_creation_input_tokens": 40}


@pytest.mark.parametrize(("event", "reason", "sequence"), [
    (done(), "end_turn", None), (done("length"), "max_tokens", None),
    (done("stop", "###"), "stop_sequence", "###")])
def test_stop_reasons(event, reason, sequence):
    reply = MessageFormatter("r-1", "m").whole("hello", event)
    assert (reply["stop_reason"], reply["stop_sequence"]) == (reason, sequence)
    assert reply["content"] == [{"type": "text", "text": "hello"}]
    assert reply["id"] == "msg_r1"


def test_a_tool_call_is_a_tool_use_block_whole_and_streamed():
    tool_plan = plan({"tools": translate(MESSAGES, body(tools=[WEATHER])).chat_body["tools"],
                      "tool_choice": "required"})
    call = '{"name":"get_weather","parameters":{"city":"Paris"}}'
    whole = MessageFormatter("r", "m", tool_plan).whole(call, done())
    (block,) = whole["content"]
    assert whole["stop_reason"] == "tool_use"
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_")
    assert (block["name"], block["input"]) == ("get_weather", {"city": "Paris"})
    stream = MessageFormatter("r", "m", tool_plan)
    names = []
    for event in (StreamEvent("1-0", protocol.ACCEPTED, {"prompt_tokens": 10}),
                  StreamEvent("1-1", protocol.TOKEN, {"text": call[:20]}),
                  StreamEvent("1-2", protocol.TOKEN, {"text": call[20:]}), done()):
        pairs = stream.events(event)
        names += [name for name, _ in pairs]
    assert names == ["message_start", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    assert json.loads(pairs[1][1]["delta"]["partial_json"]) == {"city": "Paris"}
    assert pairs[3][1]["delta"]["stop_reason"] == "tool_use"


def test_error_types_by_status_and_code():
    assert [error_type(s) for s in (400, 401, 403, 404, 429, 500, 503, 504)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error",
        "rate_limit_error", "api_error", "overloaded_error", "timeout_error"]
    assert error_type(400, "request_too_large") == "request_too_large"


# -- the views' refusals (no daemon needed) -----------------------------------------------------


def post(path, data, **headers):
    raw = data if isinstance(data, (bytes, str)) else json.dumps(data)
    return Client().generic("POST", path, raw, content_type="application/json", **headers)


def assert_anthropic_error(reply, status, kind):
    assert reply.status_code == status, reply.content
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == kind
    assert error["error"]["message"]
    return error["error"]


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_authentication_refusals_are_anthropic_errors(parties, path):
    none = assert_anthropic_error(post(path, body()), 401, "authentication_error")
    assert "x-api-key" in none["message"]
    assert_anthropic_error(post(path, body(), HTTP_X_API_KEY="sk-nope.nope"), 401,
                           "authentication_error")
    assert_anthropic_error(post(path, body(), HTTP_AUTHORIZATION="Bearer sk-nope.nope"), 401,
                           "authentication_error")


@pytest.mark.django_db
def test_x_api_key_authenticates(parties):
    # past authentication: the body's check answers (a 400 in Anthropic's shape)
    error = assert_anthropic_error(post("/v1/messages", body(max_tokens=None),
                                        HTTP_X_API_KEY=parties.owner,
                                        HTTP_ANTHROPIC_VERSION="2023-06-01",
                                        HTTP_ANTHROPIC_BETA="whatever"),
                                   400, "invalid_request_error")
    assert error["param"] == "max_tokens"


@pytest.mark.django_db
@pytest.mark.parametrize(("data", "param"), [
    (b"{not json", None), (b"\xff\xfe", None), ("[" * 100 + "]" * 100, None),
    (json.dumps(body(messages=[{"role": "user", "content": "hi \ud800"}])),
     "messages[0].content"),
    (body(stop_sequences=["x"] * 17), "stop_sequences"),
    (body(tools=[{**WEATHER, "input_schema": {"type": "string"}}]), "tools[0].input_schema"),
    (body(tools=[{**WEATHER, "name": "bad name"}]), "tools[0].name"),
])
def test_bad_bodies_are_400_in_anthropics_shape(parties, data, param):
    error = assert_anthropic_error(post("/v1/messages", data, HTTP_X_API_KEY=parties.owner),
                                   400, "invalid_request_error")
    assert error["param"] == param


@pytest.mark.django_db
def test_a_wrong_method_is_405_in_anthropics_shape(parties):
    reply = Client().get("/v1/messages", HTTP_X_API_KEY=parties.owner)
    assert_anthropic_error(reply, 405, "invalid_request_error")


def test_the_doors_error_types_are_the_apis():
    from config import proxy
    from wire.errors import CODES

    for code, entry in CODES.items():
        assert proxy.anthropic_type(entry.status, code) == error_type(entry.status, code), code


# -- review (issue 37): a tool_use block's input is always an object ------------------------------


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "string"}}, {"type": "string"},
    {"properties": {"city": {"type": "string"}}}])
def test_an_input_schema_is_an_object_schema(schema):
    with pytest.raises(ApiError) as refused:
        translate(MESSAGES, body(tools=[{**WEATHER, "input_schema": schema}]))
    assert refused.value.status == 400
    assert refused.value.param == "tools[0].input_schema"


@pytest.mark.parametrize("call", [
    '{"name":"get_weather","parameters":"Paris"}',
    '{"name":"get_weather","parameters":["Paris"]}',
    '{"name":"get_weather","parameters":null}'])
def test_a_call_whose_arguments_are_no_object_is_text_not_a_tool_use(call):
    tool_plan = plan({"tools": translate(MESSAGES, body(tools=[WEATHER])).chat_body["tools"],
                      "tool_choice": "required"})
    whole = MessageFormatter("r", "m", tool_plan).whole(call, done())
    assert whole["content"] == [{"type": "text", "text": call}]
    assert whole["stop_reason"] == "end_turn"
    stream = MessageFormatter("r", "m", tool_plan)
    blocks = [data["content_block"] for event in (
        StreamEvent("1-0", protocol.ACCEPTED, {"prompt_tokens": 10}),
        StreamEvent("1-1", protocol.TOKEN, {"text": call}), done())
        for name, data in stream.events(event) if name == "content_block_start"]
    assert [b["type"] for b in blocks] == ["text"]
