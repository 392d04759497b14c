"""Grammars priced before they run, through the real web and a real daemon (Gemma).

Issue 31's grammar (``root ::= item+``, ``item ::= c0 | ... | c15``, each ``ck ::= [a-z ]``)
once held the daemon's loop in llama.cpp's grammar sampler for minutes. It is refused with a
400 naming ``grammar`` and the limit before it is queued; the daemon is the same process
afterwards and answers the next request. A JSON schema cannot be turned into GBNF on the web
(the converter lives in llama_cpp), so an ambiguous schema is refused by the daemon, where
it is compiled: the client still gets a 400 (or, streamed, an error event) naming the
field and the limit.
"""
from __future__ import annotations

import json

import pytest

from wire import grammar_check

pytestmark = pytest.mark.slow

LIMIT = str(grammar_check.MAX_SAMPLING_VISITS)


def alternatives_under_repetition(k: int) -> str:
    return ("root ::= item+\nitem ::= " + " | ".join(f"c{i}" for i in range(k)) + "\n"
            + "".join(f"c{i} ::= [a-z ]\n" for i in range(k)))


# anyOf of overlapping string types under an array: each element matches 8 ways
AMBIGUOUS_SCHEMA = {"type": "array", "items": {"anyOf": [
    {"type": "string", "pattern": f"^[a-z]{{1,{10 + i}}}$"} for i in range(8)]}}


def post(web, path: str, body: dict) -> tuple[int, object]:
    reply = web.request("POST", path, body, key=web.keys["owner"], timeout=120)
    if (reply.header("Content-Type") or "").startswith("text/event-stream"):
        events = [json.loads(data) for _, data in reply.sse() if data != "[DONE]"]
        reply.conn.close()
        return reply.status, events
    return reply.status, reply.json()


def alive_pid(daemon) -> int:
    assert daemon.proc.poll() is None, daemon.log_tail(40)
    return daemon.snapshot()["pid"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_issue_grammar_is_a_400_and_the_daemon_carries_on(web, daemon, stream):
    pid = alive_pid(daemon)
    status, body = post(web, "/v1/completions", {
        "model": daemon.model, "prompt": "Write letters:", "max_tokens": 8, "stream": stream,
        "grammar": alternatives_under_repetition(16)})
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "invalid_request_error" and error["param"] == "grammar", error
    assert "too ambiguous" in error["message"] and LIMIT in error["message"], error
    status, body = post(web, "/v1/completions", {
        "model": daemon.model, "prompt": "Say yes or no:", "max_tokens": 4,
        "grammar": 'root ::= "yes" | "no"'})
    assert status == 200, body
    assert body["choices"][0]["text"] in ("yes", "no"), body
    assert alive_pid(daemon) == pid


def test_an_ambiguous_schema_is_a_400_naming_the_field_and_the_limit(web, daemon):
    pid = alive_pid(daemon)
    status, body = post(web, "/v1/chat/completions", {
        "model": daemon.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": "A list of words, as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "words", "schema": AMBIGUOUS_SCHEMA}}})
    assert status == 400, body
    error = body["error"]
    assert error["code"] == "invalid_request_error", error
    assert error["param"] in ("response_format", "json_schema"), error
    assert "too ambiguous" in error["message"] and LIMIT in error["message"], error
    assert alive_pid(daemon) == pid


def test_an_ambiguous_schema_streamed_ends_with_a_typed_error(web, daemon):
    pid = alive_pid(daemon)
    status, events = post(web, "/v1/chat/completions", {
        "model": daemon.model, "max_tokens": 8, "stream": True,
        "messages": [{"role": "user", "content": "A list of words, as JSON."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "words", "schema": AMBIGUOUS_SCHEMA}}})
    if status == 400:  # refused before the stream started
        errors = [events["error"]]
    else:
        assert status == 200, events
        errors = [e["error"] for e in events if "error" in e]
        assert not any(c.get("delta", {}).get("content")
                       for e in events for c in e.get("choices", [])), events
    assert len(errors) == 1, events
    error = errors[0]
    assert error["code"] == "invalid_request_error", error
    assert error["param"] in ("response_format", "json_schema"), error
    assert "too ambiguous" in error["message"] and LIMIT in error["message"], error
    assert alive_pid(daemon) == pid
