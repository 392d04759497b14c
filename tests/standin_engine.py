"""An engine stand-in for measuring the web tier (bench/web_capacity.py): no model, no
llama.cpp, tokens at a chosen rate per stream.

The daemon uses it instead of llama.cpp only when the setting ``ENGINE_STANDIN`` names it
(``tests.standin_engine:make_engine``; never the default): everything else is the real
daemon (intake, scheduler, event writer, transport), so a benchmark measures what the web
and Redis cost per streamed token while the engine costs next to nothing.

- ``decode`` computes nothing and returns when the next tick is due: one decode call per
  ``1 / ENGINE_STANDIN_RATE`` seconds, so every generating stream gets that many tokens a
  second (a prompt's prefill takes one tick, as a short prompt's does on a real engine).
- KV cells are counted per sequence (a full cache answers 1, as llama.cpp does); saved
  states are cell counts.
- Text: one token per UTF-8 byte (ids 0-255), three control tokens, and words
  (``WORDS``) the sampler cycles through; it never samples end-of-generation, so a stream
  runs to its ``max_tokens``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_daemon.core.engine_api import DECODE_ABORTED, DECODE_KV_FULL, DECODE_OK, BatchRow
from wire.sampling import SamplingParams

BOS, EOS, EOT = 256, 257, 258
WORDS = [" lorem", " ipsum", " dolor", " sit", " amet", ",", " consectetur", " adipiscing",
         " elit", "."]
FIRST_WORD = 300
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
_CONTROL = {BOS: b"<s>", EOS: b"</s>", EOT: b"<|end|>"}


class RateSampler:
    """Cycles through ``WORDS`` (a seed picks where it starts)."""

    def __init__(self, params: SamplingParams) -> None:
        self.n = (params.seed or 0) % len(WORDS)

    def sample(self, batch_index: int) -> int:
        self.n += 1
        return FIRST_WORD + self.n % len(WORDS)

    def replay(self, tokens: Sequence[int]) -> None:
        self.n += len(tokens)

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class SavedState:
    cells: int
    size_bytes: int

    def __len__(self) -> int:
        return self.size_bytes


class RateEngine:
    """The daemon's engine (``scheduler.Engine`` and what ``core.chat`` reads), paced at
    ``rate`` decode calls a second."""

    kv_bytes_per_token = 1024
    n_swa = 0
    n_vocab = FIRST_WORD + len(WORDS)
    eog_tokens = frozenset({EOS, EOT})
    cache_identity = "standin"

    def __init__(self, n_ctx: int, n_batch: int, n_seq_max: int, rate: float) -> None:
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.period_s = 1.0 / rate
        self.abort_requested = False
        self.cells: dict[int, int] = {}
        self._next_tick = 0.0
        self.decodes = 0
        self.rows = 0

    # -- decoding and KV cells ------------------------------------------------------

    def decode(self, rows: Sequence[BatchRow], abortable: bool = False) -> int:
        now = time.monotonic()
        if self._next_tick > now:
            time.sleep(self._next_tick - now)
            now = self._next_tick
        self._next_tick = max(now, self._next_tick) + self.period_s
        if sum(self.cells.values()) + sum(len(r.tokens) for r in rows) > self.n_ctx:
            return DECODE_KV_FULL
        for r in rows:
            self.cells[r.seq_id] = r.pos0 + len(r.tokens)
        self.decodes += 1
        self.rows += len(rows)
        return DECODE_ABORTED if abortable and self.abort_requested else DECODE_OK

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        self.cells[seq_id] = min(self.cells.get(seq_id, 0), p0)
        return True

    def kv_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        self.cells[dst] = p1 if p1 >= 0 else self.cells.get(src, 0)

    def kv_pos_max(self, seq_id: int) -> int:
        return self.cells.get(seq_id, 0) - 1

    def kv_prefix_intact(self, seq_id: int, n_tokens: int) -> bool:
        return self.cells.get(seq_id, 0) >= n_tokens

    def state_size(self, seq_id: int) -> int:
        return 16 + self.cells.get(seq_id, 0) * self.kv_bytes_per_token

    def state_save(self, seq_id: int, size_bytes: int) -> SavedState:
        return SavedState(self.cells.get(seq_id, 0), size_bytes)

    def state_restore(self, seq_id: int, data: SavedState) -> bool:
        self.cells[seq_id] = data.cells
        return True

    def new_sampler(self, params: SamplingParams) -> RateSampler:
        return RateSampler(params)

    def grammar_for(self, params: SamplingParams) -> None:
        return None

    def use_adapters(self, adapters: Sequence) -> None:
        pass

    def close(self) -> None:
        pass

    # -- text -----------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True
                 ) -> list[int]:
        data = text.encode("utf-8", "surrogatepass")
        return ([BOS] if add_special else []) + list(data)

    def tokenize_segments(self, segments: Sequence[tuple[str, bool]], bos: bool = True
                          ) -> list[int]:
        tokens = [BOS] if bos else []
        for text, _ in segments:
            tokens += self.tokenize(text, add_special=False)
        return tokens

    def token_bytes(self, token: int) -> bytes:
        if token < 256:
            return bytes([token])
        if token >= FIRST_WORD:
            return WORDS[token - FIRST_WORD].encode()
        return _CONTROL.get(token, b"")

    def token_text(self, token: int) -> str:
        return self.token_bytes(token).decode()

    def is_eog(self, token: int) -> bool:
        return token in self.eog_tokens

    def model_chat_template(self) -> str:
        return TEMPLATE

    def builtin_template_name(self) -> str:
        return "chatml"

    @property
    def bos_token(self) -> int:
        return BOS

    @property
    def eos_token(self) -> int:
        return EOS

    @property
    def adds_bos(self) -> bool:
        return False


def make_engine(n_ctx: int, n_batch: int, n_seq_max: int, rate: float) -> RateEngine:
    """``ENGINE_STANDIN``'s factory (``InferenceCore.from_settings`` calls it)."""
    return RateEngine(n_ctx, n_batch, n_seq_max, rate)
