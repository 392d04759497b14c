"""One tick's plan: what the scheduler decided before the decode (vLLM v1's ``SchedulerOutput``).

``Scheduler.schedule()`` applies cancels, admits, and returns a ``TickPlan``; ``run(plan)``
decodes it (re-planning a smaller batch under KV pressure) and commits the results in one
place. Policy tests build and inspect plans without decoding anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from .engine_api import BatchRow
from .state import RequestState, Slot


class Phase(StrEnum):
    """What a row does for its request."""

    DECODE = "decode"  # one token: the last one sampled
    PREFILL = "prefill"  # a chunk of the prompt


@dataclass(slots=True)
class PlannedRow:
    """One request's row in the tick's batch (its sequence id is ``row.seq_id``)."""

    phase: Phase
    row: BatchRow
    request: RequestState = field(repr=False, compare=False)
    slot: Slot = field(repr=False, compare=False)

    @property
    def request_id(self) -> str:
        return self.request.id

    @property
    def seq_id(self) -> int:
        return self.row.seq_id

    @property
    def n_tokens(self) -> int:
        return len(self.row.tokens)


@dataclass(slots=True)
class TickPlan:
    """Decided at the start of a tick, under the scheduler's lock.

    ``cancelled`` and ``admitted`` already happened (requests ended, slots assigned); ``rows``
    is the batch to decode, decode rows first, all within ``token_budget`` tokens;
    ``deferred`` are prefilling requests that wait this tick because a row of the batch
    computes their next prompt tokens (they adopt them next tick); ``preempted`` left their
    slots for another scope's waiting request, ``resumed`` got one back."""

    tick: int
    token_budget: int
    rows: list[PlannedRow] = field(default_factory=list)
    admitted: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # out of their slots for another scope
    resumed: list[str] = field(default_factory=list)  # preempted ones given a slot again
    # the adapter group whose rows these are ("" the base model) and its adapter set
    # ((handle, scale) pairs) that the context applies for the decode
    group: str = ""
    adapter_set: list[tuple[Any, float]] = field(default_factory=list)

    @property
    def n_tokens(self) -> int:
        return sum(r.n_tokens for r in self.rows)

    @property
    def batch(self) -> list[BatchRow]:
        return [r.row for r in self.rows]

    @property
    def request_ids(self) -> set[str]:
        return {r.request_id for r in self.rows}

    def decoding(self) -> list[str]:
        """Requests that get one token decoded this tick, in batch order."""
        return [r.request_id for r in self.rows if r.phase is Phase.DECODE]

    def prefill_chunks(self) -> dict[str, int]:
        """Prompt tokens each prefilling request evaluates this tick."""
        return {r.request_id: r.n_tokens for r in self.rows if r.phase is Phase.PREFILL}
