"""Hostile input on /v1/responses (issue 37), against the live stack with the chat model's
daemon running: every bad field, item and byte gets a clean 4xx in OpenAI's error shape
naming the field, nothing reaches the model, and the daemon is the same process at the end.
"""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from config.models import SMOLLM2
from tests.live_service import ROOT

pytestmark = pytest.mark.slow
OK = {"model": SMOLLM2, "input": "Hi", "max_output_tokens": 4}
DEEP = {"role": "user", "content": "x"}
for _ in range(80):
    DEEP = {"a": DEEP}


@pytest.fixture(scope="module")
def pid(chat_daemon):
    found = chat_daemon.snapshot().get("pid")
    assert found
    return found


def error_of(reply, status=400):
    assert reply.status == status, (reply.status, reply.response.read()[:500])
    assert (reply.header("Content-Type") or "").startswith("application/json")
    body = reply.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def post(web, body, key=None, raw=False):
    data = body if raw else json.dumps(body)
    return web.request("POST", "/v1/responses", data, key=key or web.keys["owner"])


TEXT_FORMAT = {"type": "json_schema", "name": "x", "schema": {"type": "object"}}
CASES = [
    # (fields over OK, the param named, the code; None: invalid_request_error)
    ({"input": None}, "input", "missing_required_parameter"),
    ({"input": 5}, "input", None),
    ({"input": []}, "input", None),
    ({"input": [1]}, "input[0]", None),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": {}, "content": "x"}]}, "input[0].role", None),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content", None),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
     "input[0].content[0].text", None),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type",
     "unsupported_parameter"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "bad name",
                 "arguments": "{}"}]}, "input[0].name", None),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": {}}]},
     "input[0].arguments", None),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
     "input[0].output", None),
    ({"input": [{"type": "function_call_output", "call_id": "x" * 300, "output": "o"}]},
     "input[0].call_id", None),
    ({"input": [{"type": "function_call_output", "call_id": "c\x00", "output": "o"}]},
     "input[0].call_id", None),
    ({"input": [{"role": "user", "content": "a"}] * 1025}, "input", None),
    ({"input": "x" * 70_000}, "input", "context_length_exceeded"),
    ({"input": [{"role": "user", "content": "ok"},
                {"role": "user", "content": [{"type": "input_text", "text": "x" * 70_000}]}]},
     "input", "context_length_exceeded"),
    ({"instructions": 5}, "instructions", None),
    ({"tools": {}}, "tools", None),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", None),
    ({"tools": [{"type": "function", "name": "f", "strict": "yes"}]}, "tools[0].strict", None),
    ({"tools": [{"type": "function", "name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "maxLength": 100000}}}}]},
     "tools[0].parameters", None),
    ({"tools": [{"type": "function", "name": "f"}] * 65}, "tools", None),
    ({"tool_choice": "sometimes"}, "tool_choice", None),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", None),
    ({"tool_choice": "required"}, "tool_choice", None),
    ({"tools": [{"type": "function", "name": "f"}],
      "tool_choice": {"type": "function", "name": "g"}}, "tool_choice", None),
    ({"text": "json"}, "text", None),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", None),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", None),
    ({"text": {"format": {**TEXT_FORMAT, "name": "bad name"}}}, "text.format.name", None),
    ({"text": {"format": {"type": "json_schema", "schema": {
        "type": "string", "maxLength": 100000}}}}, "text.format", None),
    ({"text": {"format": TEXT_FORMAT}, "tools": [{"type": "function", "name": "f"}]},
     "text.format", None),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "unsupported_parameter"),
    ({"max_output_tokens": 0}, "max_output_tokens", None),
    ({"max_output_tokens": -1}, "max_output_tokens", None),
    ({"max_output_tokens": "8"}, "max_output_tokens", None),
    ({"max_output_tokens": 10**40}, "max_output_tokens", None),
    ({"temperature": "hot"}, "temperature", None),
    ({"temperature": 99}, "temperature", None),
    ({"top_p": 2}, "top_p", None),
    ({"stream": "yes"}, "stream", None),
    ({"store": "no"}, "store", None),
    ({"parallel_tool_calls": 1}, "parallel_tool_calls", None),
    ({"user": 5}, "user", None),
    ({"user": "a\x00b"}, "user", None),
    ({"metadata": []}, "metadata", None),
    ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", None),
    ({"metadata": {"k": 5}}, "metadata", None),
    ({"metadata": {"k": "a\x00"}}, "metadata", None),
    ({"previous_response_id": 5}, "previous_response_id", None),
    ({"model": ""}, "model", None),
    ({"model": 7}, "model", None),
    ({"foo": 1}, "foo", "unknown_parameter"),
    ({"max_tokens": 8}, "max_tokens", "unknown_parameter"),
    ({"messages": [{"role": "user", "content": "x"}]}, "messages", "unknown_parameter"),
    ({"include": ["reasoning.encrypted_content"]}, "include", "unsupported_parameter"),
    ({"background": True}, "background", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "unsupported_parameter"),
]


@pytest.mark.parametrize("fields, param, code", CASES,
                         ids=[f"{i}-{c[1]}" for i, c in enumerate(CASES)])
def test_a_bad_field_is_a_400_naming_it(web, pid, fields, param, code):
    error = error_of(post(web, {**OK, **fields}))
    assert error["param"] == param, error
    assert error["code"] == (code or "invalid_request_error"), error


@pytest.mark.parametrize("raw, param", [
    (b'{"input": "hi \\ud800 there"}', "input"),
    (b'{"input": [{"role": "user", "content": [{"type": "input_text", '
     b'"text": "\\udfff"}]}]}', "input[0].content[0].text"),
    (b'{"input": "x", "instructions": "\\ud800"}', "instructions"),
    (b'{"input": [{"type": "function_call", "call_id": "c", "name": "f", '
     b'"arguments": "\\ud800"}]}', "input[0].arguments"),
    (b'{"input": "x", "metadata": {"k": "\\ud800"}}', "metadata"),
])
def test_text_that_is_not_unicode_is_refused_by_field(web, pid, raw, param):
    assert error_of(post(web, raw, raw=True))["param"] == param


@pytest.mark.parametrize("raw", [
    b"\xff\xfe{}", b"{", b"[]", b"null", b'"input"', b'{"input": NaN}',
    json.dumps({**OK, "input": [DEEP]}).encode(),
])
def test_bodies_that_are_not_a_json_object_are_400(web, pid, raw):
    error_of(post(web, raw, raw=True))


def test_an_unknown_previous_response_is_404_naming_it(web, pid):
    for previous in (f"resp_{uuid.uuid4().hex}", "resp_x", "x" * 5000, "a\x00"):
        error = error_of(post(web, {**OK, "previous_response_id": previous}), 404)
        assert (error["code"], error["param"]) == ("not_found", "previous_response_id")


@pytest.mark.parametrize("path", ["resp_%00", "%ff%fe", "resp_" + "0" * 32, "x" * 2000,
                                  "..%2f..%2frequests"])
def test_hostile_ids_on_get_and_delete_are_404(web, pid, path):
    """Sent to daphne past the door: nginx answers a NUL in a path itself (a 500 of its
    own today, on every path: config/proxy.py's @bad_request)."""
    for method in ("GET", "DELETE"):
        reply = web.request_to(0, method, f"/v1/responses/{path}", key=web.keys["owner"])
        assert error_of(reply, 404)["code"] == "not_found"


def test_a_stream_refused_before_it_starts_is_a_json_error(web, pid):
    error = error_of(post(web, {**OK, "stream": True, "temperature": -1}))
    assert error["param"] == "temperature"


def test_the_daemon_survived_and_serves(web, chat_daemon, pid):
    assert chat_daemon.proc.poll() is None
    reply = post(web, OK)
    assert reply.status == 200, reply.response.read()
    assert reply.json()["output"][0]["type"] == "message"
    assert chat_daemon.snapshot().get("pid") == pid


SCHEMATHESIS_TOML = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx"]
"""


def test_schemathesis_over_the_responses_endpoints(web, chat_daemon, pid, tmp_path):
    """schemathesis over /v1/responses and /v1/responses/{id} (examples, coverage,
    fuzzing) with the chat model's daemon alive: no 5xx (503 included), every 4xx in OpenAI's
    shape (tests/fuzz_hooks.py's check), the daemon the same process after."""
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_TOML)
    argv = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config),
        "run", f"{web.base_url}/v1/openapi.json",
        "-H", f"Authorization: Bearer {web.keys['owner']}",
        "--include-path-regex", "^/v1/responses",
        "--checks", "not_a_server_error,openai_error_shape",
        "--phases", "examples,coverage,fuzzing", "--max-examples", "30", "--workers", "1",
        "--seed", "37", "--generation-database", "none", "--request-timeout", "180",
    ]
    env = {**web.env, "SCHEMATHESIS_HOOKS": "tests.fuzz_hooks", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)  # a hang guard
    print(done.stdout[done.stdout.find("Examples"):])
    assert done.returncode == 0, (done.stdout[-6000:] + done.stderr[-2000:]
                                  + web.log_tail(30) + chat_daemon.log_tail(30))
    assert chat_daemon.proc.poll() is None and chat_daemon.snapshot().get("pid") == pid
