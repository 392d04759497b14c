"""Continuous-batching policy over an engine: admission, slots, each tick's batch, finishing.

Pure Python: it drives any object with the engine's methods (``llama.engine.LlamaEngine`` in
production, a fake in the policy tests). One thread calls ``step()`` in a loop; other
threads may call ``submit``, ``cancel`` and ``snapshot`` at any time. A step is plan, then
act, then commit: ``schedule()`` applies cancels, admits and returns the tick's
``plan.TickPlan``; ``run(plan)`` decodes it (re-planning a smaller batch under KV
pressure) and applies the results in one place (``_commit``). Cancels take effect at the
next tick boundary; a long prefill in flight is cut short through the engine's abort flag
and rolled back, never changed from another thread mid-decode.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from wire import errors
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .adapters import AdapterRegistry, tenant_of, tenant_scopes
from .disk_cache import DiskCache
from .engine_api import (
    DECODE_ABORTED,
    DECODE_KV_FULL,
    DECODE_OK,
    BatchRow,
    GrammarEnded,
    RowFailed,
)
from .fair_queue import FairQueue
from .plan import Phase, PlannedRow, TickPlan
from .prefix_cache import CacheEngine, PrefixCache
from .ram_cache import RamCache, common_prefix_len
from .state import (
    FINISH_REASON,
    CacheEvent,
    Event,
    FinishedEvent,
    Request,
    RequestState,
    RequestStats,
    Sampler,
    Slot,
    SlotState,
    Status,
    TickStats,
    TokenEvent,
)
from .textstream import TextStream

log = logging.getLogger(__name__)


# A prefilling request waits a tick rather than compute this many prompt tokens that
# another slot of its scope is computing in the same batch (it adopts them next tick).
SHARED_PREFILL_MIN_TOKENS = 16
ARRIVAL_POLL_S = 0.002  # a tick waiting for a burst's arrivals looks again this often


class Engine(CacheEngine, Protocol):
    """What the scheduler needs from an engine (the prefix cache's needs included)."""

    n_ctx: int
    n_batch: int
    n_seq_max: int
    abort_requested: bool

    def decode(self, rows: list[BatchRow], abortable: bool = False) -> int: ...
    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool: ...
    def new_sampler(self, params: SamplingParams) -> Sampler: ...
    def token_bytes(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...


@dataclass(slots=True, frozen=True)
class SchedulerConfig:
    """Policy knobs (settings: CHUNK_SIZE, MAX_QUEUE, KV_BLOCK_TOKENS, CACHE_PROMPT...)."""

    chunk_size: int = 512
    max_queue: int = 64
    kv_block_tokens: int = 256
    kv_budget_tokens: int | None = None  # blocks to hand out, in tokens; None: the engine's n_ctx
    default_max_tokens: int = 512
    cache_prompt: bool = True
    abort_min_tokens: int = 64  # batches this large can be aborted mid-decode by a cancel
    cross_slot: bool = True  # adopt a same-scope prefix from another slot (llama_memory_seq_cp)
    # an admission saves the other idle slots' prefixes to RAM and frees their cells (the
    # prefill's attention span: its running slots only); needs the RAM tier
    idle_slots_to_ram: bool = False
    ram_cache_bytes: int = 256 * 2**20  # RAM prompt cache budget (PROMPT_CACHE_RAM_MB); 0: off
    ram_tenant_share: float = 1.0  # most of that budget one cache_scope may hold
    ram_min_tokens: int = 16  # shorter cached prefixes are not worth a RAM entry
    # a request that ends holding at least this many tokens has its state saved to the disk
    # tier (PROMPT_CACHE_DISK_MIN_TOKENS); shorter RAM entries never go there either
    disk_min_tokens: int = 256
    session_max_bypass: int = 4  # session requests that may go ahead of one queue head
    # Fair shares between cache scopes (tenants). KV_TENANT_SHARE: the most of the KV block
    # budget one scope's running requests may reserve (so one request's reservation can never
    # lock the other tenants out); MAX_QUEUE_PER_TENANT: waiting requests one scope may hold
    # (a request may carry its tenant's own cap). None: no cap.
    kv_scope_share: float = 1.0
    max_queue_per_scope: int | None = None
    # The engine's last sequence is no slot but the prefix cache's park: an admission that
    # evicts a slot's prefix parks it there and its RAM save runs after the tick's decode,
    # not before the new prompt's prefill (prefix_cache.py). The engine needs one sequence
    # more than the slots (``InferenceCore.from_settings``: N_PARALLEL + 1).
    park_seq: bool = False
    # Preemption (PREEMPTION, PREEMPT_MIN_TOKENS): while another scope's request waits for a
    # slot, a generating request of a scope over its fair share of the slots leaves its slot
    # (its KV saved to the RAM tier, else recomputed) once it has generated this many tokens
    # since it got the slot, and resumes later where it was.
    preemption: bool = True
    preempt_min_tokens: int = 16
    # Prompts whose prefill may finish in one tick (PREFILL_PROMPTS_PER_TICK; 0: as many as
    # fit). On a CPU a prefill costs about the same per token whether one prompt or four
    # share the batch, so a burst prefilled in one batch has every first token wait for the
    # whole burst; finished one a tick, the first tokens come one prompt's prefill apart
    # (the earlier ones decoding beside the later prefills). Chunks that do not finish
    # their prompt are not limited. A GPU, whose batch of four costs about what one does,
    # wants 0.
    prompts_per_tick: int = 0
    # With no such limit, a burst's first tick waits while requests are on their way into
    # the queue (``arrivals``, the daemon's intake: jobs taken from Redis and not yet
    # queued here) and free slots would stay empty without them, at most this long, so the
    # burst is prefilled in one batch (one llama_decode) rather than its first alone.
    arrival_wait_s: float = 0.05


class Scheduler:
    """Admission, slot choice and batching for one engine context."""

    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig,
        on_event: Callable[[Event], None],
        on_tick: Callable[[TickStats], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_cache_event: Callable[[CacheEvent], None] | None = None,
        disk: DiskCache | None = None,
    ) -> None:
        """``disk``: the prefix cache's disk tier (opened), if any."""
        self.engine = engine
        self.config = config
        self._emit = on_event
        self._on_tick = on_tick
        self._clock = clock
        # Held by every change of state and while events are emitted (``InferenceCore``
        # registers a request's handle under it, so no event can outrun the registration).
        self.lock = threading.RLock()
        self._work = threading.Event()
        n_slots = engine.n_seq_max - 1 if config.park_seq else engine.n_seq_max
        if n_slots < 1:
            raise ValueError("the engine has no sequence for a slot besides the park")
        self._slots = [Slot(seq_id=i) for i in range(n_slots)]
        self._waiting: FairQueue[str, RequestState] = FairQueue()  # keyed by RequestState.tenant
        self._requests: dict[str, RequestState] = {}
        self._preempted: list[RequestState] = []  # out of their slots, oldest preemption first
        self._cancels: set[str] = set()
        self._deferred_cancels: collections.deque[str] = collections.deque()  # see cancel()
        self._in_flight: set[str] = set()
        # the request whose sampler runs now (set on the loop thread, read without the lock:
        # a loop stuck here is stuck on this request's grammar or sampler, not on the others)
        self.sampling: str | None = None
        self.on_sampling: Callable[[bool], None] | None = None  # the loop clock's mark
        self.tick_rows: list[str] = []  # requests in the batch of the tick under way
        # requests on their way into the queue (the daemon's intake sets it: jobs taken and
        # not yet submitted); a tick that would leave free slots empty waits for them
        self.arrivals: Callable[[], int] | None = None
        self.last_plan: TickPlan | None = None  # the latest plan made (for tests and logs)
        budget = config.kv_budget_tokens or engine.n_ctx
        self._total_blocks = budget // config.kv_block_tokens
        self._used_blocks = 0
        self._scope_blocks = max(1, int(self._total_blocks * config.kv_scope_share))
        self.max_request_tokens = min(engine.n_ctx, self._scope_blocks * config.kv_block_tokens)
        self._rr_next = 0
        self._tick = 0
        # LoRA adapters (core/adapters.py; None: requests carry none): the group the
        # context applies now, and each group's last turn and tokens decoded
        self.adapters: AdapterRegistry | None = None
        self._group = ""
        self._group_turns: dict[str, int] = {}
        self._round_served: set[str] = set()  # turn units that had their turn this round
        self.group_tokens: Counter[str] = Counter()
        self._admitting = True
        # KV cells are only touched on the loop thread (llama.cpp's memory is not safe to
        # change during a decode, which runs outside the lock): a slot forgotten from
        # another thread (an operator's evict_scope, a stopping daemon's drop) has its
        # cells removed at the start of the next tick, before any slot is assigned.
        self._loop_thread: int | None = None
        self._kv_forgets: list[int] = []
        self.counters: Counter[str] = Counter()
        self.on_cache_event = on_cache_event  # may be set later; runs with the lock held
        # telemetry of KV pressure: (tick, retry, remedy, batch tokens, next batch tokens)
        self.on_kv_pressure: Callable[[int, int, str, int, int], None] | None = None
        ram = None
        if config.ram_cache_bytes > 0:
            ram = RamCache(
                config.ram_cache_bytes, config.ram_tenant_share, partial_max_tokens=engine.n_swa
            )
        self.cache = PrefixCache(
            engine,
            ram,
            config.cross_slot,
            config.ram_min_tokens,
            self.counters,
            self._cache_event,
            clock,
            park_seq=n_slots if config.park_seq else None,
            idle_to_ram=config.idle_slots_to_ram,
            disk=disk,
            disk_min_tokens=config.disk_min_tokens,
        )
        for seq_id in range(engine.n_seq_max):  # a new scheduler owns the context: all empty
            engine.kv_remove(seq_id, 0, -1)

    # -- called from any thread ---------------------------------------------------

    def check_capacity(self, cache_scope: str = "", max_queued: int | None = None,
                       count: int = 1) -> None:
        """Refuse when the queue is closed (``shutting_down``), full (``queue_full``) or holds
        this scope's share already (429 ``tenant_queue_full``; ``max_queued``: the scope's
        own cap, else the configured one). ``submit`` decides under its lock; callers ask
        first to refuse before the costly part (``InferenceCore`` before tokenizing)."""
        with self.lock:
            if not self._admitting:
                raise Refusal(errors.SHUTTING_DOWN, "the scheduler is shutting down")
            if len(self._waiting) + count > self.config.max_queue:
                self.counters["refused_queue_full"] += 1
                raise Refusal(
                    errors.QUEUE_FULL,
                    f"the queue is full ({self.config.max_queue} waiting)",
                    max_queue=self.config.max_queue,
                )
            cap = max_queued if max_queued is not None else self.config.max_queue_per_scope
            waiting = self._waiting.count(cache_scope)
            if cap is not None and waiting + count > cap:
                self.counters["refused_tenant_queue_full"] += 1
                raise Refusal(
                    errors.TENANT_QUEUE_FULL,
                    f"this tenant already has {waiting} requests waiting (at most {cap}); "
                    "retry when some have started",
                    max_queued=cap,
                    retry_after_s=1,
                )

    def submit(self, request: Request) -> None:
        """Queue a request or raise ``Refusal`` (a duplicate id, the caps of
        ``check_capacity``, an empty prompt, too many tokens, a sampler the engine refuses).
        Its events go to ``on_event``."""
        n_prompt = len(request.prompt_tokens)
        if n_prompt == 0:
            raise Refusal(errors.EMPTY_PROMPT, "the prompt is empty", param="prompt")
        max_tokens = self._max_tokens_for(request.params, n_prompt)
        sampler = self.engine.new_sampler(request.params)  # compiles a grammar: not under the lock
        continued = list(request.continuation.tokens) if request.continuation else []
        text = TextStream(request.params.stop)
        try:
            if continued:
                replayed = "".join(text.feed(self.engine.token_bytes(t)) for t in continued)
                if replayed != request.continuation.text:  # the client's text is the truth
                    log.warning("request %s: the continued tokens do not give the text sent",
                                request.id)
                sampler.replay(continued)
        except BaseException:
            sampler.close()
            raise
        req = RequestState(
            id=request.id,
            prompt=list(request.prompt_tokens) + continued,
            params=request.params,
            max_tokens=max_tokens,
            sampler=sampler,
            cache_scope=request.cache_scope,
            cache_prompt=self.config.cache_prompt
            if request.cache_prompt is None
            else request.cache_prompt,
            session=request.session,
            arrival=request.arrival if request.arrival is not None else self._clock(),
            blocks=math.ceil((n_prompt + max_tokens) / self.config.kv_block_tokens),
            text=text,
            output=continued,
            continued_tokens=len(continued),
            deadline=request.deadline,
            keep_tokens=request.keep_tokens,
            adapter=request.adapter,
        )
        try:
            with self.lock:
                if request.id in self._requests:
                    raise Refusal(errors.DUPLICATE_ID, f"request id {request.id} is already in use")
                self.check_capacity(tenant_of(request.cache_scope), request.max_queued)
                self._requests[req.id] = req
                self._waiting.push(req.tenant, req)
                self.counters["submitted"] += 1
        except BaseException:  # a refusal, or a bug: the native sampler is freed either way
            sampler.close()
            raise
        self._work.set()

    def cancel(self, request_id: str, block: bool = True) -> bool | None:
        """Ask for a request to end with ``cancelled`` at the next tick. False if unknown.
        ``block=False`` never waits for the lock (a stuck loop holds it): when it is taken,
        the cancel is left for the next plan to apply and the answer is None (not known)."""
        if not self.lock.acquire(blocking=block):
            # deque.append: atomic, no lock; the plan being made, if any, checks it at its end
            self._deferred_cancels.append(request_id)
            self._work.set()
            return None
        try:
            if request_id not in self._requests:
                return False
            self._cancels.add(request_id)
            if request_id in self._in_flight:
                self.engine.abort_requested = True
        finally:
            self.lock.release()
        self._work.set()
        return True

    def hand_back(self, waiting_only: bool = False) -> list[str]:
        """Drop requests without an end (a daemon stopping: at once those still waiting,
        past its grace the rest): slots, blocks and samplers are freed and no event is
        emitted; the jobs stay pending in Redis for another daemon to serve or continue.
        Returns their ids."""
        with self.lock:
            dropped = [r for r in self._requests.values()
                       if not waiting_only or r.status is Status.WAITING]
            for req in dropped:
                del self._requests[req.id]
                self._cancels.discard(req.id)
                if req.slot is not None:
                    # its KV stays a cached prefix (a decode in flight commits its row to
                    # it under this lock): the disk tier saves it at shutdown
                    self._release(req.slot, keep_cache=req.cache_prompt)
                    self._used_blocks -= req.blocks
                    req.slot = None
                else:
                    self._unqueue(req)
                req.sampler.close()
        return [req.id for req in dropped]

    def stop_admitting(self) -> None:
        """Refuse new requests from now on (drain)."""
        with self.lock:
            self._admitting = False

    def cancel_all(self) -> None:
        """Cancel every queued and running request."""
        with self.lock:
            for request_id in list(self._requests):
                self.cancel(request_id)

    def fail_all(
        self, code: str = errors.ENGINE_ERROR, message: str = "the scheduler failed"
    ) -> None:
        """End every request with an error (after a bug in a tick; never leave callers hanging)."""
        with self.lock:
            self._cancels.clear()
            for req in list(self._requests.values()):
                if req.slot is not None:
                    self._forget(req.slot)
                self._finish(req, Status.FINISHED_ERROR, {"code": code, "message": message})

    def fail_tick(self, exc: BaseException) -> int:
        """After a tick raised: fail the requests of its batch (one of them is the likely
        cause); returns how many. The loop decides when the engine itself is unusable."""
        with self.lock:
            rows, self.tick_rows = self.tick_rows, []
            self._in_flight = set()
            return sum(self.fail_request(request_id, exc) for request_id in rows)

    def evict_scope(self, cache_scope: str) -> int:
        """Forget one scope's cached prefixes in idle slots and the RAM tier; returns how
        many entries went. Slots still serving a request of that scope are left alone."""
        with self.lock:
            known = {s.scope for s in self._slots if s.scope is not None}
            for tier in (self.cache.ram, self.cache.disk):
                if tier is not None:
                    known.update(e.cache_scope for e in tier.entries())
            scopes = tenant_scopes(cache_scope, known | {cache_scope})  # its adapters' too
            idle = [
                s
                for s in self._slots
                if s.state is SlotState.IDLE and s.scope in scopes and s.tokens
            ]
            for slot in idle:
                self._forget(slot)
            evicted = len(idle)
            for scope in scopes:
                self.cache.forget_parked(scope)  # parked during a decode: never saved
                if self.cache.ram is not None:
                    evicted += self.cache.ram.evict_scope(scope)
                if self.cache.disk is not None:
                    evicted += self.cache.disk.evict_scope(scope)
            return evicted

    def slots(self) -> list[Slot]:
        """The slots (read or change them on the loop thread, or with the lock held once the
        loop has ended)."""
        return self._slots

    def request_ids(self) -> set[str]:
        """Requests queued or running."""
        with self.lock:
            return set(self._requests)

    def wake(self) -> None:
        """Let the loop run a tick now."""
        self._work.set()

    def has_work(self) -> bool:
        with self.lock:
            return bool(self._requests or self._cancels)

    def wait_for_work(self, timeout: float) -> None:
        """Block the loop thread until something is submitted or cancelled."""
        if self._work.wait(timeout):
            self._work.clear()

    def snapshot(self, wait_s: float = -1) -> dict[str, Any] | None:
        """Slots, queue and counters as plain data. Never any prompt or output text.
        ``wait_s``: how long to wait for the lock (None when it stays taken: a stuck loop
        holds it; -1 waits as long as it takes)."""
        now = self._clock()
        if not self.lock.acquire(timeout=wait_s):
            return None
        try:
            return {
                "slots": [self._slot_info(s) for s in self._slots],
                "queue": [
                    {
                        "request_id": j.id,
                        "cache_scope": j.cache_scope,
                        "prompt_tokens": len(j.prompt),
                        "max_tokens": j.max_tokens,
                        "age_ms": round((now - j.arrival) * 1000, 1),
                    }
                    for j in self._waiting
                ],
                # out of their slots for another tenant's turn, their KV saved (or to recompute)
                "preempted": [
                    {
                        "request_id": r.id,
                        "cache_scope": r.cache_scope,
                        "prompt_tokens": len(r.prompt),
                        "output_tokens": len(r.output),
                        "max_tokens": r.max_tokens,
                    }
                    for r in self._preempted
                ],
                "kv": {
                    "block_tokens": self.config.kv_block_tokens,
                    "blocks_total": self._total_blocks,
                    "blocks_used": self._used_blocks,
                    "n_ctx": self.engine.n_ctx,
                },
                "admitting": self._admitting,
                "counters": dict(self.counters),
                "cache": {**self.cache.summary(), "entries": self.cache.entries(self._slots, now)},
            }
        finally:
            self.lock.release()

    # -- the loop thread ----------------------------------------------------------

    def step(self) -> TickStats | None:
        """One tick: wait for a burst's arrivals, plan (cancels, admission, the batch),
        decode, commit. None when nothing was decoded (no rows, an aborted or failed
        decode)."""
        self.await_arrivals()
        return self.run(self.schedule())

    def await_arrivals(self) -> float:
        """Before a tick is planned (loop thread, outside the lock): while ``arrivals``
        says requests are on their way and the slots left free by the queue would take
        them, wait for them to be submitted, at most ``arrival_wait_s``; returns the
        seconds waited. A burst taken together is then admitted and prefilled together,
        as llama-server's first batch holds every slot its requests reached; one that
        arrives alone waits for nothing."""
        if self.arrivals is None or self.config.arrival_wait_s <= 0:
            return 0.0
        if self.config.prompts_per_tick:  # the tick could not finish theirs: no wait
            return 0.0
        start = self._clock()
        deadline = start + self.config.arrival_wait_s
        while self.arrivals() > 0 and self._room_for_arrivals():
            left = deadline - self._clock()
            if left <= 0:
                self.counters["arrival_wait_timeouts"] += 1
                break
            self._work.wait(min(left, ARRIVAL_POLL_S))  # a submit sets it
            self._work.clear()
        waited = self._clock() - start
        if waited > ARRIVAL_POLL_S / 2:
            self.counters["arrival_waits"] += 1
        return waited

    def _room_for_arrivals(self) -> bool:
        """Whether the tick would hold new prompts alone (no slot is decoding or part-way
        through a prompt: waiting delays no running stream) and a free slot would be left
        empty by what is queued (waiting or preempted) now."""
        with self.lock:
            if any(s.state is not SlotState.IDLE for s in self._slots):
                return False  # a burst's first tick only, never a running stream's
            return len(self._slots) > len(self._waiting) + len(self._preempted)

    def schedule(self) -> TickPlan:
        """Apply the cancels, admit what fits, and plan the batch within ``N_BATCH``. The
        plan's rows are in flight until ``run(plan)``: call it next (on the loop thread)."""
        if self.adapters is not None and self.adapters.retiring:
            self.retire_adapters()
        with self.lock:
            self._loop_thread = threading.get_ident()
            self._apply_kv_forgets()
            self.engine.abort_requested = False
            plan = TickPlan(self._tick + 1, self.engine.n_batch)
            plan.cancelled = self._apply_cancels()
            self._admit(plan)
            if self._preempt_for_waiting(plan):
                self._admit(plan)
            self._plan_batch(plan)
            if self._in_flight.intersection(self._deferred_cancels):
                self.engine.abort_requested = True  # cancelled while this plan was made
            return plan

    def run(self, plan: TickPlan) -> TickStats | None:
        """Decode ``plan`` and commit the results. Under KV pressure it re-plans: first
        without idle slots' cached prefixes, then with half the tokens, then the request
        holding the most KV fails alone. Then a state the tick's admissions parked is saved
        (its first tokens are out by then: the save is off their TTFT)."""
        try:
            return self._run(plan)
        finally:
            if self.cache.parked or self.cache.persisting:
                with self.lock:
                    self.cache.settle()
                    self.cache.persist()

    def _run(self, plan: TickPlan) -> TickStats | None:
        t0 = self._clock()
        retries, purged = 0, False
        while plan.rows:
            if plan.group != self._group:  # llama.cpp applies adapters per context
                self.engine.use_adapters(plan.adapter_set)
                self._group = plan.group
                self.counters["adapter_switches"] += 1
            t_decode = self._clock()
            rc = self.engine.decode(
                plan.batch, abortable=plan.n_tokens >= self.config.abort_min_tokens
            )
            eval_ms = (self._clock() - t_decode) * 1000
            with self.lock:
                self._in_flight = set()
                if rc == DECODE_OK:
                    stats = self._commit(plan, eval_ms, retries)
                    break
                self.tick_rows = []
                if rc == DECODE_ABORTED:
                    self.counters["aborted_decodes"] += 1
                    self._rollback(plan)
                    return None
                if rc != DECODE_KV_FULL:
                    self._fail_plan(plan, rc)
                    return None
                retries += 1
                self.counters["kv_pressure"] += 1
                budget = plan.token_budget
                if not purged and self._purge_idle():
                    purged = True
                elif plan.n_tokens > 1:
                    budget = max(1, plan.n_tokens // 2)
                    log.info("KV cache full: retrying with a batch of %d tokens", budget)
                else:
                    if self.on_kv_pressure is not None:
                        self.on_kv_pressure(plan.tick, retries, "fail_largest", plan.n_tokens, 0)
                    self._fail_largest()
                    return None
                if self.on_kv_pressure is not None:
                    remedy = "purge_idle" if budget == plan.token_budget else "halve_batch"
                    self.on_kv_pressure(plan.tick, retries, remedy, plan.n_tokens, budget)
                plan = self._replan(plan, budget)
                if self._cancels & self._in_flight:  # a cancel arrived during the decode
                    self._in_flight, self.tick_rows = set(), []
                    return None
        else:
            return None
        log.debug("tick %s (%.1f ms)", stats, (self._clock() - t0) * 1000)
        if self._on_tick is not None:
            self._on_tick(stats)
        return stats

    # -- policy pieces (lock held) ------------------------------------------------

    def _max_tokens_for(self, params: SamplingParams, n_prompt: int) -> int:
        """The tokens the request may generate, or ``Refusal`` when prompt + max_tokens can
        never fit: past ``n_ctx``, ``context_length_exceeded``; within it but past what one
        request may reserve of the KV block budget (``max_request_tokens``: the budget and
        a scope's share of it), ``device_memory_budget_exceeded``. Both priced in KV bytes
        (``kv_bytes_per_token`` x tokens). Without max_tokens: the default, cut to the room
        left, at least one token."""
        limit = self.max_request_tokens
        room = limit - n_prompt
        wanted = (
            params.max_tokens
            if params.max_tokens is not None
            else max(1, min(self.config.default_max_tokens, room))
        )
        needed = n_prompt + wanted
        if needed <= limit:
            return wanted
        n_ctx = self.engine.n_ctx
        per_token = self.engine.kv_bytes_per_token
        if needed > n_ctx:
            self.counters["refused_context_length"] += 1
            code, limit = errors.CONTEXT_LENGTH_EXCEEDED, n_ctx
            over = f"the {n_ctx}-token context"
            if self.max_request_tokens < n_ctx:
                over += f" (one request may reserve at most {self.max_request_tokens} of its KV)"
        else:
            self.counters["refused_device_memory_budget"] += 1
            code = errors.DEVICE_MEMORY_BUDGET_EXCEEDED
            budget = self._total_blocks * self.config.kv_block_tokens
            over = f"the {limit} tokens of KV memory one request may reserve (" + (
                f"one tenant's share of the {budget}-token KV budget)"
                if self._scope_blocks < self._total_blocks else "the KV budget)")
        raise Refusal(
            code,
            f"this request needs {n_prompt} prompt tokens + {wanted} max_tokens = {needed} "
            f"tokens of KV ({needed * per_token} bytes at {per_token} bytes a token), more "
            f"than {over}: {limit * per_token} bytes",
            param="max_tokens" if n_prompt < self.max_request_tokens else "prompt",
            prompt_tokens=n_prompt,
            max_tokens=wanted,
            limit=limit,
            kv_bytes_per_token=per_token,
            estimated_bytes=needed * per_token,
            limit_bytes=limit * per_token,
        )

    def _apply_cancels(self) -> list[str]:
        """End every request cancelled since the last tick, then every one past its
        deadline (``_expire``); returns their ids."""
        while self._deferred_cancels:  # cancels that found the lock taken
            self._cancels.add(self._deferred_cancels.popleft())
        cancels, self._cancels = self._cancels, set()
        ended = []
        for request_id in cancels:
            req = self._requests.get(request_id)
            if req is None:
                continue
            ended.append(request_id)
            try:
                self._finish(req, Status.FINISHED_CANCELLED)
            except Exception as exc:
                self.fail_request(request_id, exc)
        return ended + self._expire()

    def _expire(self) -> list[str]:
        """End every request past its deadline with ``timeout``, queued, prefilling or
        generating: the text it made is sent (and billed), its slot and KV are freed."""
        now = self._clock()
        late = [r for r in self._requests.values() if r.deadline is not None and now >= r.deadline]
        error = {"code": errors.TIMEOUT, "message": "The request ran past its deadline "
                 "(timeout); the output it produced until then was sent."}
        for req in late:
            self.counters["timeouts"] += 1
            try:
                self._finish(req, Status.FINISHED_ERROR, dict(error))
            except Exception as exc:
                self.fail_request(req.id, exc)
        return [r.id for r in late]

    def _admit(self, plan: TickPlan) -> None:
        """Round-robin across cache scopes (tenants), strict FIFO within each: the head is the
        oldest request of the scope whose turn it is; it waits for blocks and a slot and nobody
        overtakes it, except a session's request onto its own free slot, at most
        ``session_max_bypass`` times per head. One scope's burst delays another scope's next
        request by at most one admission per other scope with waiting work. A preempted
        request takes a slot back before the head unless the head's scope holds fewer slots
        (``_next_resume``). The ids go to ``plan.admitted`` and ``plan.resumed``, in order."""
        while self._waiting or self._preempted:
            req = self._head()
            resume = self._next_resume(req)
            if resume is not None:
                fits = self._used_blocks + resume.blocks <= self._total_blocks
                slot = self._choose_slot(resume) if fits else None
                if slot is None:
                    break
                plan.resumed.append(resume.id)
                self._resume_or_fail(resume, slot)
                continue
            if req is None:
                break  # every scope with waiting work is at its KV share
            bypass = self._admit_session(req)
            if bypass is not None:
                plan.admitted.append(bypass.id)
                continue
            if self._used_blocks + req.blocks > self._total_blocks:
                break
            slot = self._choose_slot(req)
            if slot is None:
                break
            self._waiting.take(req.tenant, req)
            plan.admitted.append(req.id)
            self._assign_or_fail(req, slot)

    def _next_resume(self, head: RequestState | None) -> RequestState | None:
        """The preempted request the next slot goes to: of the scope holding the fewest slots
        (the oldest preemption first), within its scope's KV share, unless ``head`` (the
        queue's next) belongs to a scope holding fewer slots still. None: the head goes."""
        if not self._preempted:
            return None
        running, held = self._scope_slots(), self._scope_held()
        fits = [r for r in self._preempted if held[r.tenant] + r.blocks <= self._scope_blocks]
        if not fits:
            return None
        best = min(fits, key=lambda r: running[r.tenant])  # ties: the oldest preemption
        if head is not None and running[head.tenant] < running[best.tenant]:
            return None
        return best

    def _scope_slots(self) -> Counter[str]:
        """Slots held by each scope's running requests."""
        return Counter(s.request.tenant for s in self._slots if s.request is not None)

    def _preempt_for_waiting(self, plan: TickPlan) -> bool:
        """While another scope's request waits and no slot is free, one generating request
        of a scope over its fair share of the slots leaves its slot (``_preempt``). Fair
        shares are max-min fair on whole slots: a scope is over its share while it holds at
        least two slots more than a scope with a request waiting (each move evens them out,
        so nothing goes back and forth). The victim has generated ``preempt_min_tokens``
        since it got its slot, and the waiting request fits the KV budget once the victim's
        blocks are back; among those, the latest arrival of the scope holding the most
        slots. At most one a tick; True if one was preempted (the caller admits again)."""
        if not self.config.preemption or any(s.state is SlotState.IDLE for s in self._slots):
            return False
        head = self._head()
        waiting = self._next_resume(head) or head
        if waiting is None:
            return False
        running = self._scope_slots()
        least = running[waiting.tenant] + 2
        eligible = [
            s.request
            for s in self._slots
            if s.state is SlotState.GENERATING
            and running[s.request.tenant] >= least
            and len(s.request.output) - s.request.run_start_tokens
            >= self.config.preempt_min_tokens
            and self._used_blocks - s.request.blocks + waiting.blocks <= self._total_blocks
        ]
        if not eligible:
            return False
        victim = max(eligible, key=lambda r: (running[r.tenant], r.arrival))
        self._preempt(victim)
        plan.preempted.append(victim.id)
        return True

    def _preempt(self, req: RequestState) -> None:
        """Take a generating request out of its slot: its KV saved to the RAM tier as its own
        (``PrefixCache.swap_out``; when it does not fit, recomputed at its resume), the slot's
        cells freed, its blocks returned. Its sampler, text stream, output, unsent tokens and
        logprobs, and deadline stay with it: it resumes exactly where it stopped."""
        slot = req.slot
        saved = self.cache.swap_out(req, slot)
        req.refill = req.prompt + req.output
        slot.request, slot.state, slot.last_used = None, SlotState.IDLE, self._clock()
        self._forget(slot)
        self._used_blocks -= req.blocks
        req.slot, req.status = None, Status.PREEMPTED
        self._preempted.append(req)
        self.counters["preemptions"] += 1
        log.info("request %s (scope %s) preempted after %d tokens; state %s", req.id,
                 req.cache_scope, len(req.output), "saved" if saved else "to recompute")

    def _resume_or_fail(self, req: RequestState, slot: Slot) -> None:
        """A preempted request back in a slot (``PrefixCache.resume``): it prefills what its
        slot lacks of prompt + output (one token after a restore), then samples on."""
        self._preempted.remove(req)
        try:
            self.cache.resume(req, slot, self._slots)
        except Exception as exc:  # a bug: this request alone fails, never the tick
            self._forget(slot)
            log.error("request %s could not resume: %r", req.id, exc, exc_info=exc)
            self.counters["request_failures"] += 1
            self._drop(req, {"code": errors.ENGINE_ERROR, "message": "this request failed"})
            return
        slot.request, slot.state = req, SlotState.PREFILLING
        slot.session = req.session if req.cache_prompt else None
        req.slot, req.status = slot, Status.PREFILLING
        req.run_start_tokens = len(req.output)
        self._used_blocks += req.blocks
        self.counters["resumes"] += 1

    def _unqueue(self, req: RequestState) -> None:
        """Take a request that holds no slot out of where it waits: the queue, or the
        preempted list (its saved state dropped)."""
        if req in self._preempted:
            self._preempted.remove(req)
            self.cache.drop_owned(req.id)
        elif req in self._waiting:
            self._waiting.remove(req.tenant, req)

    def _assign_or_fail(self, req: RequestState, slot: Slot) -> None:
        """``_assign``; a failure there (restoring a cached prefix...) fails this request alone
        and leaves the slot empty."""
        try:
            self._assign(req, slot)
        except Exception as exc:
            if slot.request is not req:  # failed before taking the slot: drop what prepare left
                self._forget(slot)
            log.error("request %s could not start: %r", req.id, exc, exc_info=exc)
            self.counters["request_failures"] += 1
            error = {"code": errors.ENGINE_ERROR, "message": "this request failed to start"}
            self._drop(req, error)

    def _head(self) -> RequestState | None:
        """The oldest waiting request of the scope holding the fewest slots (ties: the first
        in turn order) among those whose running requests leave room for it within the
        scope's KV share (None: no such scope)."""
        held, running = self._scope_held(), self._scope_slots()
        best = None
        for scope, req in self._waiting.heads():
            fits = held[scope] + req.blocks <= self._scope_blocks
            if fits and (best is None or running[scope] < running[best.tenant]):
                best = req
        return best

    def _scope_held(self) -> Counter[str]:
        """KV blocks reserved by each scope's running requests."""
        held: Counter[str] = Counter()
        for slot in self._slots:
            if slot.request is not None:
                held[slot.request.tenant] += slot.request.blocks
        return held

    def _admit_session(self, head: RequestState) -> RequestState | None:
        """A queued request whose session's slot is free takes it now, ahead of ``head``, if
        the KV budget allows; returns it (None: nobody went ahead)."""
        if head.passed_over >= self.config.session_max_bypass:
            return None  # this head has been passed over enough: it goes next
        pinned = {
            (s.scope, s.session): s
            for s in self._slots
            if s.state is SlotState.IDLE and s.session is not None
        }
        if not pinned:
            return None
        held = self._scope_held()
        for req in self._waiting:
            slot = pinned.get((req.cache_scope, req.session))
            fits = (
                self._used_blocks + req.blocks <= self._total_blocks
                and held[req.tenant] + req.blocks <= self._scope_blocks
            )
            if req is not head and slot is not None and req.cache_prompt and fits:
                self._waiting.take(req.tenant, req)
                head.passed_over += 1
                self.counters["session_bypasses"] += 1
                self._assign_or_fail(req, slot)
                return req
        return None

    def _choose_slot(self, req: RequestState) -> Slot | None:
        """The session's own free slot; else, among free slots (those pinned to a session only
        if no other is free), the one whose same-scope cached prefix is longest if it covers
        > 10% of the prompt; else an empty slot; else the least recently used."""
        free = [s for s in self._slots if s.state is SlotState.IDLE]
        if not free:
            return None
        if req.cache_prompt and req.session is not None:
            for s in free:
                if (s.scope, s.session) == (req.cache_scope, req.session):
                    return s
        free = [s for s in free if s.session is None] or free
        if req.cache_prompt:
            scoped = [
                (common_prefix_len(s.tokens, req.prompt), -len(s.tokens), s)
                for s in free
                if s.scope == req.cache_scope and s.tokens
            ]
            if scoped:
                n, _, best = max(scoped, key=lambda m: m[:2])  # ties: the one that loses the least
                if n > 0.1 * len(req.prompt):
                    return best
        return min(free, key=lambda s: (bool(s.tokens), s.last_used))

    def _assign(self, req: RequestState, slot: Slot) -> None:
        self.cache.prepare(req, slot, self._slots)  # sets req.cached_tokens and slot.tokens/scope
        slot.request, slot.state = req, SlotState.PREFILLING
        slot.session = req.session if req.cache_prompt else None
        req.slot, req.status = slot, Status.PREFILLING
        req.t_started = self._clock()
        req.run_start_tokens = len(req.output)
        self._used_blocks += req.blocks

    def _plan_batch(self, plan: TickPlan, group: str | None = None) -> None:
        """Fill ``plan.rows``: a decode row for every generating slot first, then prefill
        chunks round-robin among prefilling slots (each at most ``chunk_size``), all within
        ``plan.token_budget`` tokens. The rows are then in flight (a cancel aborts them).
        Only one adapter group's slots (``_next_group``, or ``group``) share the batch."""
        budget = plan.token_budget
        used = 0
        plan.group = self._next_group() if group is None else group
        active = [s for s in self._slots
                  if s.request is not None and s.request.group == plan.group]
        if plan.group and active:
            use = active[0].request.adapter
            plan.adapter_set = [(use.handle, use.scale)]
        for slot in active:
            if slot.state is SlotState.GENERATING and used < budget:
                req = slot.request
                row = BatchRow(slot.seq_id, (req.output[-1],), len(slot.tokens), True)
                plan.rows.append(PlannedRow(Phase.DECODE, row, req, slot))
                used += 1
        n = len(self._slots)
        prefilling = sorted(
            (s for s in active if s.state is SlotState.PREFILLING),
            key=lambda s: (s.seq_id - self._rr_next) % n,
        )
        if prefilling:
            self._rr_next = (prefilling[0].seq_id + 1) % n
        finishers = self._finishers(prefilling, budget - used)
        for slot in prefilling:
            room = budget - used
            if room <= 0:
                break
            req = slot.request
            if req.cache_prompt and self.config.cross_slot and req.refill is None:
                self.cache.catch_up(req, slot, self._slots)
                if self._computed_by_another(req, len(slot.tokens), plan.rows):
                    plan.deferred.append(req.id)
                    continue
            fill, done = req.fill_tokens, len(slot.tokens)
            take = min(self.config.chunk_size, room, len(fill) - done)
            last = done + take == len(fill)
            if last and finishers is not None and req.id not in finishers:
                continue  # its prompt finishes in a later tick
            row = BatchRow(slot.seq_id, fill[done : done + take], done, last)
            plan.rows.append(PlannedRow(Phase.PREFILL, row, req, slot))
            used += take
        self._in_flight = plan.request_ids
        self.tick_rows = list(self._in_flight)
        self.last_plan = plan

    def _finishers(self, prefilling: list[Slot], room: int) -> set[str] | None:
        """The requests whose prompts may finish this tick (``prompts_per_tick`` of those
        that could, the oldest arrivals first); None: no limit."""
        limit = self.config.prompts_per_tick
        if not limit:
            return None
        could = [s.request for s in prefilling
                 if len(s.request.fill_tokens) - len(s.tokens) <= min(self.config.chunk_size,
                                                                      room)]
        return {r.id for r in sorted(could, key=lambda r: r.arrival)[:limit]}

    def _next_group(self) -> str:
        """The adapter group whose turn it is. Turns go in rounds: in a round every turn
        unit with work decodes once (the base model's group is a unit; a tenant's adapter
        groups, its adapters and scales, are one unit between them), whatever its number of
        rows, so a flood on one adapter delays another unit's requests by at most one turn
        per unit with work. Within a round, the group whose oldest request waiting for its
        first token arrived first goes first (a burst's prefills in arrival order, not in a
        fixed rotation that would favour the same groups round after round); groups only
        decoding follow, the one whose last turn is the oldest first."""
        active = [s.request for s in self._slots
                  if s.request is not None and s.state is not SlotState.IDLE]
        owners = {r.group: r.tenant for r in active}
        if len(owners) <= 1:
            group = next(iter(owners), self._group)
        else:
            def unit(g: str) -> str:
                return f"tenant:{owners[g]}" if g else ""

            units = {unit(g) for g in owners}
            if not units - self._round_served:  # every unit with work had its turn
                self._round_served = set()
            waiting: dict[str, float] = {}
            for r in active:
                if r.status is Status.PREFILLING:
                    waiting[r.group] = min(waiting.get(r.group, math.inf), r.arrival)
            group = min((g for g in owners if unit(g) not in self._round_served),
                        key=lambda g: (waiting.get(g, math.inf), self._group_turns.get(g, -1),
                                       self.group_tokens[g], g))
            self._round_served.add(unit(group))
        self._group_turns[group] = self._tick
        if len(self._group_turns) > 4 * len(self._slots):  # groups gone idle: forgotten
            self._group_turns = {g: t for g, t in self._group_turns.items() if g in owners}
            self.group_tokens = Counter({g: self.group_tokens[g] for g in owners})
        return group

    def adapters_in_use(self) -> set[str]:
        """The adapter ids of the requests held here (waiting, preempted or running)."""
        with self.lock:
            return {r.adapter.id for r in self._requests.values() if r.adapter is not None}

    def retire_adapters(self) -> None:
        """Free the adapters the registry retires (loop thread, outside the lock: the
        registry's lock is taken before this one by a preparing thread), never while a
        load runs (both change the model's set of adapters); the context first stops
        applying any adapter, so no freed handle stays set on it."""
        if not self.adapters.load_lock.acquire(blocking=False):
            return  # a load runs on a preparing thread: freed at a later turn
        try:
            handles = self.adapters.retire(self.adapters_in_use())
            if handles:
                if self._group:
                    self.engine.use_adapters([])
                    self._group = ""
                for handle in handles:
                    self.engine.free_adapter(handle)
        finally:
            self.adapters.load_lock.release()

    def _replan(self, plan: TickPlan, token_budget: int) -> TickPlan:
        """The same tick's batch planned again within ``token_budget`` (KV pressure)."""
        again = TickPlan(plan.tick, token_budget, admitted=plan.admitted, cancelled=plan.cancelled,
                         preempted=plan.preempted, resumed=plan.resumed)
        self._plan_batch(again, plan.group)
        return again

    @staticmethod
    def _computed_by_another(req: RequestState, done: int, rows: list[PlannedRow]) -> bool:
        """Whether a prefill row already in this tick computes the next tokens of the prompt."""
        for p in rows:
            leads = p.phase is Phase.PREFILL and p.slot.scope == req.cache_scope
            if leads and p.row.pos0 <= done:
                end = p.row.pos0 + len(p.row.tokens)
                shared = min(common_prefix_len(p.request.fill_tokens, req.prompt), end)
                if shared - done >= SHARED_PREFILL_MIN_TOKENS:
                    return True
        return False

    def _commit(self, plan: TickPlan, eval_ms: float, retries: int) -> TickStats:
        """Apply a decoded plan: each slot's KV now holds its row, and every row with logits
        is sampled (its request's own sampler, by batch index)."""
        now = self._clock()
        offset = 0
        for p in plan.rows:
            offset += p.n_tokens
            p.slot.tokens.extend(p.row.tokens)
            if p.row.logits and self._requests.get(p.request_id) is p.request:
                self._sample_row(p.request, offset - 1, now)
        self._tick += 1
        self.counters["ticks"] += 1
        self.tick_rows = []
        n_tokens = plan.n_tokens
        self.group_tokens[plan.group] += n_tokens
        if plan.group and self.adapters is not None:
            self.adapters.count_tokens(plan.rows[0].request.adapter.id, n_tokens)
        decode_tokens = len(plan.decoding())
        return TickStats(
            tick=self._tick,
            batch_tokens=n_tokens,
            decode_tokens=decode_tokens,
            prefill_tokens=n_tokens - decode_tokens,
            active_slots=sum(s.state is not SlotState.IDLE for s in self._slots),
            queue_depth=len(self._waiting),
            eval_ms=round(eval_ms, 3),
            kv_retries=retries,
        )

    def _sample_row(self, req: RequestState, batch_index: int, now: float) -> None:
        """Sample and take one request's next token; whatever fails here fails that
        request alone (its sampler, its grammar, its text decoding, its stop strings)."""
        self.sampling = req.id
        if self.on_sampling is not None:
            self.on_sampling(True)
        try:
            token = req.sampler.sample(batch_index)
            self.sampling = None
            if self.on_sampling is not None:
                self.on_sampling(False)
            logprob = None
            if req.params.logprobs is not None:  # only requests that ask pay for it
                logprob = self.engine.token_logprobs(batch_index, token, req.params.logprobs)
            self._on_token(req, token, now, logprob)
        except GrammarEnded:
            self._note_first_token(req, now)
            self._finish(req, Status.FINISHED_STOPPED)
        except Exception as exc:
            self.fail_request(req.id, exc)
        finally:
            if self.sampling is not None and self.on_sampling is not None:
                self.on_sampling(False)
            self.sampling = None

    def fail_request(self, request_id: str, exc: BaseException) -> bool:
        """End one request with ``engine_error`` after a failure tied to it; its slot and KV
        are freed and every other request carries on. False if it had already ended."""
        with self.lock:
            req = self._requests.get(request_id)
            if req is None:
                return False
            if isinstance(exc, RowFailed) and exc.param:  # the request's own fault
                log.info("request %s failed alone: %s", request_id, exc)
            else:
                log.error("request %s failed alone: %r", request_id, exc, exc_info=exc)
            self.counters["request_failures"] += 1
            error = {"code": errors.ENGINE_ERROR, "message": "this request failed in the engine"}
            if isinstance(exc, RowFailed):
                error = {"code": exc.code, "message": str(exc), "param": exc.param}
            try:
                self._finish(req, Status.FINISHED_ERROR, error)
            except Exception:
                log.exception("ending request %s failed; dropping it", request_id)
                self._drop(req, error)
            return True

    def _drop(self, req: RequestState, error: dict[str, Any]) -> None:
        """The last resort when ``_finish`` itself failed: forget the request, free what it
        held, still send its end (no text tail: decoding it is what may have failed)."""
        self._requests.pop(req.id, None)
        if req.slot is None:
            self._unqueue(req)
        if req.slot is not None and req.slot.request is req:
            req.slot.request, req.slot.state = None, SlotState.IDLE
            self._forget(req.slot)
            self._used_blocks -= req.blocks
        req.slot = None
        try:
            req.sampler.close()
        except Exception:
            log.exception("closing the sampler of %s failed", req.id)
        req.status = Status.FINISHED_ERROR
        self._emit(FinishedEvent(req.id, "error", self._stats(req, self._clock()), error=error))

    def _note_first_token(self, req: RequestState, now: float) -> None:
        """A token sampled at the end of a prefill (the prompt's, or a resume's refill)."""
        if req.t_first_token is None:
            req.t_first_token = now
        if req.status is Status.PREFILLING:
            req.status = Status.GENERATING
            req.slot.state = SlotState.GENERATING
            req.refill = None

    def _on_token(self, req: RequestState, token: int, now: float,
                  logprob: dict[str, Any] | None = None) -> None:
        self._note_first_token(req, now)
        if not req.params.ignore_eos and self.engine.is_eog(token):
            self._finish(req, Status.FINISHED_STOPPED)
            return
        req.output.append(token)
        if logprob is not None:
            req.logprobs.append(logprob)
        req.unsent_tokens += 1
        text = req.text.feed(self.engine.token_bytes(token))
        if text:
            self._emit(TokenEvent(req.id, text, req.unsent_tokens, self._unsent(req),
                                  self._unsent_logprobs(req)))
            req.unsent_tokens = 0
        if req.text.stopped_by is not None:
            self._finish(req, Status.FINISHED_STOPPED)
        elif len(req.output) >= req.max_tokens:
            self._finish(req, Status.FINISHED_LENGTH)

    @staticmethod
    def _unsent(req: RequestState) -> tuple[int, ...]:
        return tuple(req.output[len(req.output) - req.unsent_tokens:]) if req.unsent_tokens else ()

    @staticmethod
    def _unsent_logprobs(req: RequestState) -> tuple[dict[str, Any], ...]:
        """The logprobs entries not sent yet (the list keeps only those: a long request
        asking 20 alternatives must not hold megabytes of them)."""
        if not req.logprobs:
            return ()
        out = tuple(req.logprobs)
        req.logprobs.clear()
        return out

    def _finish(
        self, req: RequestState, status: Status, error: dict[str, Any] | None = None
    ) -> None:
        """End a request wherever it is: free its slot and blocks, send the tail and the end."""
        now = self._clock()
        req.status = status
        if req.slot is not None:
            self._release(req.slot, keep_cache=req.cache_prompt and error is None)
            self._used_blocks -= req.blocks
        else:
            self._unqueue(req)
        tail = req.text.flush()
        if tail or req.unsent_tokens:
            self._emit(TokenEvent(req.id, tail, req.unsent_tokens, self._unsent(req),
                                  self._unsent_logprobs(req)))
        req.sampler.close()
        del self._requests[req.id]
        stats = self._stats(req, now)
        reason = FINISH_REASON[status]
        self.counters[f"finished_{reason}"] += 1
        self.counters["prompt_tokens"] += stats.prompt_tokens
        self.counters["cached_tokens"] += stats.cached_tokens
        self.counters["completion_tokens"] += stats.completion_tokens
        log.debug("request %s finished: %s %s", req.id, reason, stats)  # the daemon logs JSON
        tokens = None
        if req.keep_tokens and error is None and reason in ("stop", "length"):
            # the prompt holds a continued request's earlier output, which ``output`` starts with
            tokens = tuple(req.prompt[: len(req.prompt) - req.continued_tokens] + req.output)
        self._emit(FinishedEvent(req.id, reason, stats, stop=req.text.stopped_by, error=error,
                                 tokens=tokens))

    def _release(self, slot: Slot, keep_cache: bool) -> None:
        slot.request, slot.state, slot.last_used = None, SlotState.IDLE, self._clock()
        if not keep_cache:
            self._forget(slot)
        else:
            self.cache.finished(slot)

    def _forget(self, slot: Slot) -> None:
        loop = self._loop_thread
        if loop is None or loop == threading.get_ident():
            self.engine.kv_remove(slot.seq_id, 0, -1)
        else:  # maybe during a decode: removed on the loop thread, before the next tick
            self._kv_forgets.append(slot.seq_id)
        slot.tokens.clear()
        slot.scope = slot.session = None
        slot.cache_hits = 0

    def _apply_kv_forgets(self) -> None:
        """The cells of slots forgotten off the loop thread (lock held, loop thread)."""
        if not self._kv_forgets:  # every tick: nearly always nothing to do
            return
        forgets, self._kv_forgets = self._kv_forgets, []
        for seq_id in forgets:
            self.engine.kv_remove(seq_id, 0, -1)

    def _cache_event(self, event: CacheEvent) -> None:
        if self.on_cache_event is not None:
            try:
                self.on_cache_event(event)
            except Exception:  # a publishing hook must never break a tick
                log.exception("on_cache_event hook failed")

    def _stats(self, req: RequestState, now: float) -> RequestStats:
        first, started = req.t_first_token, req.t_started
        evaluated = len(req.prompt) - req.cached_tokens
        prefill_s = first - started if first is not None and started is not None else 0.0
        gen_s = now - first if first is not None else 0.0
        return RequestStats(
            # billed once computed; a continued request's earlier output is not prompt
            prompt_tokens=len(req.prompt) - req.continued_tokens if started is not None else 0,
            cached_tokens=req.cached_tokens,
            completion_tokens=len(req.output),
            queue_ms=_ms(started - req.arrival) if started is not None else None,
            ttft_ms=_ms(first - req.arrival) if first is not None else None,
            duration_ms=_ms(now - req.arrival),
            prompt_eval_rate=round(evaluated / prefill_s, 1) if prefill_s > 0 else None,
            generation_rate=round((len(req.output) - 1) / gen_s, 1)
            if gen_s > 0 and len(req.output) > 1
            else None,
            cache_tier=req.cache_tier if req.cached_tokens else None,
            cache_created_tokens=max(0, evaluated) if req.cache_prompt and started else 0,
            cache_hit=cache_hit(req),
        )

    def _rollback(self, plan: TickPlan) -> None:
        """After an aborted decode: drop whatever part of this tick reached the KV cache."""
        for p in plan.rows:
            self.engine.kv_remove(p.slot.seq_id, p.row.pos0, -1)

    def _purge_idle(self) -> bool:
        """KV pressure, first remedy: the parked state saved and its cells freed, and idle
        slots' cached prefixes forgotten."""
        self._apply_kv_forgets()
        purged = self.cache.settle()
        for slot in self._slots:
            if slot.state is SlotState.IDLE and slot.tokens:
                self.cache.preserve(slot, self._slots)
                self._forget(slot)
                purged = True
        if purged:
            log.info("KV cache full: dropped idle slots' cached prefixes")
        return purged

    def _fail_largest(self) -> None:
        """KV pressure, last remedy: a single token does not fit, so the biggest sequence goes."""
        active = [s for s in self._slots if s.request is not None]
        victim = max(active, key=lambda s: len(s.tokens))
        log.warning(
            "KV cache full: failing request %s (%d tokens in KV)",
            victim.request.id,
            len(victim.tokens),
        )
        self._finish(
            victim.request,
            Status.FINISHED_ERROR,
            {
                "code": errors.CONTEXT_FULL,
                "message": "the KV cache is full and this request cannot continue; "
                "retry later or shorten it",
            },
        )

    def _fail_plan(self, plan: TickPlan, rc: int) -> None:
        log.error(
            "llama_decode failed with %d; failing the %d requests in the batch", rc, len(plan.rows)
        )
        self._rollback(plan)
        for p in plan.rows:
            if p.request.id in self._requests:
                self._finish(
                    p.request,
                    Status.FINISHED_ERROR,
                    {
                        "code": errors.ENGINE_ERROR,
                        "message": f"llama_decode failed ({rc})",
                    },
                )

    @staticmethod
    def _slot_info(slot: Slot) -> dict[str, Any]:
        req = slot.request
        return {
            "id": slot.seq_id,
            "state": slot.state.value,
            "request_id": req.id if req else None,
            "cache_scope": req.cache_scope if req else slot.scope,
            "kv_tokens": len(slot.tokens),
            "prompt_tokens": len(req.prompt) if req else 0,
            "cached_tokens": req.cached_tokens if req else 0,
            "generated_tokens": len(req.output) if req else 0,
        }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


def cache_hit(req: RequestState) -> str:
    """The kind of a request's cache hit: ``exact`` (every prompt token but the last, which
    is always evaluated), ``session`` (its session's own slot kept its history), ``prefix``
    (a part), ``none``."""
    if req.cached_tokens <= 0:
        return "none"
    if req.cached_tokens >= len(req.prompt) - 1:
        return "exact"
    if req.session is not None and req.cache_tier == "slot":
        return "session"
    return "prefix"
