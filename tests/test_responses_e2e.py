"""POST /v1/responses (OpenAI's Responses API, issue 37) with the official ``openai`` SDK
against the live stack and the chat model (SmolLM2-135M-Instruct): plain, streamed (raw
events and the SDK's stream helper), a function tool's round trip, json_schema output,
previous_response_id, retrieve and delete, another tenant's ids, store false."""
from __future__ import annotations

import json
import uuid

import openai
import pytest

from config.models import SMOLLM2
from tests.live_service import openai_client

pytestmark = pytest.mark.slow
WEATHER = {"type": "function", "name": "get_weather",
           "description": "The current weather in a city.",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string",
                                                  "enum": ["Paris", "London", "Rome"]}},
                          "required": ["city"]}}
ASK = "What is the weather like in Paris?"
YES_NO = {"type": "json_schema", "name": "answer", "strict": True,
          "schema": {"type": "object", "properties": {"answer": {"type": "boolean"}},
                     "required": ["answer"]}}
SHORT = {"max_output_tokens": 12, "temperature": 0}


def create(web, key=None, **fields):
    return openai_client(web, key).responses.create(model=SMOLLM2, **{**SHORT, **fields})


def test_a_plain_response_has_text_usage_and_its_request_id(web, chat_daemon):
    raw = openai_client(web).responses.with_raw_response.create(
        model=SMOLLM2, input="What is the capital of France?", **SHORT)
    reply = raw.parse()
    assert reply.object == "response" and reply.model == SMOLLM2
    assert reply.id == f"resp_{uuid.UUID(raw.headers['X-Request-Id']).hex}"
    assert reply.output_text.strip()
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    usage = reply.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 12
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    else:
        assert reply.status == "completed"
    # the request is a chat request of the tenant's history, with the same usage
    row = web.request("GET", f"/v1/requests/{raw.headers['X-Request-Id']}",
                      key=web.keys["owner"]).json()
    assert row["kind"] == "chat" and row["prompt_tokens"] == usage.input_tokens


def test_a_streamed_response_sends_the_typed_events_in_order(web, chat_daemon):
    events = list(create(web, input="Say hello.", stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done",
                            "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text and events[-4].text == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.output_tokens > 0


def test_the_sdks_stream_helper_assembles_the_response(web, chat_daemon):
    with openai_client(web).responses.stream(
            model=SMOLLM2, input="Is Paris in France?", text={"format": YES_NO},
            max_output_tokens=24, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)
    assert isinstance(json.loads(final.output_text)["answer"], bool)
    stored = openai_client(web).responses.retrieve(final.id)  # saved before completed went out
    assert stored.output_text == final.output_text


def test_json_schema_output_follows_the_schema(web, chat_daemon):
    reply = create(web, input="Is the sky blue? Answer in JSON.", text={"format": YES_NO},
                   max_output_tokens=24)
    assert reply.status == "completed"
    assert set(json.loads(reply.output_text)) == {"answer"}
    assert reply.text.format.type == "json_schema"


def test_a_function_call_then_its_output_turn(web, chat_daemon):
    api = openai_client(web)
    first = api.responses.create(model=SMOLLM2, input=ASK, tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=24, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments)["city"] in ("Paris", "London", "Rome")
    assert first.output_text == ""
    second = api.responses.create(
        model=SMOLLM2, tools=[WEATHER], tool_choice="none", max_output_tokens=12,
        temperature=0,
        input=[{"role": "user", "content": ASK}, *first.output,
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21})}])
    assert second.output[0].type == "message" and second.output_text.strip()
    # the call and its output are in the prompt: more than the question alone
    alone = api.responses.create(model=SMOLLM2, tools=[WEATHER], tool_choice="none",
                                 input=ASK, **SHORT)
    assert second.usage.input_tokens >= alone.usage.input_tokens + 20


def test_a_streamed_function_call(web, chat_daemon):
    with openai_client(web).responses.stream(
            model=SMOLLM2, input=ASK, tools=[WEATHER], tool_choice="required",
            max_output_tokens=24, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    for kind in ("response.output_item.added", "response.function_call_arguments.delta",
                 "response.function_call_arguments.done", "response.output_item.done",
                 "response.completed"):
        assert kind in types, types
    (call,) = final.output
    assert call.type == "function_call" and call.status == "completed"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == json.loads(call.arguments)


def test_previous_response_id_continues_the_conversation(web, chat_daemon):
    api = openai_client(web)
    first = api.responses.create(model=SMOLLM2, input="My name is Ada and I like tea.",
                                 instructions="Answer briefly.", **SHORT)
    alone = api.responses.create(model=SMOLLM2, input="What is my name?", **SHORT)
    second = api.responses.create(model=SMOLLM2, input="What is my name?",
                                  previous_response_id=first.id, **SHORT)
    assert second.previous_response_id == first.id
    # the model saw the earlier turn: its user message and its answer came before this one
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 8
    third = api.responses.create(model=SMOLLM2, input="And what do I like?",
                                 previous_response_id=second.id, **SHORT)
    assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens


def test_retrieve_and_delete(web, chat_daemon):
    api = openai_client(web)
    made = create(web, input="Hello!", metadata={"ticket": "42"})
    got = api.responses.retrieve(made.id)
    assert (got.id, got.output_text, got.metadata) == (made.id, made.output_text,
                                                       {"ticket": "42"})
    # the tenant's, not the key's: the member key of the same tenant reads it
    assert openai_client(web, web.keys["member"]).responses.retrieve(made.id).id == made.id
    assert api.responses.delete(made.id) is None
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        create(web, input="Hi", previous_response_id=made.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_another_tenants_response_is_404_everywhere(web, chat_daemon):
    made = create(web, input="A secret of tenant alpha.")
    outsider = openai_client(web, web.keys["outsider"])
    with pytest.raises(openai.NotFoundError) as caught:
        outsider.responses.retrieve(made.id)
    unknown = f"resp_{uuid.uuid4().hex}"
    with pytest.raises(openai.NotFoundError) as unknown_caught:
        outsider.responses.retrieve(unknown)
    # the same answer as an unknown id (no oracle), the id aside
    assert caught.value.body["code"] == unknown_caught.value.body["code"] == "not_found"
    with pytest.raises(openai.NotFoundError):
        outsider.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError) as caught:
        outsider.responses.create(model=SMOLLM2, input="Go on.", previous_response_id=made.id,
                                  **SHORT)
    assert caught.value.body["param"] == "previous_response_id"
    assert openai_client(web).responses.retrieve(made.id).id == made.id  # still there


def test_store_false_is_not_kept(web, chat_daemon):
    made = create(web, input="Forget this.", store=False)
    assert made.store is False and made.output_text
    with pytest.raises(openai.NotFoundError):
        openai_client(web).responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        create(web, input="Go on.", previous_response_id=made.id)
