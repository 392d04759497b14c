"""The embeddings jobs of one daemon and the embeddings context they share: pure policy.

``InferenceCore`` owns one ``EmbeddingBatcher`` (in its ``core.embeddings.EmbeddingsQueue``)
and decodes what it plans on the loop thread, between two generation ticks
(docs/scheduler.md, "Embeddings"). The rules:

- **Tenants take turns, one decode each.** Jobs wait in one FIFO per tenant (its
  ``scope``); each decode serves the head job of the tenant whose turn it is, so one
  tenant's burst of large jobs delays another tenant's job by one decode per turn, not by
  the burst. A tenant's later jobs wait for its head (FIFO within a tenant).
- **The context never overflows.** Every open input (begun, not finished) holds one
  sequence and *reserves* cells for its whole length when it begins; an input begins only
  if its length fits in the cells not reserved and a sequence is free. So a decode never
  asks llama.cpp for more cells than the context has, whatever the lengths and however the
  inputs of several jobs interleave. A finished input's cells and sequence are released at
  once (the caller removes the sequence's cells: ``forget``).
- **No input waits forever for room.** A job that has nothing open and whose next input
  does not fit becomes the one waiting for room: until it begins, no other job begins an
  input (open ones go on and finish, freeing cells), so it begins at the latest when every
  open input has finished.
- **Work is counted.** ``embedded_tokens`` is what a job's decodes carried; a job that ends
  without its vectors (a cancel, its deadline, a failed decode) is billed for it.

Not thread-safe: the core holds its lock around every call.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .engine_api import normalized

# done(vectors, error, embedded_tokens): the vectors in input order, or None and the error
EmbeddingsDone = Callable[[list[Any] | None, BaseException | None, int], None]


@dataclass(slots=True)
class OpenInput:
    """An input begun and not finished: its sequence, its next position, its sum so far."""

    seq: int
    pos: int = 0
    total: Any = None


@dataclass(slots=True)
class EmbeddingJob:
    """An embeddings request in the loop: its inputs, how far each is, its end."""

    request_id: str
    inputs: list[list[int]]
    done: EmbeddingsDone
    deadline: float | None = None  # monotonic; past it the job ends with ``timeout``
    scope: str = ""  # its tenant: the turns and the per-tenant cap
    cancelled: bool = False
    started: int = 0  # inputs begun
    open: dict[int, OpenInput] = field(default_factory=dict)  # input index -> its progress
    vectors: dict[int, Any] = field(default_factory=dict)
    embedded_tokens: int = 0  # tokens its decodes carried (what it is billed for)
    n_tokens: int = 0  # tokens of all its inputs

    def __post_init__(self) -> None:
        self.n_tokens = sum(len(tokens) for tokens in self.inputs)

    @property
    def finished(self) -> bool:
        return len(self.vectors) == len(self.inputs)


@dataclass(slots=True)
class EmbeddingDecode:
    """One decode a ``plan`` chose: one job's pieces (sequence, tokens, first position) and
    the input each piece belongs to."""

    job: EmbeddingJob
    pieces: list[tuple[int, list[int], int]]
    inputs: list[int]

    @property
    def n_tokens(self) -> int:
        return sum(len(tokens) for _, tokens, _ in self.pieces)


class EmbeddingBatcher:
    """Embeddings jobs per tenant, their turns, and the cells and sequences they hold."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[EmbeddingJob]] = {}  # tenant -> its jobs, oldest first
        self._turns: deque[str] = deque()  # tenants with jobs, whose turn first
        self._free_seqs: set[int] | None = None  # made at the first plan (the context's size)
        self.reserved_cells = 0  # cells the open inputs reserved (their whole lengths)
        self.waiting_for_room: EmbeddingJob | None = None  # see the module docstring

    # -- the jobs -------------------------------------------------------------------------

    def __len__(self) -> int:
        return sum(len(jobs) for jobs in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._turns)

    def jobs(self) -> list[EmbeddingJob]:
        """Every job, tenant by tenant."""
        return [job for jobs in self._queues.values() for job in jobs]

    def held_by(self, scope: str) -> tuple[int, int]:
        """(jobs, tokens not yet embedded) that ``scope`` holds here."""
        jobs = self._queues.get(scope, ())
        return len(jobs), sum(job.n_tokens - job.embedded_tokens for job in jobs)

    def tokens_left(self) -> int:
        """Tokens not yet embedded, all jobs together."""
        return sum(job.n_tokens - job.embedded_tokens for job in self.jobs())

    def add(self, job: EmbeddingJob) -> None:
        jobs = self._queues.get(job.scope)
        if jobs is None:
            jobs = self._queues[job.scope] = deque()
            self._turns.append(job.scope)
        jobs.append(job)

    def find(self, request_id: str) -> EmbeddingJob | None:
        return next((job for job in self.jobs() if job.request_id == request_id), None)

    def remove(self, job: EmbeddingJob) -> list[int]:
        """Take ``job`` out (ended, whatever how): the sequences whose cells the caller
        removes from the context (its open inputs')."""
        jobs = self._queues.get(job.scope)
        if jobs is None or job not in jobs:
            return []
        jobs.remove(job)
        if not jobs:
            del self._queues[job.scope]
            self._turns.remove(job.scope)
        if self.waiting_for_room is job:
            self.waiting_for_room = None
        seqs = [state.seq for state in job.open.values()]
        for index in list(job.open):
            self._release(job, index)
        return seqs

    def remove_all(self) -> list[EmbeddingJob]:
        jobs = self.jobs()
        for job in jobs:
            self.remove(job)
        return jobs

    # -- the decodes ----------------------------------------------------------------------

    def plan(self, n_ctx: int, n_batch: int, n_seq_max: int) -> EmbeddingDecode | None:
        """The next decode (at most ``n_batch`` tokens of one job, none past the ``n_ctx``
        cells), the tenants' turns moved on; None when no job can go on (none waits, or
        every job waits for room another holds: not while any input is open)."""
        if self._free_seqs is None:
            self._free_seqs = set(range(n_seq_max))
        for scope in list(self._turns):
            job = self._queues[scope][0]
            decode = self._pieces(job, n_ctx, n_batch)
            if decode is not None:
                self._turns.remove(scope)
                self._turns.append(scope)
                return decode
        return None

    def _pieces(self, job: EmbeddingJob, n_ctx: int, n_batch: int) -> EmbeddingDecode | None:
        assert self._free_seqs is not None
        decode = EmbeddingDecode(job, [], [])
        room = n_batch
        for index in sorted(job.open):  # open inputs go on first: they free cells
            if room <= 0:
                break
            state = job.open[index]
            take = job.inputs[index][state.pos:state.pos + room]
            decode.pieces.append((state.seq, take, state.pos))
            decode.inputs.append(index)
            room -= len(take)
        blocked = self.waiting_for_room is not None and self.waiting_for_room is not job
        while room > 0 and job.started < len(job.inputs) and not blocked:
            length = len(job.inputs[job.started])
            if not self._free_seqs or self.reserved_cells + length > n_ctx:
                if not job.open and self.waiting_for_room is None:
                    self.waiting_for_room = job
                break
            if self.waiting_for_room is job:
                self.waiting_for_room = None
            index, seq = job.started, min(self._free_seqs)
            self._free_seqs.discard(seq)
            self.reserved_cells += length
            job.started += 1
            job.open[index] = OpenInput(seq)
            take = job.inputs[index][:room]
            decode.pieces.append((seq, take, 0))
            decode.inputs.append(index)
            room -= len(take)
        return decode if decode.pieces else None

    def commit(self, decode: EmbeddingDecode, sums: list[Any]) -> list[int]:
        """Apply a decode's sums (one per piece); the sequences of inputs it finished, whose
        cells the caller removes. ``ValueError`` if an input's mean is not finite: then no
        input is released, so ending the job (``remove``) hands back every sequence the
        decode touched, and none keeps cells that a free sequence's next input would meet."""
        job = decode.job
        job.embedded_tokens += decode.n_tokens
        vectors: dict[int, Any] = {}
        for index, (_, tokens, _), total in zip(decode.inputs, decode.pieces, sums, strict=True):
            state = job.open[index]
            state.pos += len(tokens)
            state.total = total if state.total is None else state.total + total
            if state.pos == len(job.inputs[index]):
                vectors[index] = normalized(state.total, state.pos)  # may raise: see above
        finished = []
        for index, vector in vectors.items():
            job.vectors[index] = vector
            finished.append(job.open[index].seq)
            self._release(job, index)
        return finished

    def _release(self, job: EmbeddingJob, index: int) -> None:
        state = job.open.pop(index)
        self.reserved_cells -= len(job.inputs[index])
        if self._free_seqs is not None:
            self._free_seqs.add(state.seq)
