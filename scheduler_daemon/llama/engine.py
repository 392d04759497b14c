"""The one door to llama.cpp: model, context, batches, KV memory, samplers, tokens.

Only this module imports ``llama_cpp`` (the low-level ctypes API of llama-cpp-python
0.3.36). Everything above it (``scheduler.py``) talks to an object with this class's
public methods, so the policy is tested with a fake engine and no model.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp as lc
import numpy as np
from llama_cpp.llama_grammar import json_schema_to_gbnf

from wire.errors import InvalidParameter
from wire.grammar_check import check_grammar
from wire.sampling import SamplingParams
from wire.schema_check import check_json_schema

from ..core.engine_api import (
    DECODE_ABORTED,
    DECODE_KV_FULL,
    DECODE_OK,
    BatchRow,
    GrammarEnded,
    RowFailed,
)

log = logging.getLogger(__name__)
llama_log = logging.getLogger("llama_cpp")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line.
# llama.cpp's "info" is a model-loading dump: it goes to DEBUG here.
_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,
    3: logging.WARNING,
    4: logging.ERROR,
}


MAX_LOG_LINE_CHARS = 500
# One token's grammar work beyond this much CPU time fails that request alone. CPU time of
# the scheduler thread, not wall time: on a loaded machine (other processes on its cores)
# a cheap grammar's step can take over a second of wall time without being its fault.
MAX_GRAMMAR_STEP_S = 1.0


class _LlamaLogSink:
    """Collects llama.cpp's log fragments into lines for Python logging."""

    def __init__(self) -> None:
        self.level = logging.DEBUG
        self.pending = ""

    def __call__(self, level: int, text: bytes, _user_data: object) -> None:
        if level != 5:
            self.level = _LEVELS.get(level, logging.INFO)
        self.pending += text.decode("utf-8", errors="replace")
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if line.strip() and llama_log.isEnabledFor(self.level):
                # repr: a line may quote client text (a grammar): escaped and quoted, it can
                # never pass for another log line (a forged request_end JSON line)
                llama_log.log(self.level, "%r", line[:MAX_LOG_LINE_CHARS])


# Module globals on purpose: C keeps this pointer for the life of the process, and a
# collected ctypes callback crashes it.
_LOG_SINK = _LlamaLogSink()
_LOG_CALLBACK = lc.llama_log_callback(_LOG_SINK)


def route_llama_logs() -> None:
    """Send llama.cpp's stderr chatter through the ``llama_cpp`` Python logger."""
    lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))


class EngineError(RuntimeError):
    """The model or context could not be created, or llama.cpp failed hard."""


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What the engine needs to load a model and size its context."""

    model_path: str
    n_ctx: int = 8192
    n_batch: int = 2048
    n_seq_max: int = 4
    n_threads: int = 2
    n_ubatch: int = 512


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


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

    def __init__(self, engine: LlamaEngine, n_ctx: int, n_batch: int, n_seq_max: int) -> None:
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


class LlamaEngine:
    """One model and one context with ``n_seq_max`` sequences over a unified KV buffer."""

    def __init__(self, config: EngineConfig) -> None:
        path = Path(config.model_path)
        if not path.is_file():
            raise EngineError(f"model file not found: {path}")
        route_llama_logs()
        lc.llama_backend_init()
        log.info("loading model %s (%.0f MB)", path, path.stat().st_size / 2**20)
        self._model = lc.llama_model_load_from_file(
            str(path).encode(), lc.llama_model_default_params()
        )
        if not self._model:
            raise EngineError(f"llama.cpp could not load {path}")
        self._ctx = lc.llama_init_from_model(self._model, self._context_params(config))
        if not self._ctx:
            lc.llama_model_free(self._model)
            raise EngineError("llama.cpp could not create a context (n_ctx too large for memory?)")
        self._mem = lc.llama_get_memory(self._ctx)
        self._vocab = lc.llama_model_get_vocab(self._model)
        self.model_path = str(path)
        self.n_vocab = lc.llama_vocab_n_tokens(self._vocab)
        self.n_ctx = lc.llama_n_ctx(self._ctx)
        self.n_batch = lc.llama_n_batch(self._ctx)
        self.n_seq_max = lc.llama_n_seq_max(self._ctx)
        self.n_swa = max(0, int(lc.llama_model_n_swa(self._model)))  # sliding window; 0: none
        self.architecture = self._meta("general.architecture") or "unknown"
        self._batch = _Batch(self.n_batch)
        self._positions = np.arange(self.n_ctx + self.n_batch, dtype=np.int32)
        self._candidates = np.zeros(self.n_vocab, _TOKEN_DATA)
        self._candidate_ids = np.arange(self.n_vocab, dtype=np.int32)
        self._pieces: dict[int, bytes] = {}
        self._logit_views: dict[int, np.ndarray] = {}  # logits_row(): address -> view
        self.eog_tokens = np.array(
            [t for t in range(self.n_vocab) if lc.llama_vocab_is_eog(self._vocab, t)], np.int32
        )
        self.abort_requested = False
        self._abort_callback = lc.ggml_abort_callback(lambda _data: self.abort_requested)
        self._abort_installed = False
        self._n_threads = config.n_threads
        self._compute_thread: threading.Thread | None = None  # see decode(): the team's master
        self.kv_bytes_per_token = self._measure_kv_bytes_per_token()
        log.info(
            "model ready: arch=%s vocab=%d n_ctx=%d n_batch=%d n_seq_max=%d",
            self.architecture,
            self.n_vocab,
            self.n_ctx,
            self.n_batch,
            self.n_seq_max,
        )

    @staticmethod
    def _context_params(config: EngineConfig) -> lc.llama_context_params:
        params = lc.llama_context_default_params()
        params.n_ctx = config.n_ctx
        params.n_batch = config.n_batch
        params.n_ubatch = min(config.n_ubatch, config.n_batch)
        params.n_seq_max = config.n_seq_max
        params.n_threads = config.n_threads
        params.n_threads_batch = config.n_threads
        params.kv_unified = True  # one KV buffer: sequences share cells, seq_cp is metadata only
        params.swa_full = True  # Gemma 3's sliding window would otherwise forget reusable prefixes
        params.no_perf = True
        return params

    def embedder(self, n_ctx: int = 2048, n_batch: int = 128, n_seq_max: int = 16) -> Embedder:
        """The embeddings context, made on first use (on the calling thread: the loop's)."""
        if getattr(self, "_embedder", None) is None:
            self._embedder = Embedder(self, min(n_ctx, self.n_ctx), n_batch, n_seq_max)
            log.info("embeddings context ready: n_ctx=%d n_batch=%d n_seq_max=%d n_embd=%d",
                     self._embedder.n_ctx, self._embedder.n_batch, self._embedder.n_seq_max,
                     self._embedder.n_embd)
        return self._embedder

    def close(self) -> None:
        """Free the context and the model (idempotent)."""
        if getattr(self, "_embedder", None) is not None:
            self._embedder.close()
            self._embedder = None
        if getattr(self, "_ctx", None):
            lc.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            lc.llama_model_free(self._model)
            self._model = None

    # -- tokens -------------------------------------------------------------------

    def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Text to token ids. ``parse_special``: special-token text (``<start_of_turn>``)
        becomes that control token; off, it is tokenized as the characters it is.
        Raises ``InvalidParameter`` for text that is not valid Unicode (a lone surrogate)."""
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidParameter("prompt", "is not valid UTF-8 text") from None
        capacity = len(data) + 8
        buf = (lc.llama_token * capacity)()
        n = lc.llama_tokenize(
            self._vocab, data, len(data), buf, capacity, add_special, parse_special
        )
        if n < 0:
            capacity = -n
            buf = (lc.llama_token * capacity)()
            n = lc.llama_tokenize(
                self._vocab, data, len(data), buf, capacity, add_special, parse_special
            )
        return list(buf[:n])

    def tokenize_segments(self, segments: Sequence[tuple[str, bool]]) -> list[int]:
        """A chat prompt's (text, is_content) pieces: the template's markup with special
        tokens parsed, message content as plain text; BOS once, at the start."""
        tokens: list[int] = []
        for i, (text, is_content) in enumerate(segments):
            tokens += self.tokenize(text, add_special=i == 0, parse_special=not is_content)
        if not segments:
            tokens = self.tokenize("", add_special=True)
        return tokens

    def token_bytes(self, token: int) -> bytes:
        """The bytes a generated token stands for (control tokens render as nothing)."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = lc.llama_token_to_piece(self._vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = lc.llama_token_to_piece(self._vocab, token, buf, -n, 0, False)
            piece = self._pieces[token] = buf.raw[:n]
        return piece

    def is_eog(self, token: int) -> bool:
        return bool(lc.llama_vocab_is_eog(self._vocab, token))

    # -- decoding and KV memory ---------------------------------------------------

    def decode(self, rows: Sequence[BatchRow], abortable: bool = False) -> int:
        """One ``llama_decode`` over the rows in order. 0 ok, 1 KV full, 2 aborted, <0 error.

        Logits of a row with ``logits=True`` are at batch index = its offset + len - 1.
        """
        if abortable != self._abort_installed:
            if abortable:
                lc.llama_set_abort_callback(self._ctx, self._abort_callback, None)
            else:
                lc.llama_set_abort_callback(
                    self._ctx, ctypes.cast(None, lc.ggml_abort_callback), None
                )
            self._abort_installed = abortable
        if self._batch.fill(rows, self._positions) == 0:
            return DECODE_OK
        self._check_compute_thread()
        return int(lc.llama_decode(self._ctx, self._batch.struct))

    def _check_compute_thread(self) -> None:
        """Warn when a thread starts decoding with several threads while the one that
        decoded before it still lives (the thread check costs one lookup per decode).

        ggml runs a graph as an OpenMP team whose master is the calling thread, and libgomp
        keeps one pool of workers per master. A second master's pool counts against the
        machine's CPUs: once libgomp manages more threads than there are CPUs it spins ~100
        times instead of ~300,000 at each of the graph's barriers and sleeps on a futex
        instead, so every decode's threads sleep and wake at every op (measured on 2 vCPUs:
        the decode threads idle ~15% of the time; docs/performance.md). The scheduler's loop
        thread is meant to be the only one.
        """
        current = threading.current_thread()
        if current is self._compute_thread or self._n_threads <= 1:
            return
        # a thread that has ended took its pool with it (a core stopped, another started)
        if self._compute_thread is not None and self._compute_thread.is_alive():
            log.warning(
                "llama.cpp decodes from a second thread (%s, while %s lives): OpenMP now "
                "throttles its spin for every team of this process; keep every decode on "
                "one thread", current.name, self._compute_thread.name,
            )
        self._compute_thread = current

    def logits_row(self, batch_index: int) -> np.ndarray:
        """A zero-copy view of the logits at a batch index of the last decode.

        Views are kept by address (the output buffer stays put between decodes unless
        llama.cpp grows it): building one through ``np.ctypeslib.as_array`` each token cost
        ~60 us of the tick thread's time between two decodes.
        """
        ptr = lc.llama_get_logits_ith(self._ctx, batch_index)
        address = ctypes.addressof(ptr.contents)
        view = self._logit_views.get(address)
        if view is None:
            if len(self._logit_views) >= 4 * self.n_seq_max:
                self._logit_views.clear()  # the buffer moved: views of the old one go
            row = (ctypes.c_float * self.n_vocab).from_address(address)
            view = self._logit_views[address] = np.ctypeslib.as_array(row)
        return view

    def token_logprobs(self, batch_index: int, token: int, top: int) -> dict[str, Any]:
        """The chosen token's log probability under the model (its raw logits at
        ``batch_index``, before any sampling transform) and the ``top`` most likely tokens',
        as the wire's logprobs entry: ``{"b": piece hex, "lp": ..., "top": [[hex, lp]...]}``.
        Only for requests that ask (``SamplingParams.logprobs``)."""
        chosen, alternatives = logprobs_of(self.logits_row(batch_index), token, top)
        return {"b": self.logprob_piece(token).hex(), "lp": chosen,
                "top": [[self.logprob_piece(t).hex(), lp] for t, lp in alternatives]}

    def logprob_piece(self, token: int) -> bytes:
        """A token's bytes as logprobs show it: its text, or a control token's name."""
        return self.token_bytes(token) or self.token_text(token).encode("utf-8")

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        """Drop a sequence's cells in [p0, p1); p1 = -1 means to the end."""
        return bool(lc.llama_memory_seq_rm(self._mem, seq_id, p0, p1))

    def kv_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        """Let ``dst`` share ``src``'s cells in [p0, p1) (metadata only under a unified KV)."""
        lc.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def kv_pos_max(self, seq_id: int) -> int:
        return int(lc.llama_memory_seq_pos_max(self._mem, seq_id))

    def kv_prefix_intact(self, seq_id: int, n_tokens: int) -> bool:
        """Whether the sequence's cells can serve positions [0, n_tokens): continue at
        ``n_tokens`` after a cut, or be copied up to it.

        Sliding-window layers may have let go of cells older than the window (llama.cpp
        reuses masked cells, and a saved state keeps only the last window); going on at
        ``n_tokens`` needs the window before it (llama-server's test).
        """
        if n_tokens == 0:
            return True
        pos_min = int(lc.llama_memory_seq_pos_min(self._mem, seq_id))
        if pos_min < 0 or self.kv_pos_max(seq_id) < n_tokens - 1:
            return False
        return pos_min <= (max(0, n_tokens - self.n_swa) if self.n_swa else 0)

    # -- sequence state (the RAM prompt cache) --------------------------------------

    def state_size(self, seq_id: int) -> int:
        """Bytes ``state_save`` needs for this sequence (asked before allocating anything)."""
        return int(lc.llama_state_seq_get_size(self._ctx, seq_id))

    def state_save(self, seq_id: int, size_bytes: int) -> ctypes.Array | None:
        """The sequence's KV cells, serialized into a buffer of ``size_bytes``; None on failure."""
        buf = (ctypes.c_uint8 * size_bytes)()
        written = lc.llama_state_seq_get_data(self._ctx, buf, size_bytes, seq_id)
        return buf if written == size_bytes else None

    def state_restore(self, seq_id: int, data: ctypes.Array) -> bool:
        """Replace the sequence's cells with a saved state; False (sequence emptied) on failure."""
        return lc.llama_state_seq_set_data(self._ctx, data, len(data), seq_id) > 0

    def _measure_kv_bytes_per_token(self) -> int:
        """One token's share of a saved sequence state (for cache listings): a 2-token probe.

        Decoded with one thread: ggml then computes on the calling thread alone, so loading
        (on whatever thread builds the engine) starts no OpenMP team (see decode()).
        """
        token = max(0, self.bos_token)
        lc.llama_set_n_threads(self._ctx, 1, 1)
        try:
            self._batch.fill([BatchRow(0, (token, token), 0, True)], self._positions)
            if lc.llama_decode(self._ctx, self._batch.struct) != DECODE_OK:
                return 0
        finally:
            lc.llama_set_n_threads(self._ctx, self._n_threads, self._n_threads)
        two = self.state_size(0)
        self.kv_remove(0, 1, -1)
        one = self.state_size(0)
        self.kv_remove(0, 0, -1)
        return max(0, two - one)

    # -- samplers ------------------------------------------------------------------

    def new_sampler(self, params: SamplingParams) -> LlamaSampler:
        """A request's own sampler; raises ``InvalidParameter`` for a bad grammar or bias."""
        return LlamaSampler(self, params)

    def grammar_for(self, params: SamplingParams) -> tuple[str, str] | None:
        """(field, GBNF) for a request's grammar or JSON schema, if it has one; only a
        grammar that ``wire.grammar_check`` shows llama.cpp's parser survives comes out.
        The bounds are checked here, where the grammar is compiled, and nowhere else in the
        daemon (the web checked them too, before queueing the job)."""
        if params.grammar is not None:
            return "grammar", check_grammar(params.grammar, "grammar")
        if params.json_schema is not None:
            try:
                schema = json.loads(params.json_schema)
            except (ValueError, RecursionError):
                raise InvalidParameter("json_schema", "is not valid JSON") from None
            # the schema's own bounds first: the converter expands maxLength & co. eagerly
            schema = check_json_schema(schema, "json_schema")
            try:
                gbnf = json_schema_to_gbnf(schema)
            except (
                Exception
            ) as exc:  # the converter raises bare exceptions on schemas it cannot express
                raise InvalidParameter(
                    "json_schema", f"cannot be turned into a grammar: {exc}"
                ) from None
            try:
                return "json_schema", check_grammar(gbnf, "json_schema")
            except InvalidParameter as exc:  # a schema can still yield a huge grammar
                reason = exc.message.removeprefix("json_schema: ")
                raise InvalidParameter("json_schema", f"its grammar is refused: {reason}") from None
        return None

    # -- chat templates ------------------------------------------------------------

    def model_chat_template(self) -> str | None:
        """The GGUF's ``tokenizer.chat_template`` (jinja2), if the file has one."""
        raw = lc.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def builtin_template_name(self) -> str:
        """The llama.cpp built-in template for this architecture (``gemma3`` -> ``gemma``)."""
        names = self._builtin_templates()
        arch = self.architecture
        for candidate in (arch, arch.rstrip("0123456789.")):
            if candidate in names:
                return candidate
        return "chatml"

    def apply_builtin_template(self, name: str, messages: Sequence[tuple[str, str]]) -> str:
        """Render (role, content) pairs with a llama.cpp built-in template, ending with the
        assistant's turn."""
        try:
            encoded = [(r.encode(), c.encode()) for r, c in messages]
        except UnicodeEncodeError:
            raise InvalidParameter("messages", "content is not valid UTF-8 text") from None
        chat = (lc.llama_chat_message * len(encoded))(
            *(lc.llama_chat_message(role=r, content=c) for r, c in encoded)
        )
        size = 2 * sum(len(r) + len(c) for r, c in encoded) + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = lc.llama_chat_apply_template(name.encode(), chat, len(encoded), True, buf, size)
            if n < 0:
                raise EngineError(f"llama.cpp has no built-in chat template {name!r}")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise EngineError("chat template output kept growing")

    def token_text(self, token: int) -> str:
        """A vocabulary entry's text (for BOS/EOS in jinja templates)."""
        raw = lc.llama_vocab_get_text(self._vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    @property
    def bos_token(self) -> int:
        return int(lc.llama_vocab_bos(self._vocab))

    @property
    def eos_token(self) -> int:
        return int(lc.llama_vocab_eos(self._vocab))

    @property
    def adds_bos(self) -> bool:
        """Whether tokenizing with ``add_special`` puts BOS first (the vocabulary says)."""
        return bool(lc.llama_vocab_get_add_bos(self._vocab))

    def _builtin_templates(self) -> set[str]:
        count = lc.llama_chat_builtin_templates(None, 0)
        out = (ctypes.c_char_p * count)()
        lc.llama_chat_builtin_templates(out, count)
        return {name.decode() for name in out if name}

    def _meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = lc.llama_model_meta_val_str(self._model, key.encode(), buf, 256)
        return buf.value.decode("utf-8", errors="replace") if n >= 0 else None


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

    def __init__(self, engine: LlamaEngine, params: SamplingParams) -> None:
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


__all__ = [
    "BatchRow",
    "DECODE_ABORTED",
    "DECODE_KV_FULL",
    "DECODE_OK",
    "EngineConfig",
    "EngineError",
    "GrammarEnded",
    "LlamaEngine",
    "LlamaSampler",
    "SamplingFailed",
    "route_llama_logs",
]
