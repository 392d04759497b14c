"""A fake engine for the scheduler's policy tests: no model, scripted tokens, a KV cell count.

Each request's sampler follows a script chosen by its seed (``FakeEngine.scripts``) and
records which batch row it sampled from, so tests can check rows stay keyed by request.
Sequence copies and saved states only move cell counts (``ops`` records them); a saved
state is ``FakeState``, ``state_size`` is ``kv_bytes_per_token`` per cell plus a header.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from scheduler_daemon.core.engine_api import DECODE_ABORTED, DECODE_KV_FULL, DECODE_OK, BatchRow
from wire.sampling import SamplingParams

EOG = 2


class FakeSampler:
    def __init__(self, engine: FakeEngine, params: SamplingParams) -> None:
        self.engine = engine
        self.seed = params.seed or 0
        self.script = list(engine.scripts.get(self.seed, [])) or None
        self.seen: list[tuple[int, int]] = []  # (seq_id, pos) of each row sampled from
        self.closed = False
        self.n = 0
        self.replayed: list[int] = []  # tokens of a continuation, as the scheduler replayed them

    def sample(self, batch_index: int) -> int:
        self.seen.append(self.engine.owner_of(batch_index))
        self.n += 1
        if self.script is None:
            return 1000 + self.seed * 100 + self.n
        return self.script.pop(0) if self.script else 1000

    def replay(self, tokens: list[int]) -> None:
        self.replayed.extend(tokens)

    def close(self) -> None:
        self.closed = True


@dataclass(frozen=True)
class FakeState:
    seq_id: int
    cells: int
    size_bytes: int

    def __len__(self) -> int:
        return self.size_bytes


STATE_HEADER_BYTES = 16


class FakeEngine:
    """Counts KV cells per sequence; ``decode`` fails with 1 when they would exceed ``kv_cells``."""

    def __init__(
        self, n_ctx: int = 1024, n_batch: int = 256, n_seq_max: int = 4, kv_cells: int | None = None
    ) -> None:
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.kv_cells = kv_cells if kv_cells is not None else n_ctx
        self.cells: dict[int, int] = {}
        self.abort_requested = False
        self.scripts: dict[int, list[int]] = {}
        self.calls: list[list[BatchRow]] = []  # every decode call, failed ones too
        self.on_decode: Callable[[list[BatchRow]], None] | None = None
        self.samplers: list[FakeSampler] = []
        self._owners: list[tuple[int, int]] = []
        self.n_swa = 0
        self.kv_bytes_per_token = 100
        # ("copy", src, dst, p0, p1), ("save", seq, cells), ("restore", seq, cells)
        self.ops: list[tuple] = []
        self.fail_restore = False
        self.window_lost: set[int] = set()  # sequences whose early cells a sliding window dropped
        # LoRA adapters: the set applied now, the set each decode ran under, loads and frees
        self.adapters: list[tuple[object, float]] = []
        self.decode_adapters: list[list[tuple[object, float]]] = []
        self.loaded: list[str] = []
        self.freed: list[object] = []

    def decode(self, rows: list[BatchRow], abortable: bool = False) -> int:
        rows = [BatchRow(r.seq_id, list(r.tokens), r.pos0, r.logits) for r in rows]
        self.calls.append(rows)
        self.decode_adapters.append(list(self.adapters))
        if self.on_decode is not None:
            self.on_decode(rows)
        for r in rows:
            assert r.pos0 == self.cells.get(r.seq_id, 0), "positions must continue the sequence"
        if sum(self.cells.values()) + sum(len(r.tokens) for r in rows) > self.kv_cells:
            return DECODE_KV_FULL
        for r in rows:
            self.cells[r.seq_id] = r.pos0 + len(r.tokens)
        if abortable and self.abort_requested:
            return DECODE_ABORTED  # like llama.cpp: what was computed stays in the KV cache
        self._owners = [(r.seq_id, r.pos0 + i) for r in rows for i in range(len(r.tokens))]
        return DECODE_OK

    def owner_of(self, batch_index: int) -> tuple[int, int]:
        return self._owners[batch_index]

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool:
        assert p1 == -1
        self.cells[seq_id] = min(self.cells.get(seq_id, 0), p0)
        if p0 == 0:
            self.window_lost.discard(seq_id)
        return True

    def kv_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None:
        assert self.cells.get(dst, 0) == p0, "the destination must hold exactly [0, p0)"
        assert 0 <= p0 < p1 <= self.cells.get(src, 0), "only cells the source holds can be copied"
        self.ops.append(("copy", src, dst, p0, p1))
        self.cells[dst] = p1

    def kv_prefix_intact(self, seq_id: int, n_tokens: int) -> bool:
        return self.cells.get(seq_id, 0) >= n_tokens and seq_id not in self.window_lost

    def state_size(self, seq_id: int) -> int:
        return STATE_HEADER_BYTES + self.cells.get(seq_id, 0) * self.kv_bytes_per_token

    def state_save(self, seq_id: int, size_bytes: int) -> FakeState | None:
        assert size_bytes == self.state_size(seq_id)
        self.ops.append(("save", seq_id, self.cells.get(seq_id, 0)))
        return FakeState(seq_id, self.cells.get(seq_id, 0), size_bytes)

    def state_restore(self, seq_id: int, data: FakeState) -> bool:
        self.ops.append(("restore", seq_id, data.cells))
        if self.fail_restore:
            self.cells[seq_id] = 0
            return False
        self.cells[seq_id] = data.cells
        return True

    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        sampler = FakeSampler(self, params)
        self.samplers.append(sampler)
        return sampler

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def load_adapter(self, path: str) -> object:
        self.loaded.append(path)
        return f"handle:{path}"

    def use_adapters(self, adapters: list[tuple[object, float]]) -> None:
        self.adapters = list(adapters)

    def free_adapter(self, handle: object) -> None:
        assert all(h != handle for h, _ in self.adapters), "freed while the context applies it"
        self.freed.append(handle)
