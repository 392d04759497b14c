"""The generation context: the model, one context, its batch, KV memory, tokens, chat
templates.

``llama/`` is the only package that imports ``llama_cpp`` (the low-level ctypes API of
llama-cpp-python 0.3.36); beside this module are the sampler (``sampler.py``), the
embeddings context (``embedder.py``) and llama.cpp's log (``logs.py``). Everything above
(``core/scheduler.py``) talks to an object with ``LlamaEngine``'s public methods, so the
policy is tested with a fake engine and no model.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import threading
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

from ..core.engine_api import DECODE_OK, BatchRow
from .batch import _Batch
from .embedder import Embedder
from .errors import EngineError
from .logs import route_llama_logs
from .sampler import _TOKEN_DATA, LlamaSampler, logprobs_of

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """What the engine needs to load a model and size its context."""

    model_path: str
    n_ctx: int = 8192
    n_batch: int = 2048
    n_seq_max: int = 4
    n_threads: int = 2
    n_ubatch: int = 512
    # layers whose weights go to the GPU (N_GPU_LAYERS): 0 none, -1 all; a CPU build of
    # llama.cpp has no GPU device and ignores it
    n_gpu_layers: int = 0


class LlamaEngine:
    """One model and one context with ``n_seq_max`` sequences over a unified KV buffer."""

    def __init__(self, config: EngineConfig) -> None:
        path = Path(config.model_path)
        if not path.is_file():
            raise EngineError(f"model file not found: {path}")
        route_llama_logs()
        lc.llama_backend_init()
        log.info("loading model %s (%.0f MB, n_gpu_layers=%d)", path,
                 path.stat().st_size / 2**20, config.n_gpu_layers)
        self._model = lc.llama_model_load_from_file(
            str(path).encode(), self._model_params(config)
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
        self.cache_identity = self._cache_identity(path, config)
        log.info(
            "model ready: arch=%s vocab=%d n_ctx=%d n_batch=%d n_seq_max=%d",
            self.architecture,
            self.n_vocab,
            self.n_ctx,
            self.n_batch,
            self.n_seq_max,
        )

    @staticmethod
    def _model_params(config: EngineConfig) -> lc.llama_model_params:
        params = lc.llama_model_default_params()
        params.n_gpu_layers = config.n_gpu_layers  # llama.cpp's own default is -1 (all)
        return params

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

    def tokenize_segments(
        self, segments: Sequence[tuple[str, bool]], bos: bool = True
    ) -> list[int]:
        """A chat prompt's (text, is_content) pieces: the template's markup with special
        tokens parsed, message content as plain text; BOS once, at the start (``bos``: a
        conversation's start, not a continuation's)."""
        tokens: list[int] = []
        for i, (text, is_content) in enumerate(segments):
            tokens += self.tokenize(text, add_special=bos and i == 0,
                                    parse_special=not is_content)
        if not segments and bos:
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

    def state_restore(self, seq_id: int, data: ctypes.Array | bytearray) -> bool:
        """Replace the sequence's cells with a saved state (``state_save``'s buffer, or its
        bytes read back into a bytearray); False (sequence emptied) on failure."""
        if isinstance(data, bytearray):
            data = (ctypes.c_uint8 * len(data)).from_buffer(data)  # no copy
        return lc.llama_state_seq_set_data(self._ctx, data, len(data), seq_id) > 0

    # -- LoRA adapters (issue 35's first step: no request reaches these yet; a file must be
    # checked before it is given to load_adapter, which llama.cpp parses natively) ----------

    def load_adapter(self, path: str) -> Any:
        """Load a GGUF LoRA adapter for this model (``llama_adapter_lora_init``); raises
        ``EngineError`` when llama.cpp refuses it. Its handle lives until ``free_adapter``
        (or the model's end)."""
        handle = lc.llama_adapter_lora_init(self._model, str(path).encode())
        if not handle:
            raise EngineError(f"llama.cpp refused the adapter {path}")
        return handle

    def use_adapters(self, adapters: Sequence[tuple[Any, float]]) -> None:
        """The adapters (handle, scale) every later decode of the context applies; none: the
        base model. Loop thread only (between decodes)."""
        n = len(adapters)
        handles = (lc.llama_adapter_lora_p_ctypes * max(1, n))(*[h for h, _ in adapters])
        scales = (ctypes.c_float * max(1, n))(*[float(s) for _, s in adapters])
        if lc.llama_set_adapters_lora(self._ctx, handles if n else None, n,
                                      scales if n else None) != 0:
            raise EngineError("llama.cpp could not set the adapters")

    def free_adapter(self, handle: Any) -> None:
        """Unload an adapter (not in use by ``use_adapters`` any more)."""
        lc.llama_adapter_lora_free(handle)

    def _cache_identity(self, path: Path, config: EngineConfig) -> str:
        """What a saved sequence state depends on, hashed (the disk tier's folder and
        files): llama.cpp's version, the model file (its size and its first and last 4 MiB:
        the GGUF header, its metadata and tensor index, and the last tensors' bytes), the
        model's shape and the context parameters that shape the KV cells."""
        h = hashlib.sha256(b"llm-kv-state-v1\x00")
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(f.read(4 << 20))
            f.seek(max(0, size - (4 << 20)))
            h.update(f.read(4 << 20))
        params = self._context_params(config)
        shape = {
            "llama_cpp": getattr(lc, "__version__", "?"), "size": size,
            "arch": self.architecture, "n_params": int(lc.llama_model_n_params(self._model)),
            "n_layer": int(lc.llama_model_n_layer(self._model)), "n_swa": self.n_swa,
            "type_k": int(params.type_k), "type_v": int(params.type_v),
            "flash_attn": int(getattr(params, "flash_attn_type", -2)),
            "swa_full": bool(params.swa_full), "kv_unified": bool(params.kv_unified),
        }
        h.update(json.dumps(shape, sort_keys=True).encode())
        return h.hexdigest()

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
            return "json_schema", schema_grammar(params.json_schema)
        return None

    def schema_grammar(self, json_schema: str, field: str = "json_schema",
                       first: Sequence[str] = ()) -> str:
        """The GBNF of a JSON schema (its text), checked like any grammar; properties named
        in ``first`` come first in their objects (else in their sorted order)."""
        return schema_grammar(json_schema, field, first)

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


def schema_grammar(json_schema: str, field: str = "json_schema", first: Sequence[str] = ()) -> str:
    """The GBNF of a JSON schema (its text), checked like any grammar; properties named
    in ``first`` come first in their objects (else in their sorted order)."""
    try:
        schema = json.loads(json_schema)
    except (ValueError, RecursionError):
        raise InvalidParameter(field, "is not valid JSON") from None
    # the schema's own bounds first: the converter expands maxLength & co. eagerly
    schema = check_json_schema(schema, field)
    try:
        gbnf = json_schema_to_gbnf(schema, list(first) or None)
    except Exception as exc:  # the converter raises bare exceptions on what it cannot express
        raise InvalidParameter(field, f"cannot be turned into a grammar: {exc}") from None
    try:
        return check_grammar(gbnf, field)
    except InvalidParameter as exc:  # a schema can still yield a huge grammar
        reason = exc.message.removeprefix(f"{field}: ")
        raise InvalidParameter(field, f"its grammar is refused: {reason}") from None


__all__ = ["EngineConfig", "EngineError", "LlamaEngine"]
