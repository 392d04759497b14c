"""The scheduler's state and the events it emits.

``Request`` is what a caller submits; ``RequestState`` is that request inside the scheduler
(its prompt, sampler, output and status); ``Slot`` is one llama.cpp sequence (``seq_id``)
and what its KV cells hold. Requests are always found by id (``Scheduler._requests``), never
by their position in a batch. (The wire's job message is ``wire.protocol.Job``: the daemon's
intake turns one into a ``Request``.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from wire.sampling import SamplingParams

from .adapters import tenant_of
from .textstream import TextStream

if TYPE_CHECKING:
    from .adapters import AdapterUse


class Status(IntEnum):
    """Where a request is. Everything from FINISHED_STOPPED on is finished (vLLM v1 style)."""

    WAITING = 0  # in the FIFO queue, holding no slot and no KV blocks
    PREFILLING = 1  # in a slot; its prompt goes into the KV cache a chunk per tick
    GENERATING = 2  # one new token per tick
    PREEMPTED = 3  # out of its slot for another tenant: its KV saved to RAM (or recomputed later)
    FINISHED_STOPPED = 10  # end-of-generation token or a stop string
    FINISHED_LENGTH = 11  # max_tokens reached
    FINISHED_CANCELLED = 12  # cancelled by the client, an operator or shutdown
    FINISHED_ERROR = 13  # failed (context_full, engine error)


FINISH_REASON = {
    Status.FINISHED_STOPPED: "stop",
    Status.FINISHED_LENGTH: "length",
    Status.FINISHED_CANCELLED: "cancelled",
    Status.FINISHED_ERROR: "error",
}


class SlotState(StrEnum):
    """What a slot (one llama.cpp sequence id) is doing."""

    IDLE = "idle"  # free; its KV may still hold a cached prefix of its scope
    PREFILLING = "prefilling"  # evaluating a prompt
    GENERATING = "generating"  # sampling a token per tick


class Sampler(Protocol):
    """A request's own token picker (``llama.sampler.LlamaSampler`` or a test fake)."""

    seed: int

    def sample(self, batch_index: int) -> int: ...

    def replay(self, tokens: list[int]) -> None: ...

    def close(self) -> None: ...


@dataclass(slots=True, frozen=True)
class Continuation:
    """What a request had generated when its daemon died, for the daemon that continues it:
    the tokens whose events went out, and the text those events carried (the client has
    it). They are prefilled after the prompt and replayed through the new sampler; the
    output carries on from them."""

    tokens: tuple[int, ...]
    text: str


@dataclass(slots=True)
class Request:
    """What a caller submits: token ids already made from the prompt or chat."""

    id: str
    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_scope: str = ""
    session: str | None = None
    cache_prompt: bool | None = None  # None: the scheduler's default
    arrival: float | None = None  # monotonic seconds; None: when submitted
    max_queued: int | None = None  # its scope's cap on waiting requests; None: the configured one
    continuation: Continuation | None = None  # it carries on from what another daemon generated
    deadline: float | None = None  # the scheduler's clock (monotonic); past it: ends with timeout
    keep_tokens: bool = False  # a session's turn: its end carries the conversation's tokens
    adapter: AdapterUse | None = None  # its LoRA adapter (core/adapters.py); None: the base


@dataclass(slots=True, eq=False)
class RequestState:
    """A request inside the scheduler (compared by identity: one object per request)."""

    id: str
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    sampler: Sampler
    cache_scope: str
    cache_prompt: bool
    session: str | None
    arrival: float
    blocks: int
    text: TextStream
    status: Status = Status.WAITING
    slot: Slot | None = None
    output: list[int] = field(default_factory=list)
    unsent_tokens: int = 0  # tokens generated since the last TokenEvent
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # per output token, if asked
    cached_tokens: int = 0
    cache_tier: str | None = None  # slot, cross_slot, ram or disk: where cached_tokens came from
    keep_tokens: bool = False  # see Request
    continued_tokens: int = 0  # the tail of ``prompt`` that is output of an earlier daemon
    passed_over: int = 0  # session requests admitted ahead of it while it was the queue's head
    t_started: float | None = None
    t_first_token: float | None = None
    deadline: float | None = None  # the scheduler's clock; past it, ``timeout`` wherever it is
    # Preemption: the tokens a resumed request's slot must hold before it samples again
    # (prompt + output; None when not resuming), and its output length when it last got a slot.
    refill: list[int] | None = None
    run_start_tokens: int = 0
    adapter: AdapterUse | None = None  # see Request
    # its tenant (what the turns, shares and caps count by): its cache scope without an
    # adapter's tag (set from it once, off the per-tick paths that read it)
    tenant: str = field(init=False)

    def __post_init__(self) -> None:
        self.tenant = tenant_of(self.cache_scope)

    @property
    def group(self) -> str:
        """Its adapter group ("" for the base model): one group's rows share a decode."""
        return self.adapter.group if self.adapter is not None else ""

    @property
    def fill_tokens(self) -> list[int]:
        """What the slot is filled with before the next sample: the prompt, or on a resume
        the prompt and everything generated (the last token's logits pick the next one)."""
        return self.refill if self.refill is not None else self.prompt


@dataclass(slots=True)
class Slot:
    """One llama.cpp sequence. ``tokens`` is exactly what its KV cells hold, in order."""

    seq_id: int
    state: SlotState = SlotState.IDLE
    request: RequestState | None = None  # the request it serves (None: idle)
    tokens: list[int] = field(default_factory=list)
    scope: str | None = None  # whose cached prefix ``tokens`` is; None: not reusable
    session: str | None = None  # the conversation pinned here while the slot is free
    last_used: float = 0.0
    cache_hits: int = 0  # reuses of the cached prefix it holds


@dataclass(slots=True, frozen=True)
class RequestStats:
    """Per-request numbers reported when it ends (no text)."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_ms: float | None
    ttft_ms: float | None
    duration_ms: float
    prompt_eval_rate: float | None  # prompt tokens evaluated per second (cached ones excluded)
    generation_rate: float | None  # generated tokens per second after the first
    prompt_evaluated: int | None = None  # prompt tokens computed (None: prompt - cached)
    # the cache's account (wire.protocol.usage): the tier the cached tokens came from (slot,
    # cross_slot, ram, disk; None: no hit), the prompt tokens this request added to the
    # cache (its slot's KV, which the RAM and disk tiers then take), and the hit's kind
    cache_tier: str | None = None
    cache_created_tokens: int = 0
    cache_hit: str = "none"  # exact (all but the last token) | session | prefix | none


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """New text for a request; ``n_tokens`` tokens were generated since the previous one."""

    request_id: str
    text: str
    n_tokens: int
    tokens: tuple[int, ...] = ()  # the ``n_tokens`` token ids (a continuation replays them)
    logprobs: tuple[dict[str, Any], ...] = ()  # their logprobs entries, when the request asked
    index: int | None = None  # its choice, in a request of several (n > 1); None: the only one


@dataclass(slots=True, frozen=True)
class Choice:
    """How one choice of a request of several ended."""

    index: int
    finish_reason: str
    stop: str | None = None


@dataclass(slots=True, frozen=True)
class FinishedEvent:
    """The last event of every admitted request."""

    request_id: str
    finish_reason: str  # stop | length | cancelled | error
    stats: RequestStats
    stop: str | None = None  # the stop string that ended it, if one did
    error: dict[str, Any] | None = None  # {"code", "message"} when finish_reason == "error"
    choices: tuple[Choice, ...] = ()  # a request of several choices: each one's end
    # a session's turn that finished (stop, length): the conversation's tokens now, its
    # prompt and its reply (``Request.keep_tokens``); None otherwise
    tokens: tuple[int, ...] | None = None


@dataclass(slots=True, frozen=True)
class TickStats:
    """What one tick did."""

    tick: int
    batch_tokens: int
    decode_tokens: int
    prefill_tokens: int
    active_slots: int
    queue_depth: int
    eval_ms: float
    kv_retries: int


@dataclass(slots=True, frozen=True)
class CacheEvent:
    """Something the prefix cache did (for logs, counters and the daemon's state). No token ids.

    ``kind``: save / restore / evict / reject (of ``tier``: ram or disk), or
    prefix_instability (a request matched only 10-50% of a slot's cached history, which then
    has ``history_tokens``). ``reason``: why a disk save ran (finish, evict, shutdown).
    Disk saves are reported from the disk writer's thread, the rest from the loop's.
    """

    kind: str
    cache_scope: str
    n_tokens: int
    size_bytes: int = 0
    request_id: str | None = None
    history_tokens: int = 0
    tier: str = "ram"
    reason: str | None = None


Event = TokenEvent | FinishedEvent
