"""A ``llama_batch`` over numpy buffers, shared by the generation and embeddings contexts."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import llama_cpp as lc
import numpy as np

from ..core.engine_api import BatchRow


class _Batch:
    """A llama_batch whose arrays are numpy buffers we own, filled by slices each tick."""

    def __init__(self, capacity: int) -> None:
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        int_p = ctypes.POINTER(ctypes.c_int32)
        self._seq_ptrs = (int_p * capacity)(
            *(ctypes.cast(self.seq.ctypes.data + 4 * i, int_p) for i in range(capacity))
        )
        self.struct = lc.llama_batch(
            n_tokens=0,
            token=self.token.ctypes.data_as(int_p),
            embd=None,
            pos=self.pos.ctypes.data_as(int_p),
            n_seq_id=self.n_seq_id.ctypes.data_as(int_p),
            seq_id=ctypes.cast(self._seq_ptrs, ctypes.POINTER(int_p)),
            logits=self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8)),
        )

    def fill(self, rows: Sequence[BatchRow], positions: np.ndarray) -> int:
        n = 0
        for row in rows:
            k = len(row.tokens)
            end = n + k
            self.token[n:end] = row.tokens
            self.pos[n:end] = positions[row.pos0 : row.pos0 + k]
            self.seq[n:end] = row.seq_id
            self.logits[n:end] = 0
            if row.logits:
                self.logits[end - 1] = 1
            n = end
        self.struct.n_tokens = n
        return n
