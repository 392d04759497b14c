"""kill -9 of a daemon with requests queued and streaming, through the real web (daphne):
the queued ones complete on another daemon, the streaming ones are continued (``resumed``)
and their text arrives once, with increasing event ids; a grammar-constrained one still
parses. And after requests end, no key of Redis holds a byte of their prompts."""
from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import jsonschema
import pytest

from tests.live_service import RealDaemon, WebServer, patient_web, redis_conn, wait_until
from wire import protocol

pytestmark = pytest.mark.slow

# Twenty-five required fields: the constrained reply is long (it is still running when the
# daemon dies) and ends by itself; a plain sequence, cheap for llama.cpp's grammar to follow.
# Booleans, so its length is bounded (~8 tokens a field, well inside max_tokens): integers
# may run to 16 digits each, and a reply cut by max_tokens does not parse.
FIELDS = [f"f{i}" for i in range(25)]
SCHEMA = {
    "type": "object",
    "properties": {name: {"type": "boolean"} for name in FIELDS},
    "required": FIELDS,
    "additionalProperties": False,
}


# a death is a pause: the web waits for the next daemon
web = pytest.fixture(scope="module", name="web")(patient_web)

class Stream(threading.Thread):
    """One streamed request read to its end: its SSE ids, text and final chunks."""

    def __init__(self, web: WebServer, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.web, self.body = web, {**body, "stream": True,
                                    "stream_options": {"include_usage": True}}
        self.request_id: str | None = None
        self.ids: list[str] = []
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.frames: list[Any] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            path = "/v1/chat/completions" if "messages" in self.body else "/v1/completions"
            reply = self.web.request("POST", path, self.body, self.web.keys["owner"],
                                     timeout=300)
            assert reply.status == 200, reply.json()
            self.request_id = reply.header("X-Request-Id")
            for event_id, data in reply.sse():
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                self.frames.append(chunk)
                assert "error" not in chunk, chunk
                if event_id:
                    self.ids.append(event_id)
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    piece = choice.get("text") if "text" in choice else \
                        (choice.get("delta") or {}).get("content")
                    self.text.append(piece or "")
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except BaseException as exc:  # reported by the test
            self.error = exc


class Reply(threading.Thread):
    """One non-streamed request."""

    def __init__(self, web: WebServer, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.web, self.body = web, body
        self.status = 0
        self.json: Any = None

    def run(self) -> None:
        reply = self.web.request("POST", "/v1/completions", self.body, self.web.keys["owner"],
                                 timeout=300)
        self.status, self.json = reply.status, reply.json()


def stream_events(request_id: str) -> list[tuple[str, str, dict[str, Any]]]:
    entries = redis_conn().xrange(protocol.events_stream(request_id))
    return [(eid.decode(), *protocol.decode_event(fields)) for eid, fields in entries]


def id_key(entry_id: str) -> tuple[int, int]:
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


@pytest.mark.parametrize("same_id", [False, True], ids=["another-daemon", "restarted-same-id"])
def test_kill_9_with_jobs_queued_and_streaming(web, same_id):
    model = f"gemma-chaos-{uuid.uuid4().hex[:6]}"
    first = RealDaemon(web, model, N_PARALLEL="2", LOCAL_QUEUE="3").start()
    nonce = uuid.uuid4().hex
    plain = Stream(web, {"model": model, "prompt": f"Tell me a long story ({nonce}).",
                         "max_tokens": 200, "ignore_eos": True, "temperature": 0.7,
                         "seed": 7})
    constrained = Stream(web, {
        "model": model, "max_tokens": 600, "temperature": 0,
        "messages": [{"role": "user", "content": f"Twenty-five answers please ({nonce})."}],
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "numbers", "schema": SCHEMA}},
    })
    streams = [plain, constrained]
    for stream in streams:
        stream.start()
    # both are streaming (the two slots are busy) before the next three are sent: those
    # wait in the daemon's queue
    wait_until(lambda: all(s.request_id and any(k == "token" for _, k, _ in
                                                stream_events(s.request_id))
                           for s in streams) or any(s.error for s in streams), timeout_s=180)
    assert not any(s.error for s in streams), [s.error for s in streams]
    queued = [Reply(web, {"model": model, "prompt": f"The capital of France is ({nonce} {i})",
                          "max_tokens": 6, "temperature": 0}) for i in range(3)]
    for reply in queued:
        reply.start()
    # the three wait in the daemon's own queue (accepted, not started) when it dies
    wait_until(lambda: len(first.snapshot().get("queue", [])) == 3, timeout_s=60)
    assert not any(s.finish_reason for s in streams)  # still streaming: a kill mid-stream
    first.kill()
    second = RealDaemon(web, model)
    if same_id:
        second.start(daemon_id=first.daemon_id)
    else:
        second.start()
    try:
        for thread in [*streams, *queued]:
            thread.join(300)
            assert not thread.is_alive(), "a request never ended"
    finally:
        second.stop()
    for reply in queued:
        assert reply.status == 200, reply.json
        assert reply.json["choices"][0]["finish_reason"] in ("length", "stop")
    for stream in streams:
        assert stream.error is None, stream.error
        events = stream_events(stream.request_id)
        kind, done = events[-1][1], events[-1][2]
        assert kind == "done", events[-1]
        # it was running when the daemon died, and went on from where it was
        assert done["resumed"] == 1, (done, [k for _, k, _ in events])
        sent = "".join(d["text"] for _, k, d in events if k == "token")
        assert "".join(stream.text) == sent  # every piece once, in order
        assert sum(d["n_tokens"] for _, k, d in events if k == "token") == \
            done["usage"]["completion_tokens"] == stream.usage["completion_tokens"]
        # each event's id once (the end's chunks share theirs), in order, and exactly the
        # ids of the stream's events that have something to say: no gap, no repeat
        chat = "messages" in stream.body
        expected = [eid for eid, k, d in events
                    if (k == "token" and d["text"]) or k == "done"
                    or (k == "accepted" and chat and not d.get("resumed"))]
        assert list(dict.fromkeys(stream.ids)) == expected
    assert plain.finish_reason == "length" and plain.usage["completion_tokens"] == 200
    # ended by itself (a reply cut by max_tokens would not parse), then parses
    assert constrained.finish_reason == "stop", (constrained.usage, "".join(constrained.text))
    parsed = json.loads("".join(constrained.text))
    jsonschema.validate(parsed, SCHEMA)
    # nothing of these requests' prompts stays in Redis once they ended
    assert not keys_holding(nonce.encode())


def test_no_prompt_text_stays_in_redis_after_a_request_ends(web):
    model = f"gemma-chaos-{uuid.uuid4().hex[:6]}"
    daemon = RealDaemon(web, model).start()
    nonce = uuid.uuid4().hex
    try:
        reply = web.request("POST", "/v1/completions",
                            {"model": model, "prompt": f"Remember the code {nonce} well.",
                             "max_tokens": 4, "temperature": 0}, web.keys["owner"])
        assert reply.status == 200, reply.json()
        reply.json()
        wait_until(lambda: not keys_holding(nonce.encode()), timeout_s=10)
    finally:
        daemon.stop()


def keys_holding(needle: bytes) -> list[str]:
    """Every key of the test Redis database whose value holds ``needle`` (SCAN; every type
    read whole)."""
    r = redis_conn()
    found = []
    for key in r.scan_iter(count=1000):
        kind = r.type(key).decode()
        if kind == "string":
            values = [r.get(key) or b""]
        elif kind == "hash":
            values = [b"%s=%s" % kv for kv in r.hgetall(key).items()]
        elif kind == "stream":
            values = [b"".join(k + v for k, v in f.items()) for _, f in r.xrange(key)]
        elif kind == "list":
            values = r.lrange(key, 0, -1)
        elif kind == "set":
            values = list(r.smembers(key))
        elif kind == "zset":
            values = r.zrange(key, 0, -1)
        else:
            values = []
        if any(needle in v for v in values):
            found.append(key.decode())
    return found
