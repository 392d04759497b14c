"""The embeddings context: a second llama.cpp context over the engine's model.

``LlamaEngine.embedder()`` makes it; the engine is not imported here (engine.py imports
this module), so it is typed ``Any``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import llama_cpp as lc
import numpy as np

from ..core.engine_api import DECODE_OK, BatchRow
from .batch import _Batch
from .errors import EngineError


class Embedder:
    """A second llama.cpp context over an engine's model, for embeddings. Made on the
    scheduler's loop thread and decoded there only (one OpenMP team: ``LlamaEngine.decode``'s
    rule).

    This llama.cpp computes the LM head and keeps ``n_vocab`` logits for every output token
    of an embeddings context (1 MB per token for Gemma's 262k vocabulary), and pooled
    embeddings make every token an output. So a decode takes at most ``n_batch`` tokens
    (128: ~134 MB of logits for Gemma), pooling is off, and the mean over an input's tokens
    is ours, summed chunk by chunk: an input longer than one decode goes over several, its
    sequence's cells kept between them (up to ``n_ctx`` tokens per input). It counts the
    cells each sequence holds and refuses a decode that would pass ``n_ctx`` of them or
    skip a position (``ValueError``) before llama.cpp sees it: the caller plans within the
    cells (``embed_batch.py``)."""

    def __init__(self, engine: Any, n_ctx: int, n_batch: int, n_seq_max: int) -> None:
        params = lc.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = engine._n_threads
        params.embeddings = True
        params.pooling_type = lc.LLAMA_POOLING_TYPE_NONE  # the mean is ours (see above)
        params.kv_unified = True  # the open inputs share the n_ctx cells
        params.no_perf = True
        self._engine = engine
        self._ctx = lc.llama_init_from_model(engine._model, params)
        if not self._ctx:
            raise EngineError("llama.cpp could not create the embeddings context")
        self._mem = lc.llama_get_memory(self._ctx)
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_batch = min(lc.llama_n_batch(self._ctx), lc.llama_n_ubatch(self._ctx), self.n_ctx)
        self.n_seq_max = lc.llama_n_seq_max(self._ctx)
        self.n_embd = int(lc.llama_model_n_embd(engine._model))
        self._batch = _Batch(self.n_batch)
        self._positions = np.arange(self.n_ctx, dtype=np.int32)
        self._cells: dict[int, int] = {}  # seq id -> cells it holds (its next position)

    def decode(self, pieces: Sequence[tuple[int, Sequence[int], int]]) -> list[np.ndarray]:
        """One decode of ``pieces`` (seq id, tokens, first position; at most ``n_batch``
        tokens in all, positions within ``n_ctx``): each piece's sum of its tokens'
        embeddings (float64), in order."""
        n = sum(len(tokens) for _, tokens, _ in pieces)
        if not 0 < n <= self.n_batch or any(
                not 0 <= seq < self.n_seq_max or pos0 + len(tokens) > self.n_ctx or not tokens
                for seq, tokens, pos0 in pieces):
            raise ValueError("the pieces do not fit one embeddings decode")
        if any(pos0 != self._cells.get(seq, 0) for seq, _, pos0 in pieces):
            raise ValueError("an embeddings piece does not follow its sequence's cells")
        if self.cells_used + n > self.n_ctx:
            raise ValueError(f"an embeddings decode of {n} tokens over {self.cells_used} "
                             f"cells held would pass the context's {self.n_ctx}")
        rows = [BatchRow(seq_id=seq, tokens=list(tokens), pos0=pos0, logits=True)
                for seq, tokens, pos0 in pieces]
        self._batch.fill(rows, self._positions)
        self._batch.logits[:n] = 1  # every token's embedding is summed
        self._engine._check_compute_thread()
        rc = int(lc.llama_decode(self._ctx, self._batch.struct))
        if rc != DECODE_OK:
            raise EngineError(f"llama_decode of an embeddings batch returned {rc}")
        for seq, tokens, pos0 in pieces:
            self._cells[seq] = pos0 + len(tokens)
        ptr = lc.llama_get_embeddings(self._ctx)
        if not ptr:
            raise EngineError("llama.cpp gave no embeddings")
        rows_out = np.ctypeslib.as_array(ptr, shape=(n, self.n_embd))
        sums, offset = [], 0
        for _, tokens, _ in pieces:
            sums.append(rows_out[offset:offset + len(tokens)].sum(axis=0, dtype=np.float64))
            offset += len(tokens)
        return sums

    @property
    def cells_used(self) -> int:
        """Cells the sequences hold, all together."""
        return sum(self._cells.values())

    def forget(self, seq_id: int) -> None:
        """Drop an input's cells (finished, or its job ended)."""
        lc.llama_memory_seq_rm(self._mem, seq_id, -1, -1)
        self._cells.pop(seq_id, None)

    def clear(self) -> None:
        lc.llama_memory_clear(self._mem, True)
        self._cells.clear()

    def close(self) -> None:
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
