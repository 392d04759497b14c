"""The embeddings batcher's policy (``embed_batch.py``), no model: tenants take turns by
decode, no decode ever holds more cells than the context has, an input that needs the
whole context begins once the others finish, and work is counted. The real engine runs the
same plans in tests/scheduler/test_embeddings_loop.py."""
from __future__ import annotations

import random

import numpy as np
import pytest

from scheduler_daemon.core.embed_batch import EmbeddingBatcher, EmbeddingJob

N_CTX, N_BATCH, N_SEQ = 2048, 128, 16


class Cells:
    """Stands in for the embeddings context: the cells each sequence holds, checked the
    way llama.cpp's KV cache would refuse them."""

    def __init__(self, n_ctx: int = N_CTX) -> None:
        self.n_ctx = n_ctx
        self.held: dict[int, int] = {}
        self.most = 0

    def decode(self, pieces) -> list[np.ndarray]:
        n = sum(len(tokens) for _, tokens, _ in pieces)
        assert 0 < n <= N_BATCH
        for seq, _tokens, pos0 in pieces:
            assert pos0 == self.held.get(seq, 0), "a piece skipped or repeated positions"
        assert sum(self.held.values()) + n <= self.n_ctx, "failed to find a memory slot"
        for seq, tokens, pos0 in pieces:
            self.held[seq] = pos0 + len(tokens)
        self.most = max(self.most, sum(self.held.values()))
        return [np.full(4, float(sum(tokens))) for _, tokens, _ in pieces]

    def forget(self, seq: int) -> None:
        self.held.pop(seq, None)


def job(request_id: str, lengths: list[int], scope: str = "a") -> EmbeddingJob:
    return EmbeddingJob(request_id, [[1] * n for n in lengths], lambda v, e: None, scope=scope)


def drain(batcher: EmbeddingBatcher, cells: Cells, max_decodes: int = 10_000) -> list[str]:
    """Plan, decode and commit until every job ended; the request id of each decode."""
    order = []
    for _ in range(max_decodes):
        if not batcher:
            return order
        decode = batcher.plan(cells.n_ctx, N_BATCH, N_SEQ)
        assert decode is not None, "jobs wait and none can go on"
        order.append(decode.job.request_id)
        for seq in batcher.commit(decode, cells.decode(decode.pieces)):
            cells.forget(seq)
        if decode.job.finished:
            assert batcher.remove(decode.job) == []
    raise AssertionError("the jobs did not finish")


def test_the_issue_s_overflow_case_fits_the_context():
    # [100, 2048, 10]: the 10-token input used to share a decode with the 2,048-token
    # input's tail, 2,058 cells in a context of 2,048
    batcher, cells = EmbeddingBatcher(), Cells()
    batcher.add(job("r", [100, 2048, 10]))
    drain(batcher, cells)
    assert cells.most <= N_CTX
    assert batcher.reserved_cells == 0 and cells.held == {}


def test_random_lengths_and_tenants_never_overflow_and_every_input_gets_its_vector():
    rng = random.Random(7)
    for trial in range(40):
        batcher, cells = EmbeddingBatcher(), Cells()
        jobs = [job(f"{trial}-{i}", [rng.choice([1, 5, 60, 127, 128, 129, 700, 2047, 2048])
                                     for _ in range(rng.randint(1, 12))],
                    scope=f"t{rng.randint(0, 3)}") for i in range(rng.randint(1, 6))]
        for j in jobs:
            batcher.add(j)
        drain(batcher, cells)
        assert cells.most <= N_CTX
        for j in jobs:
            assert j.finished and j.embedded_tokens == j.n_tokens
            assert sorted(j.vectors) == list(range(len(j.inputs)))


def test_tenants_take_turns_by_decode():
    # the core's context holds two whole inputs (EMBEDDING_CONTEXT_CELLS = 2 x 2,048)
    batcher, cells = EmbeddingBatcher(), Cells(2 * N_CTX)
    batcher.add(job("big1", [2048] * 7, scope="a"))  # the issue's burst: 7 x 2,048 ids
    batcher.add(job("big2", [2048] * 7, scope="a"))
    batcher.add(job("small", [8], scope="b"))
    order = drain(batcher, cells)
    assert order.index("small") == 1  # one decode of the burst, then the other tenant
    last_of_big1 = max(i for i, r in enumerate(order) if r == "big1")
    assert order.index("big2") > last_of_big1  # FIFO within a tenant


def test_in_a_context_of_one_whole_input_another_tenant_waits_for_one_input_at_most():
    batcher, cells = EmbeddingBatcher(), Cells(N_CTX)
    batcher.add(job("big", [2048] * 7, scope="a"))
    batcher.add(job("small", [8], scope="b"))
    order = drain(batcher, cells)
    assert order.index("small") <= N_CTX // N_BATCH  # the 2,048-token input's decodes


def test_an_input_needing_the_whole_context_is_not_starved_by_smaller_ones():
    batcher, cells = EmbeddingBatcher(), Cells()
    # 601 tokens: no input ends on a decode's boundary, so some input of "smalls" is
    # always open: only the wait for room lets the whole-context input begin
    batcher.add(job("smalls", [601] * 40, scope="a"))
    batcher.add(job("whole", [2048], scope="b"))
    order = drain(batcher, cells)
    assert order.index("whole") <= 2 * 601 // N_BATCH + 2  # the inputs open when it came


def test_a_removed_job_gives_back_its_sequences_and_cells():
    batcher, cells = EmbeddingBatcher(), Cells()
    first = job("x", [300, 300])
    batcher.add(first)
    decode = batcher.plan(N_CTX, N_BATCH, N_SEQ)
    batcher.commit(decode, cells.decode(decode.pieces))
    assert first.embedded_tokens == 128 and batcher.reserved_cells == 300
    seqs = batcher.remove(first)
    assert seqs == [0] and batcher.reserved_cells == 0 and not batcher
    for seq in seqs:
        cells.forget(seq)
    batcher.add(job("y", [2048]))
    assert drain(batcher, cells) and cells.most == 2048


def test_held_by_counts_a_tenant_s_jobs_and_tokens_not_yet_embedded():
    batcher = EmbeddingBatcher()
    batcher.add(job("p", [100, 50], scope="a"))
    batcher.add(job("q", [10], scope="a"))
    batcher.add(job("r", [10], scope="b"))
    assert batcher.held_by("a") == (2, 160) and batcher.held_by("c") == (0, 0)
    decode = batcher.plan(N_CTX, N_BATCH, N_SEQ)
    batcher.commit(decode, Cells().decode(decode.pieces))
    assert batcher.held_by("a") == (2, 160 - 128)


def test_a_non_finite_mean_leaves_no_sequence_with_stale_cells():
    # A decode finishes input 0 (finite) and input 1 (NaN): commit raises, the core ends the
    # job (remove) and forgets the sequences it returns. Input 0's sequence must be among
    # them, or the next input given it meets its stale cells ("does not follow").
    batcher, cells = EmbeddingBatcher(), Cells()
    broken = job("nan", [10, 20], scope="a")
    batcher.add(broken)
    decode = batcher.plan(N_CTX, N_BATCH, N_SEQ)
    sums = cells.decode(decode.pieces)
    sums[1] = np.full(4, np.nan)
    with pytest.raises(ValueError, match="not finite"):
        batcher.commit(decode, sums)
    for seq in batcher.remove(broken):
        cells.forget(seq)
    assert cells.held == {} and batcher.reserved_cells == 0
    batcher.add(job("next", [5, 5], scope="b"))  # another tenant, the freed sequences
    assert drain(batcher, cells) == ["next"]
