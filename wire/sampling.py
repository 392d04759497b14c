"""Per-request sampling parameters: defaults, types and ranges.

``SamplingParams.from_dict`` is the one place request fields are checked; a bad value
raises ``InvalidParameter`` naming the field. Building the llama.cpp sampler chain from
these parameters is the engine's job (``engine.LlamaEngine.new_sampler``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidParameter

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_LOGIT_BIAS_ENTRIES = 1024


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops. Defaults follow llama-server."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None
    json_schema: str | None = None  # canonical JSON text; the engine turns it into GBNF
    max_tokens: int | None = None  # None: the scheduler's default
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # log probabilities of the chosen tokens, with this many most likely alternatives each
    # (0: the chosen token's alone); None: none computed (the hot path pays nothing)
    logprobs: int | None = None

    @property
    def is_greedy(self) -> bool:
        """Temperature 0: always the most likely token (after biases and penalties)."""
        return self.temperature <= 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @classmethod
    def from_dict(cls, body: Mapping[str, Any]) -> SamplingParams:
        """Read the sampling fields of a request body; unknown keys are left to the caller."""
        values: dict[str, Any] = {}
        for name, check in _CHECKS.items():
            if name in body and body[name] is not None:
                values[name] = check(name, body[name])
        return cls(**values)


FIELD_NAMES = frozenset(f.name for f in fields(SamplingParams))


def _number(name: str, value: Any, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidParameter(name, "must be a number")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise InvalidParameter(name, f"must be between {lo} and {hi}")
    return float(value)


def _integer(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidParameter(name, "must be an integer")
    if not lo <= value <= hi:
        raise InvalidParameter(name, f"must be between {lo} and {hi}")
    return value


def require_text(name: str, value: str) -> str:
    """``value`` when it is valid Unicode text, else InvalidParameter naming ``name``.

    JSON can carry lone surrogates (``"\\ud800"``): Python keeps them in a ``str``, but
    they have no UTF-8 form, so anything that encodes the text (the tokenizer, llama.cpp,
    the database) would fail on them. Every client text is checked here (or by
    ``chat._content_text``) before it goes anywhere.
    """
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidParameter(
                name, f"is not valid Unicode text (a lone surrogate at character {exc.start})"
            ) from None
    return value


def _stop(name: str, value: Any) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise InvalidParameter(name, "must be a string or a list of strings")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidParameter(name, f"at most {MAX_STOP_STRINGS} stop strings")
    if any(not s or len(s) > MAX_STOP_CHARS for s in items):
        raise InvalidParameter(name, f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(require_text(name, s) for s in items)


def _logit_bias(name: str, value: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise InvalidParameter(name, "must be an object mapping token ids to biases")
    if len(value) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidParameter(name, f"at most {MAX_LOGIT_BIAS_ENTRIES} entries")
    out = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidParameter(name, f"key {key!r} is not a token id") from None
        if token < 0:
            raise InvalidParameter(name, f"token id {token} is negative")
        out.append((token, _number(name, bias, -100.0, 100.0)))
    return tuple(sorted(out))


def _grammar(name: str, value: Any) -> str:
    from .grammar_check import check_grammar  # bounds llama.cpp's parser can survive

    return check_grammar(value, name)


def _json_schema(name: str, value: Any) -> str:
    from .schema_check import MAX_SCHEMA_BYTES, check_json_schema

    if isinstance(value, str):
        if len(value) > MAX_SCHEMA_BYTES:
            raise InvalidParameter(name, f"longer than {MAX_SCHEMA_BYTES} bytes")
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidParameter(name, "is not valid JSON") from None
    if not isinstance(value, dict):
        raise InvalidParameter(name, "must be a JSON object (a JSON Schema)")
    return check_json_schema(value, name)


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise InvalidParameter(name, "must be true or false")
    return value


# The numeric fields' ranges (inclusive): checked here, published in the OpenAPI schema.
RANGES: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 5.0),
    "top_k": (0, 1_000_000),
    "top_p": (0.0, 1.0),
    "min_p": (0.0, 1.0),
    "repeat_penalty": (0.01, 10.0),
    "frequency_penalty": (-2.0, 2.0),
    "presence_penalty": (-2.0, 2.0),
    "penalty_last_n": (0, 8192),
    "seed": (0, 2**32 - 2),
    "max_tokens": (1, 1_000_000),
    "logprobs": (0, 20),  # alternatives per token (OpenAI's top_logprobs: 0-20)
}


def _ranged(name: str, value: Any) -> float | int:
    lo, hi = RANGES[name]
    if isinstance(lo, int):
        return _integer(name, value, lo, int(hi))
    return _number(name, value, lo, hi)


_CHECKS: dict[str, Any] = {
    **{name: _ranged for name in RANGES},
    "logit_bias": _logit_bias,
    "grammar": _grammar,
    "json_schema": _json_schema,
    "stop": _stop,
    "ignore_eos": _bool,
}
assert set(_CHECKS) == FIELD_NAMES, "every sampling field has exactly one check"
