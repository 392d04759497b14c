"""End to end: the official openai SDK against daphne and a real ``run_scheduler`` with Gemma
(N_CTX 2048, N_PARALLEL 2), over the test Redis. Slow: loads the model."""
import concurrent.futures
import json
import time

import openai
import pytest

from tests.live_service import RealDaemon, wait_until

pytestmark = [
    pytest.mark.slow,
]
GREEDY = {"temperature": 0, "max_tokens": 8}
LONG = {"temperature": 0, "max_tokens": 300, "extra_body": {"ignore_eos": True}}
HELLO = [{"role": "user", "content": "Name a fruit."}]


def client(web, key: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{web.base_url}/v1", api_key=key or web.keys["owner"],
                         max_retries=0, timeout=120)


def history(web, response_id: str) -> dict:
    request_id = response_id.split("-", 1)[1]
    return web.request("GET", f"/v1/requests/{request_id}", key=web.keys["owner"]).json()


def test_chat_whole_and_cached_tokens_on_repeat(web, daemon):
    sdk = client(web)
    first = sdk.chat.completions.create(model=daemon.model, messages=HELLO, **GREEDY)
    assert first.object == "chat.completion" and first.model == daemon.model
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].finish_reason in ("stop", "length")
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0
    # earlier tests of this session may have left the chat template's first tokens cached
    assert first.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens - 1
    again = sdk.chat.completions.create(model=daemon.model, messages=HELLO, **GREEDY)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > first.usage.prompt_tokens_details.cached_tokens  # same tenant: prefix reused
    assert again.choices[0].message.content  # (whole texts may differ: llama.cpp's CPU logits
    # shift with KV placement, so hit and miss are not compared token for token)
    row = history(web, again.id)
    assert row["status"] == "done"
    assert row["cached_tokens"] == again.usage.prompt_tokens_details.cached_tokens
    assert row["completion_tokens"] == again.usage.completion_tokens and row["ttft_ms"] > 0


def test_completion_whole(web, daemon):
    reply = client(web).completions.create(model=daemon.model, prompt="The capital of France is",
                                           **GREEDY)
    assert reply.object == "text_completion" and reply.choices[0].text
    assert reply.usage.prompt_tokens == 6
    assert reply.usage.total_tokens == 6 + reply.usage.completion_tokens


def test_chat_stream_with_usage(web, daemon):
    stream = client(web).chat.completions.create(
        model=daemon.model, messages=HELLO, stream=True,
        stream_options={"include_usage": True}, **GREEDY)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_completion_stream(web, daemon):
    stream = client(web).completions.create(model=daemon.model, prompt="One, two, three,",
                                            stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


# Every valid reply is short: `{"ok": true}` plus the whitespace llama.cpp's JSON grammar
# allows (at most ~20 characters per gap), so 200 tokens always reach the closing brace.
SHORT_SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"], "additionalProperties": False}


def test_json_schema_response_format(web, daemon):
    reply = client(web).chat.completions.create(
        model=daemon.model, messages=[{"role": "user", "content": "Give a JSON object."}],
        temperature=0, max_tokens=200,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "x", "schema": SHORT_SCHEMA}})
    assert reply.choices[0].finish_reason == "stop", reply
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"ok"} and isinstance(value["ok"], bool), value  # the schema, whole


def test_bad_key_raises_authentication_error(web, daemon):
    with pytest.raises(openai.AuthenticationError):
        client(web, "sk-0000000000.nope").chat.completions.create(model=daemon.model,
                                                                   messages=HELLO)


def test_too_long_a_prompt_raises_bad_request(web, daemon):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client(web).completions.create(model=daemon.model, prompt="word " * 3000,
                                           max_tokens=10, stream=stream)
        assert caught.value.code == "context_length_exceeded"
        assert "2048" in caught.value.message


def test_bad_value_raises_bad_request_naming_it(web, daemon):
    with pytest.raises(openai.BadRequestError) as caught:
        client(web).chat.completions.create(model=daemon.model, messages=HELLO, temperature=7)
    assert caught.value.param == "temperature"


def test_disconnect_mid_stream_cancels_the_row_after_the_grace_and_frees_the_slot(web, daemon):
    # long enough to outlive the web's RESUME_GRACE_S (3 s) and the daemon's confirmation
    # (at most 1024 tokens with the prompt: N_CTX 2048 over N_PARALLEL 2)
    reply = web.request("POST", "/v1/chat/completions", {
        "model": daemon.model, "messages": HELLO, "stream": True, "temperature": 0,
        "max_tokens": 1000, "ignore_eos": True}, web.keys["owner"])
    request_id = reply.header("X-Request-Id")
    stream = reply.sse()
    for _ in range(3):
        next(stream)
    wait_until(lambda: any(s["request_id"] == request_id for s in daemon.snapshot()["slots"]), 10)
    reply.close()
    wait_until(lambda: all(s["state"] == "idle" for s in daemon.snapshot()["slots"]), 60)
    row = wait_until(lambda: (r := web.request("GET", f"/v1/requests/{request_id}",
                                               key=web.keys["owner"]).json())["finished"] and r)
    assert row["status"] == "cancelled" and row["completion_tokens"] < 1000


def test_queue_full_gives_fast_503s_and_accepted_requests_complete(web):
    small = RealDaemon(web, "gemma-q1-e2e", MAX_QUEUE="1", N_PARALLEL="1").start()
    try:
        def one(i: int) -> tuple[int, float, str | None, str]:
            t0 = time.monotonic()
            reply = web.request("POST", "/v1/completions", {
                "model": small.model, "prompt": f"Count to {i}:", "max_tokens": 16,
                "temperature": 0, "ignore_eos": True, "stream": True}, web.keys["owner"])
            if reply.status != 200:
                return reply.status, time.monotonic() - t0, reply.header("Retry-After"), \
                    reply.json()["error"]["code"]
            frames = [data for _, data in reply.sse()]
            return 200, time.monotonic() - t0, None, json.loads(frames[-2])["choices"][0][
                "finish_reason"]

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            results = list(pool.map(one, range(8)))
        refused = [r for r in results if r[0] == 503]
        served = [r for r in results if r[0] == 200]
        assert refused and served, results
        assert all(r[2] and r[3] == "queue_full" for r in refused), refused
        assert all(r[3] == "length" for r in served), served
    finally:
        small.stop()


def test_killed_daemon_interrupts_the_stream_then_a_restart_serves(web):
    victim = RealDaemon(web, "gemma-kill-e2e").start()
    try:
        sdk = client(web)
        stream = sdk.chat.completions.create(model=victim.model, messages=HELLO, stream=True,
                                             **LONG)
        first = next(iter(stream))
        request_id = first.id.split("-", 1)[1]
        victim.kill()
        with pytest.raises(openai.APIError) as caught:
            for _ in stream:
                pass
        assert "interrupted" in caught.value.message
        row = web.request("GET", f"/v1/requests/{request_id}", key=web.keys["owner"]).json()
        assert (row["status"], row["error_code"]) == ("error", "inference_interrupted")
        victim.start()
        reply = sdk.chat.completions.create(model=victim.model, messages=HELLO, **GREEDY)
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        victim.stop()
