"""n > 1 (#16) in the core, on the real engine (Gemma): one request, n choices, each its
own sampler (seed + index), the prompt prefilled once (the choices after the first copy
its cells), one end for the request with each choice's."""
from __future__ import annotations

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import FinishedEvent, TokenEvent
from wire.errors import InvalidParameter
from wire.sampling import SamplingParams

PROMPT = ("Write a short story about a lighthouse keeper who finds a message in a bottle. "
          "It begins on a stormy night in November.")


def choices(core, n, cache_prompt=True, **params):
    handle = core.submit(prompt=PROMPT, n=n, cache_prompt=cache_prompt,
                         params=SamplingParams.from_dict({"max_tokens": 12, **params}))
    events = list(handle.events(timeout=120))
    texts = {i: "" for i in range(n)}
    for event in events:
        if isinstance(event, TokenEvent):
            texts[event.index] += event.text
    return handle, texts, events


def test_three_choices_one_prompt_prefill_and_one_end(core):
    handle, texts, events = choices(core, 3, temperature=1.0, seed=7, ignore_eos=True)
    ends = [e for e in events if isinstance(e, FinishedEvent)]
    assert len(ends) == 1 and ends[0] is events[-1] and ends[0].request_id == handle.id
    end = ends[0]
    assert [c.index for c in end.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in end.choices)
    assert end.stats.prompt_tokens == handle.prompt_tokens  # the prompt counted once
    assert end.stats.completion_tokens == 36
    # prefilled once: the two others computed their last prompt token alone
    assert end.stats.prompt_evaluated <= handle.prompt_tokens + 2 * 2
    assert all(texts[i] for i in range(3)) and len(set(texts.values())) > 1


def test_each_choice_has_its_own_sampler_seeded_seed_plus_index(core):
    """(Whole generations are not compared across runs: the choices' rows share batches in
    an order that can change, and CPU logits shift with batch shape.)"""
    handle = core.submit(prompt=PROMPT, n=3, params=SamplingParams.from_dict(
        {"max_tokens": 400, "ignore_eos": True, "temperature": 1.0, "seed": 2**32 - 3}))
    with core.scheduler.lock:
        requests = {r: core.scheduler._requests[f"{handle.id}#{r}"] for r in range(3)}
        seeds = [requests[r].params.seed for r in range(3)]
        samplers = {id(requests[r].sampler) for r in range(3)}
    assert seeds == [2**32 - 3, 2**32 - 2, 0] and len(samplers) == 3  # wraps in range
    core.cancel(handle.id)
    list(handle.events(timeout=120))


def test_cancelling_the_request_cancels_every_choice(core):
    handle = core.submit(prompt=PROMPT, n=3, params=SamplingParams.from_dict(
        {"max_tokens": 400, "ignore_eos": True, "temperature": 0}))
    stream = handle.events(timeout=120)
    next(e for e in stream if isinstance(e, TokenEvent))
    assert core.cancel(handle.id)
    end = [e for e in stream if isinstance(e, FinishedEvent)][-1]
    assert end.finish_reason == "cancelled"
    assert all(c.finish_reason == "cancelled" for c in end.choices)
    assert not core.scheduler.request_ids()


def test_n_out_of_range_is_refused_naming_it(core):
    for bad in (0, 9, 2.0, True):
        with pytest.raises(InvalidParameter) as caught:
            core.submit(prompt="x", n=bad)
        assert caught.value.param == "n"


def test_a_stopping_core_hands_a_request_of_several_choices_back_whole(gemma_engine):
    """Its choices all waiting (the loop not started): one id comes back, the request's."""
    core = InferenceCore(gemma_engine, SchedulerConfig(chunk_size=512, max_queue=16))
    handle = core.submit(prompt=PROMPT, n=3, params=SamplingParams.from_dict({"max_tokens": 4}))
    assert core.stop(grace_s=0, hand_back=True) == [handle.id]
    assert not core.scheduler.request_ids()
