"""A request's sampler, and the log probabilities of a logits row.

``LlamaEngine.new_sampler()`` makes a sampler; the engine is not imported here (engine.py
imports this module), so it is typed ``Any``."""

from __future__ import annotations

import ctypes
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import llama_cpp as lc
import numpy as np

from wire.errors import InvalidParameter
from wire.sampling import SamplingParams

from ..core.engine_api import GrammarEnded, RowFailed
from .errors import EngineError

# One token's grammar work beyond this much CPU time fails that request alone. CPU time of
# the scheduler thread, not wall time: on a loaded machine (other processes on its cores)
# a cheap grammar's step can take over a second of wall time without being its fault.
MAX_GRAMMAR_STEP_S = 1.0

# llama_token_data, as numpy lays it out: a candidates array (the engine keeps one the
# vocabulary's size for its samplers)
_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class SamplingFailed(EngineError, RowFailed):
    """This request's sampler could not pick a token (its grammar allows none): the
    request's own fault, answered as ``invalid_request_error`` naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        RowFailed.__init__(self, message, "invalid_request_error" if param else "engine_error",
                           param)


class LlamaSampler:
    """A request's own sampler chain (its RNG, penalties and grammar belong to it alone).

    Greedy requests without penalties or grammar take a numpy argmax over the logits row:
    ``llama_sampler_sample`` copies all 262k candidates per token, argmax does not.

    With a grammar the chain is cut in two: the constraints (penalties, grammar), then a
    check in numpy that the grammar left a token to pick, then the pick (bias, top-k...,
    dist). llama.cpp aborts the process when a grammar is made to accept a token it did not
    allow (an end-of-generation token while rules are open, any token once it is complete),
    so a token is only ever picked among those the grammar left finite.
    """

    def __init__(self, engine: Any, params: SamplingParams) -> None:
        self._engine = engine
        self._chain = None
        self._constraints = None
        self._grammar_field = "grammar"
        self.seed = params.seed if params.seed is not None else random.getrandbits(32) % (2**32 - 1)
        bias = dict(params.logit_bias)
        for token in bias:
            if token >= engine.n_vocab:
                raise InvalidParameter("logit_bias", f"token id {token} is outside the vocabulary")
        self._ignore_eos = params.ignore_eos
        if params.ignore_eos:
            bias.update((int(t), float("-inf")) for t in engine.eog_tokens)
        self._bias_ids = np.array(list(bias), np.int64)
        self._bias_values = np.array(list(bias.values()), np.float32)
        grammar = engine.grammar_for(params)
        if params.is_greedy and not params.uses_penalties and grammar is None:
            return
        try:
            if grammar is not None:
                self._constraints = _new_chain()
                self._build_constraints(params, grammar)
                self._chain = _new_chain()
                self._build_pick(params, bias)
            else:
                self._chain = _new_chain()
                self._add(self._chain, _bias_sampler(engine.n_vocab, bias))
                self._add(self._chain, _penalties_sampler(engine.n_vocab, params))
                self._build_pick(params, {})
        except Exception:
            self.close()
            raise

    @staticmethod
    def _add(chain: object, sampler: object) -> None:
        if sampler is not None:
            lc.llama_sampler_chain_add(chain, sampler)

    def _build_constraints(self, params: SamplingParams, grammar: tuple[str, str]) -> None:
        self._add(self._constraints, _penalties_sampler(self._engine.n_vocab, params))
        field, gbnf = grammar
        self._grammar_field = field
        try:
            data = gbnf.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidParameter(field, "is not valid UTF-8 text") from None
        sampler = lc.llama_sampler_init_grammar(self._engine._vocab, data, b"root")
        if not sampler:
            raise InvalidParameter(field, "the grammar could not be parsed")
        self._add(self._constraints, sampler)

    def _build_pick(self, params: SamplingParams, bias: dict[int, float]) -> None:
        self._add(self._chain, _bias_sampler(self._engine.n_vocab, bias))
        if params.is_greedy:
            self._add(self._chain, lc.llama_sampler_init_greedy())
            return
        self._add(self._chain, lc.llama_sampler_init_top_k(params.top_k))
        self._add(self._chain, lc.llama_sampler_init_top_p(params.top_p, 1))
        self._add(self._chain, lc.llama_sampler_init_min_p(params.min_p, 1))
        self._add(self._chain, lc.llama_sampler_init_temp(params.temperature))
        self._add(self._chain, lc.llama_sampler_init_dist(self.seed))

    def sample(self, batch_index: int) -> int:
        """Pick the next token from the last decode's logits at ``batch_index``."""
        return self.sample_logits(self._engine.logits_row(batch_index))

    def sample_logits(self, logits: np.ndarray) -> int:
        """Pick a token from a logits vector and advance this sampler's state.

        Raises ``GrammarEnded`` (the grammar is complete) or ``SamplingFailed``."""
        if self._chain is None:
            if not self._bias_ids.size:
                return int(np.argmax(logits))
            if not logits.flags.writeable:
                logits = logits.copy()
            # bias the few entries in place and put them back: copying the row (1 MB at
            # 262k tokens) cost more than the argmax (ignore_eos biases every EOG token)
            kept = logits[self._bias_ids]
            logits[self._bias_ids] = kept + self._bias_values
            try:
                return int(np.argmax(logits))
            finally:
                logits[self._bias_ids] = kept
        cand = self._engine._candidates
        arr = self._candidate_array(cand, logits)
        allowed = None
        if self._constraints is not None:
            t0 = time.thread_time()
            lc.llama_sampler_apply(self._constraints, ctypes.byref(arr))
            if time.thread_time() - t0 > MAX_GRAMMAR_STEP_S:
                # an ambiguous grammar can double llama.cpp's parse stacks with every
                # character (no static check sees it): it must not stall every other row
                raise SamplingFailed(
                    f"{self._grammar_field}: the grammar became too costly to follow (more "
                    f"than {MAX_GRAMMAR_STEP_S} s for one token); make it less ambiguous",
                    self._grammar_field,
                )
            allowed = self._allowed(cand)
        lc.llama_sampler_apply(self._chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise SamplingFailed("the sampler selected no token")
        token = int(arr.data[arr.selected].id)
        if allowed is not None:
            if not 0 <= token < allowed.size or not allowed[token]:
                raise SamplingFailed("the sampler picked a token the grammar does not allow")
            lc.llama_sampler_accept(self._constraints, token)
        lc.llama_sampler_accept(self._chain, token)
        return token

    def _candidate_array(self, cand: np.ndarray, logits: np.ndarray | float) -> object:
        """``cand`` filled with every token id and ``logits``, as llama.cpp's array view."""
        cand["id"] = self._engine._candidate_ids
        cand["logit"] = logits
        cand["p"] = 0.0
        return lc.llama_token_data_array(
            data=cand.ctypes.data_as(lc.llama_token_data_p),
            size=cand.size,
            selected=-1,
            sorted=False,
        )

    def replay(self, tokens: Sequence[int]) -> None:
        """Advance this sampler over tokens generated before (a request continued after its
        daemon died): its grammar and penalties see them as if they were sampled here.
        Each is checked against the grammar first (llama.cpp aborts the process on a token
        the grammar does not allow); a disallowed one raises ``SamplingFailed``. The check
        offers the grammar that one token alone (not the vocabulary: a continued request of
        thousands of tokens replays in milliseconds, not minutes). Runs on the preparer
        thread: its candidates array is its own, not the engine's."""
        if self._chain is None:
            return
        one = np.zeros(1, _TOKEN_DATA)
        for token in tokens:
            if not 0 <= token < self._engine.n_vocab:
                raise SamplingFailed(f"replayed token {token} is outside the vocabulary")
            if self._constraints is not None:
                one["id"], one["logit"], one["p"] = token, 0.0, 0.0
                arr = lc.llama_token_data_array(
                    data=one.ctypes.data_as(lc.llama_token_data_p), size=1, selected=-1,
                    sorted=False)
                lc.llama_sampler_apply(self._constraints, ctypes.byref(arr))
                if not np.isfinite(one["logit"][0]):
                    raise SamplingFailed("a replayed token does not follow the grammar")
                lc.llama_sampler_accept(self._constraints, token)
            lc.llama_sampler_accept(self._chain, token)

    def _allowed(self, cand: np.ndarray) -> np.ndarray:
        """After the constraints (candidates still in token id order): which tokens the
        grammar allows. Some token must be left, and not only an end-of-generation token
        that ``ignore_eos`` forbids (then the grammar is complete: ``GrammarEnded``)."""
        allowed = np.isfinite(cand["logit"])
        if not allowed.any():
            raise SamplingFailed(
                f"{self._grammar_field}: the grammar allows no token after what was generated",
                self._grammar_field,
            )
        if self._ignore_eos:
            others = allowed.copy()
            others[self._engine.eog_tokens] = False
            if not others.any():
                raise GrammarEnded()
        return allowed

    def close(self) -> None:
        """Free the C sampler chains (idempotent)."""
        for name in ("_chain", "_constraints"):
            chain = getattr(self, name)
            if chain is not None:
                lc.llama_sampler_free(chain)
                setattr(self, name, None)


def logprobs_of(row: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """log softmax of a logits row at ``token``, and the ``top`` largest entries' (token id,
    log probability), most likely first (ties: lower id first)."""
    peak = float(row.max())
    total = float(np.exp(row - peak).sum(dtype=np.float64))
    norm = peak + math.log(total)
    chosen = _finite_logprob(float(row[token]) - norm)
    if top <= 0:
        return chosen, []
    k = min(top, row.size)
    idx = _top_candidates(row, peak, k)
    idx = idx[np.lexsort((idx, -row[idx]))][:k]
    return chosen, [(int(i), _finite_logprob(float(row[i]) - norm)) for i in idx]


def _top_candidates(row: np.ndarray, peak: float, k: int) -> np.ndarray:
    """Every index whose logit is within a widening gap of the peak, once at least ``k``
    are (exact: all ties at the edge come along). A comparison pass is ~0.1 ms over 262k
    logits where ``np.argpartition`` took ~3-4 ms; a NaN row falls back to it."""
    if not math.isfinite(peak):
        return np.argpartition(row, row.size - k)[row.size - k:]
    gap = 1.0
    while True:
        found = np.flatnonzero(row >= peak - gap)
        if found.size >= k or gap == math.inf:
            return found
        gap = gap * 4 if gap < 1e30 else math.inf


def _finite_logprob(value: float) -> float:
    """JSON has no -Infinity: an impossible token's log probability reads -9999 (and a NaN
    from a broken row the same), as other OpenAI-compatible servers write it."""
    return value if math.isfinite(value) else -9999.0


def _new_chain() -> object:
    return lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())


def _bias_sampler(n_vocab: int, bias: dict[int, float]) -> object | None:
    if not bias:
        return None
    entries = (lc.llama_logit_bias * len(bias))(
        *(lc.llama_logit_bias(token=t, bias=b) for t, b in bias.items())
    )
    return lc.llama_sampler_init_logit_bias(n_vocab, len(bias), entries)


def _penalties_sampler(n_vocab: int, params: SamplingParams) -> object | None:
    if not params.uses_penalties:
        return None
    return lc.llama_sampler_init_penalties(
        n_vocab,
        params.penalty_last_n,
        params.repeat_penalty,
        params.frequency_penalty,
        params.presence_penalty,
    )
