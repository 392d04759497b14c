"""The prefix cache: the longest cached prefix of a prompt that the request's scope may reuse.

Three tiers, every lookup keyed by (cache_scope, tokens); another scope's KV is never
looked at, copied or restored (SGLang's radix cache keys on (extra_key, tokens) the same way):

- ``slot``: the slot the request lands on still holds a prefix of its prompt (kept in place);
- ``cross_slot``: another slot, idle or busy, holds a longer one: ``llama_memory_seq_cp``
  of positions [0, n) (metadata only under the unified KV buffer), then prefill the rest;
- ``ram``: a saved sequence state (``ram_cache.RamCache``) restored with
  ``llama_state_seq_set_data`` instead of prefilling;
- ``disk``: the same, read from a file (``disk_cache.DiskCache``): it outlives the daemon.

The longest usable prefix wins; on a tie the cheaper tier (the order above). States reach
the disk tier off the decode loop (``disk_cache.DiskWriter``'s thread), for three reasons:
``evict`` (a RAM entry pushed out: its bytes are already serialized), ``finish`` (a request
ended holding at least ``disk_min_tokens``: its slot's state is serialized after the tick,
once, for the RAM tier and the disk both) and ``shutdown`` (``persist_all``: the slots and
the RAM entries not on disk yet).

Before a slot's cached KV is destroyed (reused for another prompt or scope, purged under
KV pressure) it is saved to RAM, if that tier is on and the state fits its budget. With a
*park* sequence (``park_seq``), an admission does not pay that save before its prefill:
the slot's cells are shared with the park (``llama_memory_seq_cp``, metadata only), the
slot is cut and prefilled at once, and the parked state is serialized after the tick's
decode (``settle``: the scheduler calls it at the end of every tick and first under KV
pressure), then the park is emptied. One state is parked at a time; a second waits for
the first to be settled. llama-server pays this save before the prefill (its prompt
cache's ``prompt_save`` when a slot is picked by LRU): ~2 ms of the TTFT here.
The last prompt token is always evaluated, so there are logits to sample the first token.
All methods run on the scheduler's loop thread with its lock held.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .disk_cache import DiskCache, DiskWriter
from .ram_cache import RamCache, RamEntry, common_prefix_len
from .state import CacheEvent, RequestState, Slot, SlotState

log = logging.getLogger(__name__)

# The matched share of a slot's cached history that counts as prefix instability.
INSTABILITY_RANGE = (0.1, 0.5)


class CacheEngine(Protocol):
    """What the prefix cache needs from an engine (``llama.engine.LlamaEngine`` or a test fake)."""

    kv_bytes_per_token: int
    n_swa: int  # sliding-window size, 0 if none

    def kv_remove(self, seq_id: int, p0: int = 0, p1: int = -1) -> bool: ...
    def kv_copy(self, src: int, dst: int, p0: int = 0, p1: int = -1) -> None: ...
    def kv_prefix_intact(self, seq_id: int, n_tokens: int) -> bool: ...  # can serve [0, n)
    def state_size(self, seq_id: int) -> int: ...
    def state_save(self, seq_id: int, size_bytes: int) -> Any | None: ...
    def state_restore(self, seq_id: int, data: Any) -> bool: ...


@dataclass(slots=True)
class _Parked:
    """A slot's state waiting in the park sequence for its RAM save (``settle``)."""

    scope: str
    tokens: list[int]
    protect: RamEntry | None
    forgotten: bool = False  # its scope was evicted since: freed, never saved


@dataclass(slots=True)
class _Source:
    tier: str
    n_tokens: int
    slot: Slot | None = None
    entry: RamEntry | None = None


class PrefixCache:
    """Lookups, adoption, RAM saves and restores, their counters and events."""

    def __init__(
        self,
        engine: CacheEngine,
        ram: RamCache | None,
        cross_slot: bool,
        min_save_tokens: int,
        counters: Counter[str],
        emit: Callable[[CacheEvent], None],
        clock: Callable[[], float],
        park_seq: int | None = None,
        idle_to_ram: bool = False,
        disk: DiskCache | None = None,
        disk_min_tokens: int = 256,
    ) -> None:
        self.engine = engine
        self.ram = ram
        self.cross_slot = cross_slot
        self.min_save_tokens = max(1, min_save_tokens)
        self.counters = counters
        self._emit = emit
        self._clock = clock
        self.park_seq = park_seq
        self._parked: _Parked | None = None
        self.idle_to_ram = idle_to_ram and ram is not None  # without RAM it would just forget
        self.disk = disk
        if disk is not None:  # one set of counters: the disk tier's join the scheduler's
            counters.update(disk.counters)
            disk.counters = counters
        self.disk_min_tokens = max(self.min_save_tokens, disk_min_tokens)
        self.writer = DiskWriter(disk, self._disk_saved) if disk is not None else None
        self._to_persist: list[tuple[Slot, int]] = []  # finished slots (and their length)

    def prepare(self, req: RequestState, slot: Slot, slots: list[Slot]) -> None:
        """Make ``slot`` hold the longest reusable prefix of the prompt; set ``cached_tokens``."""
        prompt, limit = req.prompt, len(req.prompt) - 1
        matches = {
            s.seq_id: common_prefix_len(s.tokens, prompt)
            for s in slots
            if req.cache_prompt and s.scope == req.cache_scope and s.tokens
        }
        own = min(matches.get(slot.seq_id, 0), limit)
        best = _Source("slot", own, slot)
        if req.cache_prompt:
            self.counters["cache_lookups"] += 1
            best = self._lookup(req, slot, slots, matches, best)
            self._check_stability(req, slots, matches)
        data = None
        if best.tier == "disk":
            assert self.disk is not None and best.entry is not None
            data = self.disk.read(best.entry)  # checked before it is any of llama.cpp's
            if data is None:
                self.counters["disk_restore_failures"] += 1
                best = _Source("slot", own, slot)
        keep = own if best.tier not in ("ram", "disk") else 0  # a restore replaces it all
        if keep < len(slot.tokens):
            self.preserve(slot, slots, protect=best.entry, defer=True)
            keep = self._truncate(slot, keep)
        if keep == 0:
            slot.cache_hits = 0
        slot.scope = req.cache_scope if req.cache_prompt else None
        n = keep
        if best.tier == "cross_slot":
            n = self._copy(best.slot, slot, keep, best.n_tokens)
        elif best.tier in ("ram", "disk"):
            n = self._restore(best.entry, slot, best.n_tokens, best.tier, data)
        req.cached_tokens = n
        req.cache_tier = best.tier if n > keep else ("slot" if keep else None)
        if keep:
            self._count_hit("slot", keep)
            slot.cache_hits += 1
        if n > keep:
            self._count_hit(best.tier, n - keep)
        if self.idle_to_ram:
            self._clear_idle(slot, slots)

    def _clear_idle(self, admitted: Slot, slots: list[Slot]) -> None:
        """Every other idle slot's prefix to the RAM tier (unless it is there already), its
        cells freed: llama.cpp's unified KV attends over every used cell up to the highest,
        so idle prefixes widen each prefill's and each decode's span (~5% of a 157-token
        prefill served, with three of them: docs/performance.md). Runs after the admitted
        slot took what it needed from them (a cross-slot copy shares the cells it keeps)."""
        for other in slots:
            if other is admitted or other.state is not SlotState.IDLE or not other.tokens:
                continue
            self.preserve(other, slots)
            self._truncate(other, 0)
            other.cache_hits = 0
            self.counters["idle_slots_cleared"] += 1

    def catch_up(self, req: RequestState, slot: Slot, slots: list[Slot]) -> None:
        """Mid-prefill: adopt what another slot of the scope has computed of this prompt since."""
        done, limit = len(slot.tokens), len(req.prompt) - 1
        best, best_n = None, done
        for other in slots:
            if other is not slot and other.scope == req.cache_scope and len(other.tokens) > best_n:
                n = min(common_prefix_len(other.tokens, req.prompt), limit)
                if n > best_n:
                    best, best_n = other, n
        if best is not None:
            n = self._copy(best, slot, done, best_n)
            req.cached_tokens += n - done
            req.cache_tier = req.cache_tier or "cross_slot"
            self._count_hit("cross_slot", n - done)

    def preserve(self, slot: Slot, slots: list[Slot], protect: RamEntry | None = None,
                 defer: bool = False) -> None:
        """Save a slot's cached KV to RAM before it is destroyed, unless held elsewhere.
        ``defer`` (with a park sequence): park it now, save it at the next ``settle``."""
        tokens, scope = slot.tokens, slot.scope
        if self.ram is None or scope is None or len(tokens) < self.min_save_tokens:
            return
        n = len(tokens)
        if any(o is not slot and o.scope == scope and o.tokens[:n] == tokens for o in slots):
            return  # another slot holds it (or more); it is saved when that one goes
        if self.ram.covers(scope, tokens):
            return
        if defer and self.park_seq is not None:
            self.settle()  # one parked state at most
            self.engine.kv_copy(slot.seq_id, self.park_seq, 0, n)
            self._parked = _Parked(scope, list(tokens), protect)
            return
        self._save(slot.seq_id, scope, tokens, protect)

    @property
    def parked(self) -> bool:
        """Whether a state waits in the park sequence for ``settle``."""
        return self._parked is not None

    def forget_parked(self, scope: str) -> None:
        """An operator evicted ``scope``: a parked state of it is freed, not saved. Only
        marked here (any thread, the lock held); the loop thread frees it in ``settle``."""
        if self._parked is not None and self._parked.scope == scope:
            self._parked.forgotten = True

    def settle(self) -> bool:
        """Save the parked state to RAM (if it still fits and is not covered by now), then
        empty the park. True when a state was parked (its cells are free now)."""
        parked, self._parked = self._parked, None
        if parked is None:
            return False
        assert self.park_seq is not None  # a state is parked only with a park
        try:
            if (self.ram is not None and not parked.forgotten
                    and not self.ram.covers(parked.scope, parked.tokens)):
                self._save(self.park_seq, parked.scope, parked.tokens, parked.protect)
        finally:
            self.engine.kv_remove(self.park_seq, 0, -1)
        return True

    def _save(self, seq_id: int, scope: str, tokens: list[int],
              protect: RamEntry | None) -> RamEntry | None:
        """Sequence ``seq_id``'s state (holding ``tokens`` of ``scope``) into the RAM tier."""
        assert self.ram is not None
        n = len(tokens)
        size = self.engine.state_size(seq_id)  # asked first: never allocate past the budget
        if not self.ram.fits(scope, size):
            self._event("reject", scope, n, size)
            return None
        evicted, room = self.ram.make_room(scope, tokens, size, protect)
        self._evicted(evicted)
        if not room:
            self._event("reject", scope, n, size)
            return None
        data = self.engine.state_save(seq_id, size)
        if data is None:
            self.counters["ram_save_failures"] += 1
            log.warning("could not save sequence %d's state (%d bytes)", seq_id, size)
            return None
        entry = self.ram.add(scope, tokens, data, size, self._clock())
        self._event("save", scope, n, size)
        return entry

    # -- preemption: a request's own state out of its slot and back ------------------

    def swap_out(self, req: RequestState, slot: Slot) -> bool:
        """Save a preempted request's whole sequence to the RAM tier as its own entry (no
        lookup matches it, no eviction takes it). False when the budget (or the scope's
        share) cannot hold it even after evicting cached prefixes: it is recomputed when it
        resumes. The caller frees the slot's cells."""
        if self.ram is None or not slot.tokens:
            return False
        scope, tokens = req.cache_scope, slot.tokens
        size = self.engine.state_size(slot.seq_id)
        room = self.ram.fits(scope, size)
        if room:
            evicted, room = self.ram.make_room(scope, tokens, size, owned=True)
            self._evicted(evicted)
        data = self.engine.state_save(slot.seq_id, size) if room else None
        if data is None:
            self.counters["preempt_unsaved"] += 1
            return False
        self.ram.add(scope, tokens, data, size, self._clock(), owner=req.id)
        self.counters["preempt_saves"] += 1
        self.counters["preempt_save_bytes"] += size
        self.counters["preempt_save_tokens"] += len(tokens)
        return True

    def resume(self, req: RequestState, slot: Slot, slots: list[Slot]) -> int:
        """Fill ``slot`` for a preempted request: its own saved state restored whole (then
        only its last token is evaluated), else the prefix of its tokens the slot still holds
        (its scope's) is kept and the rest is recomputed. Returns the tokens the slot holds."""
        target = req.fill_tokens
        entry = self.ram.take_owned(req.id) if self.ram is not None else None
        keep = 0
        if entry is None and req.cache_prompt and slot.scope == req.cache_scope:
            keep = min(common_prefix_len(slot.tokens, target), len(target) - 1)
        if keep < len(slot.tokens):
            self.preserve(slot, slots, defer=True)
            keep = self._truncate(slot, keep)
        slot.scope = req.cache_scope if req.cache_prompt else None
        if entry is not None:
            n = len(entry.tokens)
            ok = n < len(target) and entry.tokens == target[:n]
            ok = ok and self.engine.state_restore(slot.seq_id, entry.data)
            if ok and self.engine.kv_prefix_intact(slot.seq_id, n):
                slot.tokens[:] = entry.tokens
                self.counters["preempt_restores"] += 1
                self.counters["preempt_restore_tokens"] += n
                return n
            self.engine.kv_remove(slot.seq_id, 0, -1)
            self.counters["preempt_restore_failures"] += 1
            log.warning("request %s: its saved state did not restore; recomputing", req.id)
        self.counters["preempt_recomputes"] += 1
        self.counters["preempt_recompute_tokens"] += len(target) - len(slot.tokens)
        return len(slot.tokens)

    def drop_owned(self, request_id: str) -> None:
        """A preempted request ended (cancel, deadline, hand-back): its saved state goes."""
        if self.ram is not None:
            self.ram.take_owned(request_id)

    def entries(self, slots: list[Slot], now: float) -> list[dict[str, Any]]:
        """What is cached, per slot and per RAM entry: scope, size, age, hits. No token ids."""
        per_token = self.engine.kv_bytes_per_token
        out: list[dict[str, Any]] = [
            {
                "tier": "slot",
                "slot": s.seq_id,
                "cache_scope": s.scope,
                "tokens": len(s.tokens),
                "bytes": len(s.tokens) * per_token,  # estimated; cells shared by seq_cp count twice
                "age_ms": _age_ms(now, s.last_used) if s.state is SlotState.IDLE else 0.0,
                "hits": s.cache_hits,
            }
            for s in slots
            if s.scope is not None and s.tokens
        ]
        for e in self.ram.entries()[::-1] if self.ram is not None else []:
            out.append(
                {
                    "tier": "ram",
                    "slot": None,
                    "cache_scope": e.cache_scope,
                    "tokens": len(e.tokens),
                    "bytes": e.size_bytes,
                    "age_ms": _age_ms(now, e.last_used),
                    "hits": e.hits,
                }
            )
        return out

    def summary(self) -> dict[str, Any]:
        ram = self.ram
        return {
            "cross_slot": self.cross_slot,
            "ram_budget_bytes": ram.budget_bytes if ram is not None else 0,
            "ram_tenant_share": ram.tenant_share if ram is not None else None,
            "ram_bytes": ram.total_bytes if ram is not None else 0,
            "ram_entries": len(ram) if ram is not None else 0,
        }

    # -- pieces -----------------------------------------------------------------------

    def _lookup(
        self,
        req: RequestState,
        slot: Slot,
        slots: list[Slot],
        matches: dict[int, int],
        best: _Source,
    ) -> _Source:
        limit = len(req.prompt) - 1
        if self.cross_slot:
            for other in slots:
                n = min(matches.get(other.seq_id, 0), limit)
                if other is not slot and n > best.n_tokens:
                    best = _Source("cross_slot", n, other)
        if self.ram is not None:
            entry, n = self.ram.lookup(req.cache_scope, req.prompt, limit)
            if n > best.n_tokens and n >= self.min_save_tokens:  # shorter: not worth a restore
                best = _Source("ram", n, None, entry)
        if self.disk is not None:
            entry, n = self.disk.lookup(req.cache_scope, req.prompt, limit)
            if n > best.n_tokens and n >= self.min_save_tokens:
                best = _Source("disk", n, None, entry)
        return best

    def _check_stability(
        self, req: RequestState, slots: list[Slot], matches: dict[int, int]
    ) -> None:
        """A prompt that keeps only 10-50% of a cached history: the client rewrote it (a
        timestamp in the system prompt, edited turns). The session's own slot is the
        reference when it has one, else the slot with the longest match."""
        scoped = [s for s in slots if s.seq_id in matches]
        if not scoped:
            return
        pinned = [s for s in scoped if req.session is not None and s.session == req.session]
        ref = pinned[0] if pinned else max(scoped, key=lambda s: matches[s.seq_id])
        matched, history = matches[ref.seq_id], len(ref.tokens)
        lo, hi = INSTABILITY_RANGE
        if lo <= matched / history < hi:
            log.info(
                "prefix instability: request %s (scope %s) matches %d of %d cached tokens"
                " of slot %d",
                req.id,
                req.cache_scope,
                matched,
                history,
                ref.seq_id,
            )
            self._event(
                "prefix_instability",
                req.cache_scope,
                matched,
                0,
                request_id=req.id,
                history_tokens=history,
            )

    def _truncate(self, slot: Slot, keep: int) -> int:
        """Cut a slot's KV back to ``keep`` tokens; all of it if the cut leaves it unusable."""
        seq = slot.seq_id
        engine = self.engine
        if keep > 0 and not engine.kv_remove(seq, keep, -1):
            keep = 0
        if keep > 0 and not engine.kv_prefix_intact(seq, keep):
            keep = 0
        if keep == 0:
            self.engine.kv_remove(seq, 0, -1)
        del slot.tokens[keep:]
        return keep

    def _copy(self, src: Slot, dst: Slot, p0: int, p1: int) -> int:
        """Share ``src``'s cells [p0, p1) with ``dst``, which holds [0, p0) of the same tokens."""
        if not self.engine.kv_prefix_intact(src.seq_id, p1):  # a sliding window let go of some
            return p0
        self.engine.kv_copy(src.seq_id, dst.seq_id, p0, p1)
        dst.tokens.extend(src.tokens[p0:p1])
        src.cache_hits += 1
        if src.state is SlotState.IDLE:
            src.last_used = self._clock()
        return p1

    def _restore(self, entry: RamEntry, slot: Slot, n: int, tier: str = "ram",
                 data: Any = None) -> int:
        """Load a saved state into an empty slot; cut it to the ``n`` tokens the prompt shares.
        ``data``: the disk tier's bytes (read and checked by the caller)."""
        seq = slot.seq_id
        ok = self.engine.state_restore(seq, entry.data if data is None else data)
        if ok and n < len(entry.tokens):
            ok = self.engine.kv_remove(seq, n, -1)
        if not (ok and self.engine.kv_prefix_intact(seq, n)):
            self.engine.kv_remove(seq, 0, -1)
            self.counters[f"{tier}_restore_failures"] += 1
            log.warning("could not restore a %d-byte %s state into slot %d", entry.size_bytes,
                        tier, seq)
            return 0
        slot.tokens[:] = entry.tokens[:n]
        if tier == "ram":
            self.ram.touch(entry, self._clock())
        self._event("restore", entry.cache_scope, n, entry.size_bytes, tier=tier)
        return n

    def _evicted(self, entries: list[RamEntry]) -> None:
        """RAM entries pushed out: counted, and handed to the disk tier (``evict``)."""
        for entry in entries:
            self._event("evict", entry.cache_scope, len(entry.tokens), entry.size_bytes)
            self._to_disk(entry.cache_scope, entry.tokens, entry.data, "evict")

    def _to_disk(self, scope: str, tokens: list[int], data: Any, reason: str,
                 block_s: float = 0.0) -> bool:
        """Queue a serialized state for the disk tier unless it holds it (or more) already."""
        if (self.writer is None or len(tokens) < self.disk_min_tokens
                or self.disk.covers(scope, tokens) or self.writer.pending(scope, tokens)):
            return False
        return self.writer.submit(scope, tokens, data, reason, block_s)

    def _disk_saved(self, scope: str, n_tokens: int, size_bytes: int, reason: str) -> None:
        """The writer's thread: a state is on disk (an event; the counters are the disk's)."""
        self._emit(CacheEvent("save", scope, n_tokens, size_bytes, tier="disk", reason=reason))

    # -- the disk tier: finished requests' states, and everything at shutdown ------------

    def finished(self, slot: Slot) -> None:
        """A request ended on ``slot`` keeping its KV: its state goes to disk after the tick
        (``persist``) when it is long enough and not there yet."""
        if (self.writer is not None and slot.scope is not None
                and len(slot.tokens) >= self.disk_min_tokens):
            self._to_persist.append((slot, len(slot.tokens)))

    @property
    def persisting(self) -> bool:
        return bool(self._to_persist)

    def persist(self) -> None:
        """After the tick (loop thread, lock held): the finished slots' states serialized
        once, kept in the RAM tier (so its later save is a hit) and queued for the disk."""
        todo, self._to_persist = self._to_persist, []
        for slot, n in todo:
            if slot.state is not SlotState.IDLE or len(slot.tokens) != n or slot.scope is None:
                continue  # taken again since (its prefix is handled by the next owner)
            self._persist_slot(slot, "finish")

    def _persist_slot(self, slot: Slot, reason: str, block_s: float = 0.0) -> bool:
        scope, tokens = slot.scope, list(slot.tokens)
        assert scope is not None and self.disk is not None
        if self.disk.covers(scope, tokens) or (self.writer and self.writer.pending(scope, tokens)):
            return False
        entry = None
        if self.ram is not None:
            entry = next((e for e in self.ram.entries()
                          if e.owner is None and e.cache_scope == scope and e.tokens == tokens),
                         None) or self._save(slot.seq_id, scope, tokens, None)
        if entry is not None:
            data = entry.data
        else:
            size = self.engine.state_size(slot.seq_id)
            if size > self.disk.budget_bytes:
                return False
            data = self.engine.state_save(slot.seq_id, size)
            if data is None:
                self.counters["disk_save_failures"] += 1
                return False
        return self._to_disk(scope, tokens, data, reason, block_s)

    def persist_all(self, slots: list[Slot], timeout_s: float) -> int:
        """Shutdown (no decode runs any more): every slot's cached prefix and every RAM
        entry not on disk yet, most recently used first, written within ``timeout_s``.
        Returns how many states were queued."""
        if self.writer is None:
            return 0
        deadline = self._clock() + timeout_s
        queued = 0
        for slot in sorted(slots, key=lambda s: s.last_used, reverse=True):
            if self._clock() >= deadline:
                break
            if slot.scope is not None and len(slot.tokens) >= self.disk_min_tokens:
                queued += self._persist_slot(slot, "shutdown", max(0.0, deadline - self._clock()))
        for entry in (self.ram.entries()[::-1] if self.ram is not None else []):
            if self._clock() >= deadline:
                break
            if entry.owner is None:
                queued += self._to_disk(entry.cache_scope, entry.tokens, entry.data, "shutdown",
                                        max(0.0, deadline - self._clock()))
        self.writer.flush(max(0.0, deadline - self._clock()))
        return queued

    def _count_hit(self, tier: str, n_tokens: int) -> None:
        if n_tokens > 0:
            self.counters[f"cache_hits_{tier}"] += 1
            self.counters[f"cache_hit_tokens_{tier}"] += n_tokens

    def _event(self, kind: str, scope: str, n_tokens: int, size_bytes: int, tier: str = "ram",
               **extra: Any) -> None:
        """Count an event (``ram_save``, ``ram_save_bytes``, ``disk_restore``, ...) and hand
        it to the hook."""
        name = kind if kind == "prefix_instability" else f"{tier}_{kind}"
        self.counters[name] += 1
        if kind != "prefix_instability":
            self.counters[f"{name}_bytes"] += size_bytes
            self.counters[f"{name}_tokens"] += n_tokens
            log.debug("%s cache %s: scope %s, %d tokens, %d bytes", tier, kind, scope,
                      n_tokens, size_bytes)
        self._emit(CacheEvent(kind, scope, n_tokens, size_bytes, tier=tier, **extra))


def _age_ms(now: float, then: float) -> float:
    return round(max(0.0, now - then) * 1000, 1)
