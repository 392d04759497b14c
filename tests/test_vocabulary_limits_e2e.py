"""Tokenize and detokenize answers are bounded (#31): a size cap (MAX_VOCAB_ANSWER_BYTES, a
400 naming the field and the limit), the tenant's limits and usage count their tokens, and
large ones never hold up another tenant's generation (the daemon's vocabulary thread).

Real daphne, Redis and a Gemma daemon; the web of this module takes prompts of 256 KiB
(MAX_PROMPT_BYTES as at the default N_CTX), the size of the issue's 261 KB of CJK text."""
from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime

import pytest

from tests.live_service import RealDaemon, WebServer, redis_conn, wait_until
from tests.test_limits_http import assert_429, make_tenant
from wire import limits as wire_limits
from wire import protocol, queue

pytestmark = pytest.mark.slow
CAP = 2**20  # MAX_VOCAB_ANSWER_BYTES's default
# 87,000 CJK characters, 261,000 bytes of UTF-8: the text (6.9 MB with pieces)
CJK = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(87_000))


@pytest.fixture(scope="module")
def web():
    server = WebServer()
    server.env["MAX_PROMPT_BYTES"] = str(256 * 1024)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(web):
    started = RealDaemon(web, f"gemma-vocab-{uuid.uuid4().hex[:6]}").start()
    yield started
    started.stop()


def post(web, path: str, body: dict, key: str) -> tuple[int, dict]:
    reply = web.request("POST", f"/v1/{path}", body, key, timeout=120)
    return reply.status, reply.json()


def tokenize(web, daemon, key: str, content: str, **options) -> tuple[int, dict]:
    return post(web, "tokenize", {"model": daemon.model, "content": content, **options}, key)


def test_with_pieces_past_the_cap_is_a_400_naming_content_and_the_limit(web, daemon):
    status, reply = tokenize(web, daemon, web.keys["owner"], CJK, with_pieces=True)
    assert status == 400, reply
    error = reply["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "invalid_request_error", "invalid_request_error", "content")
    assert error["max_answer_bytes"] == CAP and error["answer_bytes"] > CAP
    assert f"{CAP} (MAX_VOCAB_ANSWER_BYTES)" in error["message"]
    assert "usage" not in error  # billed, not shown
    # the same text without pieces fits, and a with_pieces answer under the cap is whole
    status, plain = tokenize(web, daemon, web.keys["owner"], CJK)
    assert status == 200 and len(plain["tokens"]) > 20_000
    reply = web.request("POST", "/v1/tokenize", {"model": daemon.model, "content": CJK[:2000],
                                                 "with_pieces": True}, web.keys["owner"])
    body = reply.response.read()
    reply.conn.close()
    assert reply.status == 200 and 0 < len(body) <= CAP
    assert all(set(p) == {"id", "piece"} for p in json.loads(body)["tokens"])


def test_detokenize_past_the_cap_is_a_400_naming_tokens(web, daemon):
    key = web.keys["owner"]
    _, spaces = tokenize(web, daemon, key, " " * 31)
    assert len(spaces["tokens"]) == 1  # Gemma's longest token: 31 bytes
    ids = spaces["tokens"] * 65_536  # 2 MiB of spaces
    status, reply = post(web, "detokenize", {"model": daemon.model, "tokens": ids}, key)
    assert status == 400 and reply["error"]["param"] == "tokens", reply
    assert reply["error"]["max_answer_bytes"] == CAP
    status, reply = post(web, "detokenize", {"model": daemon.model, "tokens": ids[:20_000]}, key)
    assert status == 200 and reply["content"] == " " * 31 * 20_000


def test_tokens_count_against_the_limits_and_show_in_usage(web, daemon):
    """Tokens per minute: 300. A 240-byte text reserves 256 (bytes + 16) and uses its tokens
    (~40); the third does not fit next to what the first two used. Requests per minute and
    the month count them too; a 400 past the cap is billed for the tokens it counted."""
    tenant_id, key = make_tenant(web, tokens_per_minute=300)
    text = "hello world " * 20
    counts = []
    for _ in range(2):
        status, reply = tokenize(web, daemon, key, text)
        assert status == 200
        counts.append(len(reply["tokens"]))
    refused = web.request("POST", "/v1/tokenize", {"model": daemon.model, "content": text}, key)
    assert_429(refused, "tpm_exceeded")
    r = redis_conn()
    current = wire_limits.current_usage(r, str(tenant_id), time.time())
    assert current["tokens_this_minute"] == sum(counts)
    assert current["requests_this_minute"] == 2
    assert int(r.get(wire_limits.month_key(str(tenant_id), time.time()))) == sum(counts)
    usage = web.request("GET", "/v1/usage", key=key).json()
    assert usage["totals"]["requests"] == 2
    assert usage["totals"]["prompt_tokens"] == sum(counts)
    history = web.request("GET", "/v1/requests", key=key).json()["results"]
    assert sorted(row["prompt_tokens"] for row in history) == sorted(counts)

    # detokenize counts its ids; a refusal past the cap counts the tokens it tokenized
    tenant_id, key = make_tenant(web, requests_per_minute=3)
    status, _ = post(web, "detokenize", {"model": daemon.model, "tokens": [2, 3, 4]}, key)
    assert status == 200
    status, _ = tokenize(web, daemon, key, CJK, with_pieces=True)
    assert status == 400
    _, plain = tokenize(web, daemon, key, CJK)
    assert_429(web.request("POST", "/v1/tokenize", {"model": daemon.model, "content": "x"},
                           key), "rpm_exceeded")
    expected = 3 + 2 * len(plain["tokens"])
    wait_until(lambda: wire_limits.current_usage(r, str(tenant_id), time.time())
               ["tokens_this_minute"] == expected)


def entry_ms(entry_id: bytes) -> tuple[int, int]:
    ms, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).split("-")
    return int(ms), int(seq)


def test_another_tenants_stream_starts_while_large_tokenizes_run(web, daemon):
    """Three 261 KB tokenizes with pieces of one tenant (each tokenized whole, then refused
    past the cap) are in the daemon before another tenant's stream is sent: the stream is
    started (its ``accepted`` entry in Redis) before any of them ends (its history row
    finished), since they are answered on the vocabulary thread and not on the one that
    starts jobs; the stream runs to its end and every tokenize is answered. Ordered by the
    server's clock (Redis entry ids, history rows), not by durations."""
    owner, other = web.keys["owner"], web.keys["outsider"]
    r = redis_conn()
    ends: list[int] = []
    lock = threading.Lock()

    def big() -> None:
        status, _ = tokenize(web, daemon, owner, CJK, with_pieces=True)
        with lock:
            ends.append(status)

    load = lambda: int(r.hget(queue.load_key(daemon.model), daemon.daemon_id) or 0)  # noqa: E731
    before = load()
    threads = [threading.Thread(target=big) for _ in range(3)]
    for thread in threads:
        thread.start()
    wait_until(lambda: load() >= before + 3 or ends, timeout_s=60, step_s=0.005)
    assert not ends, "a tokenize was answered before all three were in the daemon"
    stream = web.request("POST", "/v1/completions", {
        "model": daemon.model, "prompt": "Count: one, two,", "max_tokens": 60,
        "ignore_eos": True, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}}, other, timeout=300)
    assert stream.status == 200
    events = protocol.events_stream(stream.header("X-Request-Id"))
    tokens = 0
    for _, data in stream.sse():
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    accepted = [entry_ms(i) for i, fields in r.xrange(events)
                if protocol.decode_event(fields)[0] == protocol.ACCEPTED]
    for thread in threads:
        thread.join(timeout=300)
    assert ends == [400, 400, 400]
    rows = [row for row in web.request("GET", "/v1/requests", key=owner).json()["results"]
            if row["kind"] == "tokenize"][:3]  # the newest: this test's
    answered = [datetime.fromisoformat(row["finished"].replace("Z", "+00:00")).timestamp()
                for row in rows]  # the daemon's history sink, before each terminal event
    assert tokens == 60 and len(accepted) == 1
    assert accepted[0][0] / 1000 < min(answered), (accepted, answered)
