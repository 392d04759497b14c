"""No tenant can hurt another, end to end: a real daphne, a real daemon (Gemma), real Redis.

Tenant B streams a long completion over SSE while tenant A sends, through the API, each
request that would stop an unguarded daemon; A gets a 4xx (or a proper answer), B's stream ends
with its finish reason and no error, and the daemon's pid is unchanged. Then A tries to
take more than its share (queue, KV, prompt size) while B keeps being served.
"""

from __future__ import annotations

import json
import threading
import uuid

import pytest

from tests.live_service import RealDaemon, wait_until
from tests.test_limits_http import make_tenant

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a long story about a dragon."}]


class Stream(threading.Thread):
    """Tenant B's SSE chat completion, read to the end in the background."""

    def __init__(self, web, model: str, key: str, max_tokens: int = 120) -> None:
        super().__init__(daemon=True)
        self.web, self.key = web, key
        self.body = {"model": model, "messages": STORY, "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True, "stream": True}
        self.status: int | None = None
        self.chunks: list[dict] = []
        self.first_text = threading.Event()

    def run(self) -> None:
        reply = self.web.request("POST", "/v1/chat/completions", self.body, self.key,
                                 timeout=300)
        self.status = reply.status
        for _id, data in reply.sse():
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            self.chunks.append(chunk)
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                self.first_text.set()

    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0].get("finish_reason") for c in self.chunks if c.get("choices")]
        return next((r for r in reasons if r), None)

    def errors(self) -> list[dict]:
        return [c for c in self.chunks if "error" in c]


def _deep_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


POISON = {
    "surrogate in chat content": {"messages": [{"role": "user", "content": "hi \ud800"}]},
    "surrogate in grammar": {"grammar": 'root ::= "\ud800"'},
    "schema with maxLength 100000": {
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "s", "schema": {"type": "string", "maxLength": 100000}}}},
    "20,000 nested parentheses": {"grammar": _deep_grammar(20_000)},
    "a grammar that allows no token": {"grammar": "root ::= [\\x00]"},
    "a complete grammar with ignore_eos": {"grammar": 'root ::= "a"', "ignore_eos": True},
}


@pytest.fixture(scope="module")
def tenant_b(web):
    return make_tenant(web)[1]


@pytest.mark.parametrize("name", list(POISON))
def test_a_poison_request_through_the_api_fails_alone(web, daemon, tenant_b, name):
    pid = daemon.snapshot()["pid"]
    victim = Stream(web, daemon.model, tenant_b)
    victim.start()
    assert victim.first_text.wait(180), "tenant B's stream never started"
    body = {"model": daemon.model, "messages": [{"role": "user", "content": "Say a"}],
            "max_tokens": 8, **POISON[name]}
    # json.dumps keeps a lone surrogate as the \ud800 escape a hostile client would send
    reply = web.request("POST", "/v1/chat/completions", json.dumps(body), web.keys["owner"])
    answer = reply.json()
    if name == "a complete grammar with ignore_eos":
        assert reply.status == 200, answer
        assert answer["choices"][0]["message"]["content"] == "a"
        assert answer["choices"][0]["finish_reason"] == "stop"
    else:
        assert reply.status == 400, answer
        assert answer["error"]["param"] in ("messages", "grammar", "response_format") or \
            answer["error"]["param"].startswith("messages"), answer
    victim.join(300)
    assert victim.status == 200 and not victim.errors(), victim.errors()
    assert victim.finish_reason() == "length"
    assert daemon.proc.poll() is None and daemon.snapshot()["pid"] == pid


def _chat(web, model: str, key: str, **body):
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            "temperature": 0, **body}
    return web.request("POST", "/v1/chat/completions", body, key, timeout=300)


def test_a_flood_gets_429s_while_another_tenant_is_served(web, tenant_b):
    daemon = RealDaemon(web, f"gemma-flood-{uuid.uuid4().hex[:6]}", N_PARALLEL="1",
                        MAX_QUEUE_PER_TENANT="3").start()
    try:
        statuses: list[int] = []
        codes: list[str] = []

        def flood_one() -> None:
            reply = _chat(web, daemon.model, web.keys["owner"], max_tokens=24, ignore_eos=True)
            statuses.append(reply.status)
            body = reply.json()
            if reply.status != 200:
                codes.append(body["error"]["code"])
                assert reply.header("Retry-After")

        flood = [threading.Thread(target=flood_one) for _ in range(12)]
        for thread in flood:
            thread.start()
        wait_until(lambda: codes, timeout_s=120)  # the flood is being refused now
        reply = _chat(web, daemon.model, tenant_b)
        assert reply.status == 200 and reply.json()["choices"][0]["finish_reason"]
        for thread in flood:
            thread.join(300)
        assert 429 in statuses and set(codes) == {"tenant_queue_full"}
        assert statuses.count(200) >= 4  # one running + three waiting at any moment
    finally:
        daemon.stop()


def test_huge_prompts_are_refused_before_anything_tokenizes_them(web, daemon, tenant_b):
    huge = "word " * (2_400_000 // 5)
    for _ in range(3):
        reply = web.request("POST", "/v1/completions",
                            {"model": daemon.model, "prompt": huge, "max_tokens": 2},
                            web.keys["owner"])
        error = reply.json()["error"]
        assert reply.status == 400 and error["param"] == "prompt", error
    reply = _chat(web, daemon.model, tenant_b)
    assert reply.status == 200


def test_a_big_kv_reservation_does_not_lock_another_tenant_out(web, tenant_b):
    daemon = RealDaemon(web, f"gemma-kv-{uuid.uuid4().hex[:6]}", N_PARALLEL="2",
                        KV_BLOCK_TOKENS="64", KV_TENANT_SHARE="0.5").start()
    try:
        too_big = _chat(web, daemon.model, web.keys["owner"], max_tokens=2000)
        error = too_big.json()["error"]
        assert too_big.status == 400 and error["code"] == "device_memory_budget_exceeded"
        hog = Stream(web, daemon.model, web.keys["owner"], max_tokens=900)
        hog.start()
        assert hog.first_text.wait(180)
        reply = _chat(web, daemon.model, tenant_b)
        assert reply.status == 200 and reply.json()["choices"][0]["finish_reason"]
        assert hog.is_alive()  # B was served while A's big request was still running
    finally:
        daemon.stop()
