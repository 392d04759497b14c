"""n > 1 (#16) through the stack with the official ``openai`` SDK: n choices of one request,
the prompt counted and prefilled once, streamed with each chunk's choice index."""
from __future__ import annotations

import openai
import pytest

from config.models import SMOLLM2
from tests.live_service import openai_client

pytestmark = pytest.mark.slow
STORY = [{"role": "user", "content": "Tell me a one-line story about a fox."}]


def test_three_choices_with_a_seed_and_the_prompt_once(web, chat_daemon):
    api = openai_client(web)
    one = api.chat.completions.create(model=SMOLLM2, messages=STORY, max_tokens=16,
                                      temperature=1.0, seed=5, extra_body={"cache_prompt": False})
    three = api.chat.completions.create(model=SMOLLM2, messages=STORY, max_tokens=16,
                                        temperature=1.0, seed=5, n=3,
                                        extra_body={"cache_prompt": False})
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert all(c.message.content for c in three.choices)
    assert len({c.message.content for c in three.choices}) > 1  # each its own sampler
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens <= 3 * 16
    evaluated = three.model_extra["timings"]["prompt_evaluated"]
    # cache_prompt false: each choice prefills its own prompt (no sharing) - the stat says it
    assert evaluated == 3 * three.usage.prompt_tokens


def test_the_prompt_is_prefilled_once_with_the_cache_on(web, chat_daemon):
    three = openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=[{"role": "user", "content": "Name a colour. (unique 7f3a)"}],
        max_tokens=8, temperature=1.0, seed=9, n=3)
    prompt = three.usage.prompt_tokens
    evaluated = three.model_extra["timings"]["prompt_evaluated"]
    assert evaluated <= prompt + 2 * 2, (evaluated, prompt)  # the others: their last token


def test_choices_stream_with_their_index(web, chat_daemon):
    stream = openai_client(web).chat.completions.create(
        model=SMOLLM2, messages=STORY, max_tokens=12, temperature=1.0, seed=3, n=2,
        stream=True, stream_options={"include_usage": True})
    texts, finished, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert set(finished) == {0, 1} and all(texts.values())
    assert usage.completion_tokens >= 2


def test_completions_take_n_too(web, daemon):
    reply = openai_client(web).completions.create(model=daemon.model, prompt="Once upon a time",
                                           max_tokens=6, temperature=1.0, seed=1, n=2)
    assert [c.index for c in reply.choices] == [0, 1] and all(c.text for c in reply.choices)
    assert reply.usage.completion_tokens == 12


@pytest.mark.parametrize("n", [0, 9, "2"])
def test_n_out_of_range_is_a_400(web, chat_daemon, n):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).chat.completions.create(model=SMOLLM2, messages=STORY, max_tokens=2,
                                            extra_body={"n": n})
    assert caught.value.body["param"] == "n"


def test_a_prompt_array_gives_one_choice_per_prompt_in_order(web, daemon):
    prompts = ["The capital of France is", "One, two, three,", "Roses are red,"]
    api = openai_client(web)
    reply = api.completions.create(model=daemon.model, prompt=prompts, max_tokens=4,
                                   temperature=0, echo=True)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, reply.choices, strict=False):
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    singles = [api.completions.create(model=daemon.model, prompt=p, max_tokens=4, temperature=0)
               for p in prompts]
    assert reply.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert reply.usage.completion_tokens == 12
    two_each = api.completions.create(model=daemon.model, prompt=prompts[:2], max_tokens=2,
                                      temperature=1.0, seed=4, n=2)
    assert [c.index for c in two_each.choices] == [0, 1, 2, 3]  # prompt p, choice j: p*n + j


def test_a_prompt_array_streams_by_index(web, daemon):
    stream = openai_client(web).completions.create(
        model=daemon.model, prompt=["Hello", [651, 5866]], max_tokens=3, temperature=0,
        stream=True)
    seen = {}
    for chunk in stream:
        for choice in chunk.choices:
            seen.setdefault(choice.index, "")
            seen[choice.index] += choice.text
    assert set(seen) == {0, 1} and all(seen.values())


@pytest.mark.parametrize("prompt, param", [
    (["a", ""], "prompt[1]"), (["a", []], "prompt[1]"), (["a"] * 9, "prompt"),
    (["a", [-1]], "prompt[1]"), (["a", 5], "prompt"),
])
def test_bad_prompt_arrays_are_400s(web, daemon, prompt, param):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client(web).completions.create(model=daemon.model, prompt=prompt, max_tokens=2)
    assert caught.value.body["param"] == param
