"""The benchmark's engine stand-in (tests/standin_engine.py, ``ENGINE_STANDIN``): chosen only
when the setting names it, it drives the real core at one decode call per tick, one token per
generating stream per tick, with the chat template and tokens a client can read."""

from __future__ import annotations

import pytest
from django.conf import settings

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.state import TokenEvent
from tests.standin_engine import WORDS, RateEngine
from wire.sampling import SamplingParams

STANDIN = "tests.standin_engine:make_engine"


@pytest.fixture
def core():
    core = InferenceCore.from_settings(
        engine_standin=STANDIN, engine_standin_rate=500.0, n_parallel=8, n_ctx=8192,
        cache_prompt=False, prompt_cache_disk_mb=0, max_queue=32, max_queue_per_tenant=32,
        embeddings=False)
    core.start()
    yield core
    core.stop(grace_s=1)


def test_the_real_engine_is_the_default():
    assert settings.ENGINE_STANDIN == ""


def test_the_setting_puts_the_standin_in_the_core(core):
    assert isinstance(core.engine, RateEngine)
    assert core.engine.period_s == pytest.approx(1 / 500)


def test_each_stream_gets_one_token_per_decode_call(core):
    engine = core.engine
    decodes0 = engine.decodes
    handles = [core.submit(messages=[{"role": "user", "content": f"hello {i}"}],
                           params=SamplingParams(max_tokens=12, seed=i)) for i in range(4)]
    replies = [h.result(timeout=30) for h in handles]
    for i, reply in enumerate(replies):
        assert reply.finished.stats.completion_tokens == 12
        assert reply.finished.finish_reason == "length"
        assert reply.text == "".join(WORDS[(i + k) % len(WORDS)] for k in range(1, 13))
    # four streams batched: far fewer decode calls than tokens (one token per stream a tick)
    assert engine.decodes - decodes0 < 4 * 12
    assert engine.rows >= 4 * 12


def test_the_chat_template_wraps_the_messages(core):
    handle = core.submit(messages=[{"role": "user", "content": "abc"}],
                         params=SamplingParams(max_tokens=1))
    events = list(handle.events(timeout=30))
    assert isinstance(events[0], TokenEvent)
    # BOS + "<|user|>abc<|end|>\n<|assistant|>" as bytes
    assert handle.prompt_tokens == 1 + len("<|user|>abc<|end|>\n<|assistant|>")
