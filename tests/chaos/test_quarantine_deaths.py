"""One kill -9 under identical streams of two tenants, through the real web (daphne) and
real daemons (Gemma): the quarantine counts distinct deaths, so copies of one request
running at one death are not "running at two crashes" (issue #31). Every copy is continued
by the daemon restarted under the same id and streams to its end, none is quarantined, and
the same body is served afterwards to both tenants."""
from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import pytest

from tests.live_service import RealDaemon, WebServer, patient_web, redis_conn, wait_until
from wire import protocol

pytestmark = pytest.mark.slow

# a death is a pause: the web waits for the restarted daemon
web = pytest.fixture(scope="module", name="web")(patient_web)


class Stream(threading.Thread):
    """One streamed completion read to its end with one tenant's key."""

    def __init__(self, web: WebServer, body: dict[str, Any], key: str) -> None:
        super().__init__(daemon=True)
        self.web, self.key = web, key
        self.body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        self.request_id: str | None = None
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.errors: list[Any] = []  # error chunks (a quarantined copy ends with one)
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            reply = self.web.request("POST", "/v1/completions", self.body, self.key, timeout=300)
            assert reply.status == 200, reply.json()
            self.request_id = reply.header("X-Request-Id")
            for _, data in reply.sse():
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    self.errors.append(chunk["error"])
                    continue
                if chunk.get("usage"):
                    self.usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    self.text.append(choice.get("text") or "")
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except BaseException as exc:  # reported by the test
            self.failure = exc


def events(request_id: str) -> list[tuple[str, dict[str, Any]]]:
    return [protocol.decode_event(f) for _, f in
            redis_conn().xrange(protocol.events_stream(request_id))]


def streaming(stream: Stream) -> bool:
    return bool(stream.request_id) and any(k == protocol.TOKEN for k, _ in
                                           events(stream.request_id))


def quarantined_in(model: str) -> list[dict[str, Any]]:
    records = [json.loads(raw) for raw in redis_conn().hvals(protocol.QUARANTINE_HASH)]
    return [r for r in records if r.get("model") == model]


def test_identical_streams_of_two_tenants_at_one_kill_9_all_continue(web):
    model = f"gemma-chaos-{uuid.uuid4().hex[:6]}"
    first = RealDaemon(web, model, N_PARALLEL="3").start()
    body = {"model": model, "prompt": f"Tell me a long story ({uuid.uuid4().hex}).",
            "max_tokens": 120, "ignore_eos": True, "temperature": 0.7, "seed": 7}
    # the same body three times: twice from tenant alpha, once from tenant beta
    keys = [web.keys["owner"], web.keys["member"], web.keys["outsider"]]
    streams = [Stream(web, body, key) for key in keys]
    second = RealDaemon(web, model, N_PARALLEL="3")
    try:
        for stream in streams:
            stream.start()
        wait_until(lambda: all(streaming(s) for s in streams)
                   or any(s.failure for s in streams), timeout_s=180)
        assert not any(s.failure for s in streams), [s.failure for s in streams]
        assert not any(s.finish_reason for s in streams)  # all three running at the kill
        first.kill()
        second.start(daemon_id=first.daemon_id)  # as the supervisor restarts it
        for stream in streams:
            stream.join(600)  # a hang guard: the CPUs are shared
            assert not stream.is_alive(), ("a request never ended", second.log_tail(80),
                                           web.log_tail(40))
        for stream in streams:
            assert stream.failure is None, stream.failure
            assert stream.errors == [], stream.errors  # no request_quarantined
            assert stream.finish_reason == "length"
            assert stream.usage["completion_tokens"] == 120
            kind, done = events(stream.request_id)[-1]
            assert kind == protocol.DONE and done["resumed"] == 1, (kind, done)
        assert quarantined_in(model) == []
        # the same body is still served, to both tenants
        again = [Stream(web, body, key) for key in (web.keys["owner"], web.keys["outsider"])]
        for stream in again:
            stream.start()
        for stream in again:
            stream.join(600)  # a hang guard: the CPUs are shared
            assert not stream.is_alive(), ("a request never ended", second.log_tail(80),
                                           web.log_tail(40))
            assert stream.failure is None and stream.errors == [], (stream.failure,
                                                                    stream.errors)
            assert stream.usage["completion_tokens"] == 120
        assert quarantined_in(model) == []
    finally:
        first.kill()
        second.stop()
