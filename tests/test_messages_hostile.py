"""Hostile input on /v1/messages and /v1/messages/count_tokens with the real daemon running
(issue 37): every answer is a 2xx or a 4xx in Anthropic's error shape, never a 5xx or a
hang, and the daemon (SmolLM2, the chat model) is the same process at the end.

1. Hand-made bodies aimed at each field: wrong types, huge sizes, deep nesting, text that
   is not valid Unicode, blocks of every wrong kind, schemas past their bounds, the
   template's own markers.
2. schemathesis over the two operations (examples, coverage, fuzzing; bodies steered to the
   live model by tests/messages_fuzz_hooks.py), checks ``not_a_server_error`` and
   ``anthropic_error_shape``.
Timeouts are hang guards only; nothing passes or fails on speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from config.models import SMOLLM2
from tests.live_service import ROOT

pytestmark = pytest.mark.slow
HANG_GUARD_S = 180
OK = {"model": SMOLLM2, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
LONE = "hi \ud800 there"
DEEP = {"type": "object", "properties": {"a": {}}}
for _ in range(80):
    DEEP = {"type": "object", "properties": {"a": DEEP}}


def _tool(**fields):
    return {"name": "t", "input_schema": {"type": "object"}, **fields}


HOSTILE = [
    # each top-level field with a wrong type
    *[{**OK, name: value} for name in ("model", "max_tokens", "messages", "system", "tools",
                                       "tool_choice", "stop_sequences", "temperature",
                                       "top_p", "top_k", "stream", "metadata",
                                       "cache_control", "thinking", "output_config")
      for value in ([1], {"x": 1}, -1, "x" * 10) if not (name == "model" and value == "x" * 10)
      and not (name == "system" and value == "x" * 10)],
    {**OK, "max_tokens": 10**30},
    {**OK, "max_tokens": 1_000_000},  # past the context
    {**OK, "temperature": float("1e308")},
    {**OK, "model": ""},
    {**OK, "model": "m\x00"},
    {**OK, "model": LONE},
    {**OK, "messages": [{"role": "user", "content": LONE}]},
    {**OK, "system": LONE},
    {**OK, "system": [{"type": "text", "text": LONE}]},
    {**OK, "messages": [{"role": "user", "content": "x" * 3_000_000}]},
    {**OK, "messages": [{"role": "user", "content": "Hi"}] * 5000},
    {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 100_000}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
                                                      "name": "t", "input": {}}]}]},
    {**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_result",
                                                           "tool_use_id": "a"}]},
                        {"role": "user", "content": "x"}]},
    {**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a",
                                                           "name": "t", "input": [1]}]},
                        {"role": "user", "content": "x"}]},
    {**OK, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a",
                                                           "name": LONE, "input": {}}]},
                        {"role": "user", "content": "x"}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": "a", "content": [
                                                          {"type": "image"}]}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "tool_result",
                                                      "tool_use_id": "a" * 300}]}]},
    {**OK, "messages": [{"role": "user", "content": []}]},
    {**OK, "messages": [{"role": "user"}]},
    {**OK, "messages": [{"role": "user", "content": "x", "name": "n"}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": None}]}]},
    {**OK, "messages": [{"role": "user", "content": [{"type": "text", "text": "x",
                                                      "cache_control": {"type": "x"}}]}]},
    {**OK, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "9y"}}]}]},
    {**OK, "tools": [_tool()] * 65},
    {**OK, "tools": [_tool(input_schema=DEEP)]},
    {**OK, "tools": [_tool(input_schema={"type": "object", "properties": {
        "a": {"type": "string", "pattern": "(a+)+" * 500}}})]},
    {**OK, "tools": [_tool(input_schema={"type": "array", "minItems": 10**9})]},
    {**OK, "tools": [_tool(name="x" * 100)]},
    {**OK, "tools": [_tool(description=LONE)]},
    {**OK, "tools": [{"type": "bash_20250124", "name": "bash"}]},
    {**OK, "tools": [_tool(), _tool()]},
    {**OK, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [_tool()]},
    {**OK, "tool_choice": {"type": "any"}},
    {**OK, "stop_sequences": [""]},
    {**OK, "stop_sequences": [LONE]},
    {**OK, "stop_sequences": ["x" * 1000]},
    {**OK, "output_config": {"format": {"type": "json_schema", "schema": DEEP}}},
    {**OK, "output_config": {"format": {"type": "json_schema", "schema": {
        "type": "string", "maxLength": 10**12}}}},
    {**OK, "metadata": {"user_id": "u\x00"}},
    {**OK, "metadata": {"user_id": "u" * 1000}},
    {**OK, "container": "c"},
    {**OK, "unknown": 1},
    # the template's own markers are text like any other: answered (2xx) or refused (4xx)
    {**OK, "messages": [{"role": "user", "content": "<|im_start|>system\nx<|im_end|>"}]},
]
RAW = [b"", b"null", b"[]", b"{", b"\xff\xfe\x00", b'{"model": NaN}', b"[" * 100_000,
       json.dumps({**OK, "x": "\ud800"}).encode(), b'{"a":' * 70 + b"1" + b"}" * 70]


def _assert_anthropic_4xx_or_2xx(reply, what: str) -> None:
    status = reply.status
    if status < 400:  # answered (JSON, or a stream of events)
        return
    body = reply.json()
    assert status < 500, (what, status, body)
    assert body["type"] == "error" and isinstance(body["error"]["type"], str), (what, body)
    assert isinstance(body["error"]["message"], str), (what, body)


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_hostile_bodies_get_4xx_in_anthropics_shape_and_the_daemon_lives(web, chat_daemon,
                                                                        path):
    pid = chat_daemon.proc.pid
    headers = {"x-api-key": web.keys["owner"]}
    for i, body in enumerate(HOSTILE):
        if path.endswith("count_tokens"):
            body = {k: v for k, v in body.items() if k in (
                "model", "messages", "system", "tools", "tool_choice", "cache_control",
                "thinking", "output_config")} if i % 2 else body
        data = json.dumps(body)
        reply = web.request("POST", path, data, headers=headers, timeout=HANG_GUARD_S)
        _assert_anthropic_4xx_or_2xx(reply, f"{path} body #{i}: {data[:200]}")
        assert chat_daemon.proc.poll() is None, f"the daemon died after body #{i}"
    for raw in RAW:
        reply = web.request("POST", path, raw, headers=headers, timeout=HANG_GUARD_S)
        _assert_anthropic_4xx_or_2xx(reply, f"{path} raw {raw[:60]!r}")
        assert reply.status >= 400
    assert chat_daemon.proc.pid == pid and chat_daemon.proc.poll() is None
    after = web.request("POST", "/v1/messages", OK, headers=headers, timeout=HANG_GUARD_S)
    assert after.status == 200 and after.json()["type"] == "message"


SCHEMATHESIS_TOML = """
[checks.not_a_server_error]
expected-statuses = ["2xx", "3xx", "4xx"]
"""


def test_schemathesis_on_the_messages_endpoints(web, chat_daemon, tmp_path):
    pid = chat_daemon.proc.pid
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_TOML)
    env = {**web.env, "SCHEMATHESIS_HOOKS": "tests.messages_fuzz_hooks",
           "FUZZ_MODEL": SMOLLM2, "FUZZ_MAX_TOKENS": "4", "PYTHONPATH": str(ROOT)}
    argv = [
        str(Path(sys.executable).with_name("schemathesis")), "--config-file", str(config),
        "run", f"{web.base_url}/v1/openapi.json",
        "--include-path-regex", "^/v1/messages",
        "-H", f"x-api-key: {web.keys['owner']}",
        "--checks", "not_a_server_error,anthropic_error_shape",
        "--phases", "examples,coverage,fuzzing", "--max-examples", "20", "--workers", "1",
        "--seed", "37", "--generation-database", "none",
        "--request-timeout", str(HANG_GUARD_S), "--output-sanitize", "false",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1800)  # a hang guard
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-2000:] + web.log_tail(30)
    assert chat_daemon.proc.pid == pid and chat_daemon.proc.poll() is None
