"""A continued request's tokens replayed through a new grammar sampler (the real engine).

The replay offers the grammar each token alone, so its cost is that token's, not the
vocabulary's: a request continued after thousands of tokens starts in milliseconds. What is
checked here is that it stays exact: a grammar-valid continuation is accepted and the sampler
goes on from where it was; a token the grammar refuses raises instead of reaching llama.cpp.
"""

from __future__ import annotations

import json

import pytest

from scheduler_daemon.llama.sampler import SamplingFailed
from wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

GRAMMAR = 'root ::= "[" item ("," item)* "]"\nitem ::= [0-9]+'


def test_a_grammar_valid_history_replays_and_sampling_goes_on_within_the_grammar(gemma_engine):
    engine = gemma_engine
    history = engine.tokenize("[1,22,333," + ",".join(str(i) for i in range(400)),
                              add_special=False)
    sampler = engine.new_sampler(SamplingParams(grammar=GRAMMAR, seed=1))
    try:
        sampler.replay(history)
        # the grammar's state follows the history: after "...,399" a "]" ends the list ...
        sampler.replay(engine.tokenize("]", add_special=False))
        # ... and nothing may follow it
        with pytest.raises(SamplingFailed, match="does not follow the grammar"):
            sampler.replay(engine.tokenize(",", add_special=False))
    finally:
        sampler.close()


def test_a_token_the_grammar_refuses_raises_before_llama_cpp_sees_it(gemma_engine):
    engine = gemma_engine
    sampler = engine.new_sampler(SamplingParams(grammar=GRAMMAR, seed=1))
    try:
        good = engine.tokenize("[1,2", add_special=False)
        sampler.replay(good)
        bad = engine.tokenize("x", add_special=False)
        with pytest.raises(SamplingFailed, match="does not follow the grammar"):
            sampler.replay(bad)
    finally:
        sampler.close()


def test_a_json_schema_history_replays(gemma_engine):
    engine = gemma_engine
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]})
    sampler = engine.new_sampler(SamplingParams(json_schema=schema, seed=1))
    try:
        sampler.replay(engine.tokenize('{"a": 12', add_special=False))
        with pytest.raises(SamplingFailed):
            sampler.replay(engine.tokenize('"', add_special=False))  # not after a number's digits
    finally:
        sampler.close()
