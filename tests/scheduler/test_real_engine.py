"""The scheduler core on the real Gemma 3 270M model (llama.cpp on the CPU).

llama.cpp's CPU logits shift slightly with batch shape and KV placement, so these tests
never compare whole generations across different batch compositions: they compare the
same request in the same conditions, and first tokens across batched and solo runs.
"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import TokenEvent
from wire.errors import InvalidParameter, Refusal
from wire.sampling import SamplingParams

from .conftest import model_path

pytestmark = pytest.mark.slow

GREEDY = dict(temperature=0.0)


def run(core, prompt=None, messages=None, **params):
    handle = core.submit(
        prompt=prompt,
        messages=messages,
        params=SamplingParams.from_dict(params),
        cache_prompt=False,
    )
    events = list(handle.events(timeout=120))
    return events, events[-1]


def text_of(events) -> str:
    return "".join(e.text for e in events if isinstance(e, TokenEvent))


def test_seeded_sampled_request_reproduces(core):
    first, done1 = run(
        core, "Write a short poem about rivers.", temperature=0.9, seed=1234, max_tokens=24
    )
    second, done2 = run(
        core, "Write a short poem about rivers.", temperature=0.9, seed=1234, max_tokens=24
    )
    assert text_of(first) == text_of(second)
    assert done1.stats.completion_tokens == done2.stats.completion_tokens > 0
    other, _ = run(
        core, "Write a short poem about rivers.", temperature=0.9, seed=99, max_tokens=24
    )
    assert text_of(other) != text_of(first)  # the seed is what made them equal


PROMPTS = [
    "The capital of France is",
    "One, two, three, four,",
    "Monday, Tuesday, Wednesday,",
    "The opposite of hot is",
]


def test_batched_and_solo_agree_on_the_first_token(core):
    solo = [text_of(run(core, p, max_tokens=1, **GREEDY)[0]) for p in PROMPTS]
    handles = [
        core.submit(prompt=p, params=SamplingParams(max_tokens=1, **GREEDY), cache_prompt=False)
        for p in PROMPTS
    ]
    batched = [h.result(timeout=120).text for h in handles]
    assert batched == solo
    assert all(solo)


def test_stop_string_across_a_token_boundary_never_appears(core):
    events, _ = run(core, "The capital of France is", max_tokens=24, **GREEDY)
    pieces = [e.text for e in events if isinstance(e, TokenEvent) and e.text]
    full = "".join(pieces)
    k = next(i for i in range(len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]  # half in one token, half in the next
    events, done = run(core, "The capital of France is", max_tokens=24, stop=[stop], **GREEDY)
    assert text_of(events) == full[: full.index(stop)]
    assert stop not in text_of(events)
    assert (done.finish_reason, done.stop) == ("stop", stop)


def test_utf8_emoji_and_cjk_come_out_whole(core):
    target = "猫🐱 日本語 ok"
    events, done = run(core, "Say it:", grammar=f'root ::= "{target}"', max_tokens=40, **GREEDY)
    assert text_of(events) == target
    assert not any("\ufffd" in e.text for e in events if isinstance(e, TokenEvent))
    assert done.finish_reason == "stop"


def test_json_schema_constrains_the_output(core):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    events, done = run(
        core, "A JSON object with a number:", json_schema=schema, max_tokens=64, **GREEDY
    )
    value = json.loads(text_of(events))
    assert isinstance(value["n"], int) and done.finish_reason == "stop"


def test_chat_works_with_the_builtin_template(core):
    assert core.chat.kind == "builtin:gemma"  # the 270M file has no template of its own
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Name a color."},
    ]
    rendered = core.chat.render([(m["role"], m["content"]) for m in messages])
    assert rendered.startswith("<start_of_turn>user\n") and rendered.endswith(
        "<start_of_turn>model\n"
    )
    events, done = run(core, messages=messages, max_tokens=16, **GREEDY)
    assert done.stats.prompt_tokens == len(core.engine.tokenize(rendered))
    assert done.stats.completion_tokens > 0 and done.finish_reason in ("stop", "length")


def test_bad_grammar_and_bias_are_refused_naming_the_field(core):
    with pytest.raises(InvalidParameter) as err:
        core.submit(prompt="x", params=SamplingParams(grammar="root ::= (("))
    assert err.value.param == "grammar"
    with pytest.raises(InvalidParameter) as err:
        core.submit(prompt="x", params=SamplingParams(logit_bias=((10**7, 1.0),)))
    assert err.value.param == "logit_bias"
    with pytest.raises(Refusal) as err:
        core.submit(prompt="")
    assert err.value.code == "empty_prompt"
    assert not core.scheduler.has_work()


def test_sampler_state_is_per_request_on_fixed_logits(gemma_engine):
    logits = np.random.default_rng(0).normal(size=gemma_engine.n_vocab).astype(np.float32) * 3
    params = SamplingParams(
        temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7, repeat_penalty=1.3
    )
    alone = gemma_engine.new_sampler(params)
    expected = [alone.sample_logits(logits) for _ in range(20)]
    mine = gemma_engine.new_sampler(params)
    noise = [gemma_engine.new_sampler(SamplingParams(temperature=1.5, seed=s)) for s in range(3)]
    got = []
    for _ in range(20):
        for other in noise:  # other requests draw in between, from the same logits
            other.sample_logits(logits)
        got.append(mine.sample_logits(logits))
    assert got == expected
    assert len(set(expected)) > 1  # it really sampled
    for s in [alone, mine, *noise]:
        s.close()


def test_greedy_bias_picks_around_banned_tokens_and_leaves_the_logits_as_they_were(gemma_engine):
    logits = np.random.default_rng(1).normal(size=gemma_engine.n_vocab).astype(np.float32)
    eog = int(gemma_engine.eog_tokens[0])
    logits[eog] = 50.0  # the top token is an end-of-generation token
    logits[123] = 40.0  # the best one left
    logits[77] = 0.0  # boosted past both by logit_bias
    before = logits.copy()
    banned = gemma_engine.new_sampler(SamplingParams(temperature=0.0, ignore_eos=True))
    assert banned.sample_logits(logits) == 123
    boosted = gemma_engine.new_sampler(
        SamplingParams(temperature=0.0, ignore_eos=True, logit_bias=((77, 100.0),))
    )
    assert boosted.sample_logits(logits) == 77
    frozen = before.copy()
    frozen.flags.writeable = False  # a row it may not touch is copied, same answer
    assert banned.sample_logits(frozen) == 123
    assert np.array_equal(logits, before)  # the bias was applied in place, then undone
    plain = gemma_engine.new_sampler(SamplingParams(temperature=0.0))
    assert plain.sample_logits(logits) == eog
    for s in (banned, boosted, plain):
        s.close()


def test_cancel_mid_prefill_of_a_long_prompt(gemma_engine, monkeypatch):
    decoding = threading.Event()  # set as an abortable (prefill) decode begins
    decode = gemma_engine.decode

    def watched(rows, abortable=False):
        if abortable:
            decoding.set()
        return decode(rows, abortable)

    monkeypatch.setattr(gemma_engine, "decode", watched)
    core = InferenceCore(gemma_engine, SchedulerConfig(chunk_size=1024))
    core.start()
    try:
        prompt = " ".join(f"word{i}" for i in range(600))  # ~2,400 tokens: seconds of prefill
        handle = core.submit(prompt=prompt, params=SamplingParams(max_tokens=8))
        assert decoding.wait(60)  # the first ~1,000-token chunk's decode is under way
        t0 = time.monotonic()
        core.cancel(handle.id)
        done = handle.result(timeout=120).finished
        print(f"cancel took {1000 * (time.monotonic() - t0):.0f} ms")
        assert done.finish_reason == "cancelled" and done.stats.completion_tokens == 0
        assert core.scheduler.counters["aborted_decodes"] >= 1  # stopped inside llama_decode
        slot = core.snapshot()["slots"][0]
        assert slot["state"] == "idle" and slot["kv_tokens"] < handle.prompt_tokens
        after = core.submit(prompt="Hello", params=SamplingParams(max_tokens=4, **GREEDY)).result(
            timeout=60
        )
        assert after.finished.stats.completion_tokens == 4  # the context is still healthy
    finally:
        core.stop(grace_s=0)


def test_tiny_context_kv_pressure_fails_only_the_oversized_request():
    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine

    engine = LlamaEngine(
        EngineConfig(model_path=model_path(), n_ctx=512, n_batch=512, n_seq_max=4, n_threads=2)
    )
    # the block budget is overcommitted on purpose so that the KV cache itself runs out
    core = InferenceCore(engine, SchedulerConfig(kv_budget_tokens=4096, kv_block_tokens=16))
    core.start()
    try:
        filler = " ".join(["river"] * 190)
        small = [
            core.submit(
                prompt=f"Story {i}: once upon a time",
                cache_prompt=False,
                params=SamplingParams(max_tokens=100, ignore_eos=True, **GREEDY),
            )
            for i in range(3)
        ]
        big = core.submit(
            prompt=filler,
            cache_prompt=False,
            params=SamplingParams(max_tokens=300, ignore_eos=True, **GREEDY),
        )
        done = big.result(timeout=300).finished
        assert done.finish_reason == "error" and done.error["code"] == "context_full"
        for handle in small:
            finished = handle.result(timeout=300).finished
            assert finished.finish_reason == "length" and finished.stats.completion_tokens == 100
        assert core.scheduler.counters["kv_pressure"] >= 1
    finally:
        core.stop(grace_s=0)
        engine.close()
