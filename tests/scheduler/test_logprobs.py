"""Log probabilities (#16): computed from the model's logits before sampling, for requests
that ask only. The math against a float64 reference, then the real engine (Gemma)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from scheduler_daemon.core.state import TokenEvent
from scheduler_daemon.llama.sampler import logprobs_of
from wire.errors import InvalidParameter
from wire.sampling import SamplingParams


def reference(row: np.ndarray) -> np.ndarray:
    wide = row.astype(np.float64)
    return wide - (wide.max() + np.log(np.exp(wide - wide.max()).sum()))


def test_logprobs_match_a_float64_log_softmax_and_the_top_come_sorted():
    rng = np.random.default_rng(7)
    row = (rng.standard_normal(262_144) * 4).astype(np.float32)
    row[5] = row[9] = row.max() + 1  # a tie at the top: the lower id first
    expected = reference(row)
    chosen, top = logprobs_of(row, 123, 6)
    assert chosen == pytest.approx(expected[123], abs=1e-4)
    assert [t for t, _ in top[:2]] == [5, 9]
    assert [t for t, _ in top] == sorted(range(row.size), key=lambda i: (-row[i], i))[:6]
    for token, logprob in top:
        assert logprob == pytest.approx(expected[token], abs=1e-4) and logprob <= 0
    assert logprobs_of(row, 123, 0) == (chosen, [])


def test_an_impossible_token_reads_minus_9999_not_infinity():
    row = np.array([0.0, -np.inf, 1.0], np.float32)
    chosen, top = logprobs_of(row, 1, 3)
    assert chosen == -9999.0 and top[-1] == (1, -9999.0)
    assert all(math.isfinite(lp) for _, lp in top)


def test_the_range_is_checked_on_the_wire():
    assert SamplingParams.from_dict({"logprobs": 20}).logprobs == 20
    for bad in (21, -1, True, 2.0):
        with pytest.raises(InvalidParameter):
            SamplingParams.from_dict({"logprobs": bad})


def run(core, **params):
    handle = core.submit(prompt="The capital of France is", cache_prompt=False,
                         params=SamplingParams.from_dict({"max_tokens": 8, **params}))
    return [e for e in handle.events(timeout=120) if isinstance(e, TokenEvent)]


def test_greedy_tokens_carry_their_logprobs_and_are_the_most_likely(core, gemma_engine):
    events = run(core, temperature=0, logprobs=5)
    entries = [entry for e in events for entry in e.logprobs]
    ids = [t for e in events for t in e.tokens]
    assert len(entries) == len(ids) == 8  # one per generated token, in order
    for token, entry in zip(ids, entries, strict=False):
        assert bytes.fromhex(entry["b"]) == gemma_engine.logprob_piece(token)
        assert len(entry["top"]) == 5
        assert entry["top"][0][0] == entry["b"]  # greedy: the chosen one is the most likely
        assert entry["lp"] == pytest.approx(entry["top"][0][1])
        lps = [lp for _, lp in entry["top"]]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert sum(math.exp(lp) for lp in lps) <= 1 + 1e-5


def test_sampled_tokens_get_the_models_logprob_not_the_samplers(core):
    """At temperature 1.5 with top_k 1000 the chosen token is often not the top one; its
    logprob is still the model's (raw logits), which is at most the top one's."""
    entries = [x for e in run(core, temperature=1.5, top_k=1000, seed=3, logprobs=1)
               for x in e.logprobs]
    assert len(entries) == 8
    assert all(x["lp"] <= x["top"][0][1] + 1e-6 for x in entries)


def test_a_request_that_asks_none_gets_none(core):
    assert all(e.logprobs == () for e in run(core, temperature=0))


def test_coalesced_token_events_keep_every_tokens_logprobs_in_order():
    """A slow writer merges a request's consecutive token events: their logprobs entries are
    concatenated like their ids (and none appear for a request that asked none)."""
    from scheduler_daemon.service.event_writer import Outgoing, coalesce
    from wire import protocol

    def token(rid, text, entries=None):
        data = {"text": text, "n_tokens": 1, "ids": [len(text)]}
        if entries is not None:
            data["logprobs"] = entries
        return Outgoing(rid, protocol.TOKEN, data)

    a1, a2 = {"b": "41", "lp": -0.1, "top": []}, {"b": "42", "lp": -0.2, "top": []}
    merged = coalesce([token("a", "A", [a1]), token("b", "x"), token("a", "B", [a2]),
                       token("b", "y")])
    assert [m.data["text"] for m in merged] == ["AB", "xy"]
    assert merged[0].data["logprobs"] == [a1, a2]
    assert "logprobs" not in merged[1].data
