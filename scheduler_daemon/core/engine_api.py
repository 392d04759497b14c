"""The shapes shared by the engine and the scheduler, without importing llama_cpp."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# llama_decode's own return codes, named.
DECODE_OK = 0
DECODE_KV_FULL = 1  # no room in the KV cache for this batch: nothing was computed
DECODE_ABORTED = 2  # the abort callback stopped it: finished micro-batches stay in the KV cache


@dataclass(slots=True)
class BatchRow:
    """Tokens of one sequence in one decode call; logits only for its last token if asked."""

    seq_id: int
    tokens: Sequence[int]
    pos0: int
    logits: bool


class GrammarEnded(Exception):
    """A request's grammar allows nothing more than end-of-generation (which ``ignore_eos``
    forbids): the request is complete and ends with ``stop``."""


class RowFailed(Exception):
    """Something tied to one request failed (its sampler picked no token...): that
    request ends with an error, alone; the batch and the loop carry on. ``code`` and
    ``param`` are what its client is told (``invalid_request_error`` when the request itself
    is at fault, e.g. a grammar that allows no token)."""

    def __init__(self, message: str, code: str = "engine_error", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


def normalized(total: np.ndarray, count: int) -> np.ndarray:
    """The mean of ``count`` summed embeddings, L2-normalized, as float32; ``ValueError``
    if it is not finite (a broken row must not reach a client as NaN)."""
    mean = total / max(count, 1)
    norm = float(np.linalg.norm(mean))
    if not math.isfinite(norm) or not np.isfinite(mean).all():
        raise ValueError("the embedding is not finite")
    return (mean / norm if norm > 0 else mean).astype(np.float32)
