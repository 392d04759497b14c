"""/v1/responses without a server (fast tier): a Responses body as the chat body it becomes,
chat's refusals named by the Responses field, and protocol events as typed stream events
(tests/test_responses_e2e.py runs the same against the live stack)."""
from __future__ import annotations

import json
import uuid

import pytest

from inference import responses_request
from inference.broker import StreamEvent
from inference.errors import ApiError
from inference.responses_format import ResponseFormatter
from wire import protocol

CALL = {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"}


def test_items_become_chat_messages_in_order():
    call = responses_request.read({"instructions": "Be brief.", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
        CALL, {**CALL, "call_id": "call_2"},
        {"type": "function_call_output", "call_id": "call_1", "output": "x"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "b", "annotations": []}]},
    ]})
    body, sources = call.chat_body([{"role": "user", "content": "earlier"}])
    roles = [m["role"] for m in body["messages"]]
    assert roles == ["system", "user", "user", "assistant", "tool", "assistant"]
    assert [c["id"] for c in body["messages"][3]["tool_calls"]] == ["call_1", "call_2"]
    assert body["messages"][4] == {"role": "tool", "tool_call_id": "call_1", "content": "x"}
    assert sources == ["instructions", "previous_response_id", "input[0]", "input[1]",
                       "input[3].output", "input[4]"]


@pytest.mark.parametrize("fields, param", [
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "input_text", "text": "\ud800"}]}]},
     "input[1].content[0].text"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]},
     "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema",
                          "schema": {"type": "string", "maxLength": 100000}}}}, "text.format"),
    ({"instructions": "\udfff"}, "instructions"),
])
def test_the_chat_parsers_refusals_name_the_responses_field(fields, param):
    with pytest.raises(ApiError) as caught:
        responses_request.parse(responses_request.read({"input": "hi", **fields}), [])
    assert caught.value.param == param


def event(kind, **data):
    return StreamEvent("1-0", kind, data)


def formatter(**body):
    call = responses_request.read({"input": "hi", **body})
    parsed = responses_request.parse(call, [])
    return ResponseFormatter(str(uuid.uuid4()), "m", 1, call, parsed.params, parsed.tool_plan)


def test_text_events_in_order_with_sequence_numbers():
    fmt = formatter()
    usage = protocol.usage(5, 1, 2)
    typed = [*fmt.events(event(protocol.ACCEPTED)), *fmt.events(event(protocol.TOKEN, text="He")),
             *fmt.events(event(protocol.TOKEN, text="y")),
             *fmt.events(event(protocol.DONE, finish_reason="length", usage=usage))]
    assert [t["sequence_number"] for t in typed] == list(range(len(typed)))
    assert [t["type"] for t in typed] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.incomplete"]
    final = typed[-1]["response"]
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["content"][0]["text"] == "Hey"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 1
    assert fmt.finished.messages == [{"role": "assistant", "content": "Hey"}]


def test_a_call_is_sent_whole_at_the_end():
    fmt = formatter(tools=[{"type": "function", "name": "f"}], tool_choice="required")
    fmt.events(event(protocol.ACCEPTED))
    assert fmt.events(event(protocol.TOKEN, text='{"name": "f", ')) == []
    fmt.events(event(protocol.TOKEN, text='"parameters": {"x": 1}}'))
    typed = fmt.events(event(protocol.DONE, finish_reason="stop", usage=protocol.usage(5, 0, 9)))
    assert [t["type"] for t in typed] == [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    item = typed[-1]["response"]["output"][0]
    assert item["type"] == "function_call" and json.loads(item["arguments"]) == {"x": 1}
    (message,) = fmt.finished.messages
    assert message["tool_calls"][0]["id"] == item["call_id"]


def test_an_error_after_the_start_is_response_failed():
    fmt = formatter()
    fmt.events(event(protocol.ACCEPTED))
    fmt.events(event(protocol.TOKEN, text="partial"))
    (failed,) = fmt.events(event(protocol.ERROR, code="timeout", message="too long"))
    assert failed["type"] == "response.failed"
    assert failed["response"]["error"] == {"code": "timeout", "message": "too long"}
    assert failed["response"]["output"][0]["status"] == "incomplete"
