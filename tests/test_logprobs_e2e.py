"""logprobs through the whole stack (#16), with the official ``openai`` SDK: chat
``logprobs``/``top_logprobs`` on the chat model, completions ``logprobs`` on Gemma, whole
and streamed. Real daphne, Redis and daemons."""
from __future__ import annotations

import openai
import pytest

from config.models import SMOLLM2
from tests.live_service import openai_client

pytestmark = pytest.mark.slow
QUESTION = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "What is the capital of France?"}]


def test_chat_top_logprobs_at_temperature_0(web, chat_daemon):
    reply = openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=QUESTION, temperature=0, max_tokens=12,
        logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for token in content:
        assert len(token.top_logprobs) == 5
        assert token.logprob <= 0 and all(alt.logprob <= 0 for alt in token.top_logprobs)
        assert all(token.logprob >= alt.logprob - 1e-6 for alt in token.top_logprobs)
        assert bytes(token.bytes).decode("utf-8", "replace") == token.token


def test_chat_logprobs_stream_token_by_token(web, chat_daemon):
    stream = openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=QUESTION, temperature=0, max_tokens=12, stream=True,
        logprobs=True, top_logprobs=2, stream_options={"include_usage": True})
    text, entries, usage = "", [], None
    for chunk in stream:
        usage = chunk.usage or usage
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            entries += chunk.choices[0].logprobs.content
    assert len(entries) == usage.completion_tokens
    assert "".join(e.token for e in entries) == text
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_logprobs_shape(web, daemon):
    reply = openai_client(web).completions.create(
        model=daemon.model, prompt="The capital of France is", temperature=0, max_tokens=8,
        logprobs=3)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 8
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == [sum(len(t) for t in logprobs.tokens[:i])
                                           for i in range(8)]
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs,
                                   logprobs.top_logprobs, strict=False):
        assert 1 <= len(top) <= 3 and all(lp <= 0 for lp in top.values())
        assert top[token] == pytest.approx(logprob) and logprob == max(top.values())


def test_no_logprobs_unless_asked(web, chat_daemon):
    reply = openai_client(web).chat.completions.create(model=SMOLLM2, messages=QUESTION,
                                                temperature=0, max_tokens=4)
    assert reply.choices[0].logprobs is None


@pytest.mark.parametrize("body, param", [
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
])
def test_chat_logprobs_refusals_name_the_field(web, chat_daemon, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).chat.completions.create(model=SMOLLM2, messages=QUESTION, max_tokens=2,
                                            extra_body=body)
    assert caught.value.body["param"] == param


def test_completion_logprobs_past_20_is_refused(web, daemon):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).completions.create(model=daemon.model, prompt="x", max_tokens=2,
                                       logprobs=21)
    assert caught.value.body["param"] == "logprobs"


def test_echo_puts_the_prompt_first_whole_and_streamed(web, daemon):
    api = openai_client(web)
    prompt = "The capital of France is"
    whole = api.completions.create(model=daemon.model, prompt=prompt, temperature=0,
                                   max_tokens=4, echo=True)
    assert whole.choices[0].text.startswith(prompt) and len(whole.choices[0].text) > len(prompt)
    assert whole.usage.completion_tokens == 4
    chunks = [c.choices[0].text for c in api.completions.create(
        model=daemon.model, prompt=prompt, temperature=0, max_tokens=4, echo=True, stream=True)
        if c.choices]
    assert chunks[0] == prompt and "".join(chunks).startswith(prompt)


def test_echo_of_token_ids_is_their_text(web, daemon):
    import json
    import urllib.request

    def tokenize(text):
        request = urllib.request.Request(
            f"{web.base_url}/v1/tokenize", method="POST",
            data=json.dumps({"model": daemon.model, "content": text}).encode(),
            headers={"Authorization": f"Bearer {web.keys['owner']}"})
        with urllib.request.urlopen(request, timeout=60) as response:
            return json.loads(response.read())["tokens"]

    ids = tokenize("Once upon a time")
    reply = openai_client(web).completions.create(model=daemon.model, prompt=ids, temperature=0,
                                           max_tokens=2, echo=True)
    assert reply.choices[0].text.startswith("Once upon a time")


def test_echo_with_logprobs_and_best_of_are_clear_400s(web, daemon):
    for extra, param in (({"echo": True, "logprobs": 1}, "echo"), ({"best_of": 2}, "best_of"),
                         ({"echo": "yes"}, "echo")):
        with pytest.raises(openai.BadRequestError) as caught:
            openai_client(web).completions.create(model=daemon.model, prompt="x", max_tokens=2,
                                           extra_body=extra)
        assert caught.value.body["param"] == param
