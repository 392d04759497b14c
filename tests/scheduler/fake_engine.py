"""A fake engine for the scheduler's policy tests: no model, scripted tokens, a KV cell count.

Each request's sampler follows a script chosen by its seed (``FakeEngine.scripts``) and
records which batch row it sampled from, so tests can check rows stay keyed by request.
"""
from __future__ import annotations

from collections.abc import Callable

from scheduler_daemon.engine_api import DECODE_ABORTED, DECODE_KV_FULL, DECODE_OK, BatchRow
from scheduler_daemon.sampling import SamplingParams

EOG = 2


class FakeSampler:
    def __init__(self, engine: "FakeEngine", params: SamplingParams) -> None:
        self.engine = engine
        self.seed = params.seed or 0
        self.script = list(engine.scripts.get(self.seed, [])) or None
        self.seen: list[tuple[int, int]] = []  # (seq_id, pos) of each row sampled from
        self.closed = False
        self.n = 0

    def sample(self, batch_index: int) -> int:
        self.seen.append(self.engine.owner_of(batch_index))
        self.n += 1
        if self.script is None:
            return 1000 + self.seed * 100 + self.n
        return self.script.pop(0) if self.script else 1000

    def close(self) -> None:
        self.closed = True


class FakeEngine:
    """Counts KV cells per sequence; ``decode`` fails with 1 when they would exceed ``kv_cells``."""

    def __init__(self, n_ctx: int = 1024, n_batch: int = 256, n_seq_max: int = 4,
                 kv_cells: int | None = None) -> None:
        self.n_ctx, self.n_batch, self.n_seq_max = n_ctx, n_batch, n_seq_max
        self.kv_cells = kv_cells if kv_cells is not None else n_ctx
        self.cells: dict[int, int] = {}
        self.abort_requested = False
        self.scripts: dict[int, list[int]] = {}
        self.calls: list[list[BatchRow]] = []  # every decode call, failed ones too
        self.on_decode: Callable[[list[BatchRow]], None] | None = None
        self.samplers: list[FakeSampler] = []
        self._owners: list[tuple[int, int]] = []

    def decode(self, rows: list[BatchRow], abortable: bool = False) -> int:
        rows = [BatchRow(r.seq_id, list(r.tokens), r.pos0, r.logits) for r in rows]
        self.calls.append(rows)
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
        return True

    def new_sampler(self, params: SamplingParams) -> FakeSampler:
        sampler = FakeSampler(self, params)
        self.samplers.append(sampler)
        return sampler

    def token_bytes(self, token: int) -> bytes:
        return f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG
