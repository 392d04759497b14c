"""Level 2 of the prefix cache: serialized sequence states in RAM, LRU under a byte budget.

An entry is one slot's KV saved with ``llama_state_seq_get_data`` just before that KV was
destroyed. It is keyed by (cache_scope, tokens) and only ever matched against prompts of
the same scope. No entry is stored larger than the budget (or than one scope's share of
it), and room is made *before* the state is copied out, so the total never passes the
budget. Pure Python: the bytes are an opaque object the engine made and reads back.

An entry may be *owned* by a request (``owner``): a preempted request's whole sequence,
saved when it left its slot for another tenant. No lookup matches it and no eviction takes
it; it counts against the budget until its request resumes (``take_owned``) or ends.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .adapters import tenant_of


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """How many leading tokens two sequences share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case, compared at C speed
        return n
    i = 0
    while i + 64 <= n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True, eq=False)
class RamEntry:
    """One saved sequence state. ``tokens`` is exactly what it holds, in order."""

    cache_scope: str
    tokens: list[int]
    data: Any  # the engine's buffer; nothing here looks inside it
    size_bytes: int
    last_used: float
    hits: int = 0
    id: int = field(default=0)
    owner: str | None = None  # a preempted request's own state (never matched or evicted)


class RamCache:
    """LRU of saved sequence states within ``budget_bytes``; one scope holds at most its share
    (``tenant_share`` of the budget) while another scope holds entries too: a lone tenant may
    use the whole budget, and once another arrives the first one's entries past its share
    are the ones that go when it saves more (a tenant flooding distinct prompts cannot push
    out another's warm conversation).

    ``partial_max_tokens`` > 0 (a sliding-window model): an entry longer than that keeps
    only the last window of its SWA layers, so it can be restored whole but not cut shorter.
    """

    def __init__(
        self, budget_bytes: int, tenant_share: float = 1.0, partial_max_tokens: int = 0
    ) -> None:
        self.budget_bytes = budget_bytes
        self.tenant_share = tenant_share
        self.scope_limit_bytes = int(budget_bytes * min(max(tenant_share, 0.0), 1.0))
        self.partial_max_tokens = partial_max_tokens
        self._entries: OrderedDict[int, RamEntry] = OrderedDict()  # least recently used first
        self._scope_bytes: dict[str, int] = {}
        self.total_bytes = 0
        self._next_id = 1

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[RamEntry]:
        """Entries, least recently used first."""
        return list(self._entries.values())

    def scope_bytes(self, cache_scope: str) -> int:
        """What the scope's tenant holds (all its adapters' scopes with its own)."""
        return self._scope_bytes.get(tenant_of(cache_scope), 0)

    def usable_prefix(self, entry: RamEntry, prompt: list[int], limit: int) -> int:
        """How many tokens of ``prompt`` (at most ``limit``) a restore of ``entry`` provides."""
        n = min(common_prefix_len(entry.tokens, prompt), limit)
        if n < len(entry.tokens) and not self._cuttable(entry.tokens):
            return 0
        return n

    def lookup(
        self, cache_scope: str, prompt: list[int], limit: int
    ) -> tuple[RamEntry | None, int]:
        """The same-scope entry that gives the longest usable prefix of ``prompt``."""
        best, best_n = None, 0
        for entry in self._entries.values():
            if entry.cache_scope == cache_scope and entry.owner is None:
                n = self.usable_prefix(entry, prompt, limit)
                if n > best_n:
                    best, best_n = entry, n
        return best, best_n

    def covers(self, cache_scope: str, tokens: list[int]) -> bool:
        """Whether an entry of this scope already holds ``tokens`` (or a usable extension)."""
        n = len(tokens)
        return any(
            e.cache_scope == cache_scope
            and e.owner is None
            and e.tokens[:n] == tokens
            and (len(e.tokens) == n or self._cuttable(e.tokens))
            for e in self._entries.values()
        )

    def fits(self, cache_scope: str, size_bytes: int) -> bool:
        """Whether an entry this large may be stored at all (after evicting others)."""
        return size_bytes <= self.budget_bytes and size_bytes <= self._scope_limit(cache_scope)

    def _scope_limit(self, cache_scope: str) -> int:
        """The scope's share while another scope holds entries; else the whole budget."""
        alone = all(tenant == tenant_of(cache_scope) for tenant in self._scope_bytes)
        return self.budget_bytes if alone else self.scope_limit_bytes

    def make_room(
        self, cache_scope: str, tokens: list[int], size_bytes: int, protect: RamEntry | None = None,
        owned: bool = False,
    ) -> tuple[list[RamEntry], bool]:
        """Evict so that a new entry fits: first what it makes redundant, then the scope's
        LRU (its share), then the global LRU; owned entries are never evicted. ``owned``: the
        new entry is a request's own (it serves no lookup, so nothing is redundant). Returns
        (evicted entries, room made)."""
        evicted = []
        if self._cuttable(tokens) and not owned:  # it serves every lookup its prefixes did
            for e in list(self._entries.values()):
                redundant = e.cache_scope == cache_scope and tokens[: len(e.tokens)] == e.tokens
                if redundant and e is not protect and e.owner is None:
                    evicted.append(self._remove(e))
        for scoped in (True, False):
            for e in list(self._entries.values()):
                if scoped:
                    limit = self._scope_limit(cache_scope)
                    over = self.scope_bytes(cache_scope) + size_bytes > limit
                else:
                    over = self.total_bytes + size_bytes > self.budget_bytes
                if not over:
                    break
                evictable = e is not protect and e.owner is None
                mine = tenant_of(e.cache_scope) == tenant_of(cache_scope)
                if evictable and (not scoped or mine):
                    evicted.append(self._remove(e))
        room = (
            self.total_bytes + size_bytes <= self.budget_bytes
            and self.scope_bytes(cache_scope) + size_bytes <= self._scope_limit(cache_scope)
        )
        return evicted, room

    def add(
        self, cache_scope: str, tokens: list[int], data: Any, size_bytes: int, now: float,
        owner: str | None = None,
    ) -> RamEntry:
        """Store an entry; the caller made room first (``make_room``)."""
        entry = RamEntry(cache_scope, list(tokens), data, size_bytes, now, id=self._next_id,
                         owner=owner)
        self._next_id += 1
        self._entries[entry.id] = entry
        self._scope_bytes[tenant_of(cache_scope)] = self.scope_bytes(cache_scope) + size_bytes
        self.total_bytes += size_bytes
        return entry

    def touch(self, entry: RamEntry, now: float) -> None:
        """Mark an entry used (a hit): it becomes the most recently used."""
        entry.last_used = now
        entry.hits += 1
        if entry.id in self._entries:
            self._entries.move_to_end(entry.id)

    def take_owned(self, owner: str) -> RamEntry | None:
        """Remove and return the entry a request owns (None: it has none)."""
        for entry in self._entries.values():
            if entry.owner == owner:
                return self._remove(entry)
        return None

    def discard(self, entry: RamEntry) -> bool:
        """Remove one entry if it is still here (owned or not); whether it was."""
        if self._entries.get(entry.id) is not entry:
            return False
        self._remove(entry)
        return True

    def evict_scope(self, cache_scope: str) -> int:
        """Drop every cached entry of one scope (an operator's action; running requests'
        own entries stay, as their slots do); returns how many."""
        doomed = [e for e in self._entries.values()
                  if e.cache_scope == cache_scope and e.owner is None]
        for entry in doomed:
            self._remove(entry)
        return len(doomed)

    def _remove(self, entry: RamEntry) -> RamEntry:
        del self._entries[entry.id]
        tenant = tenant_of(entry.cache_scope)
        left = self._scope_bytes[tenant] - entry.size_bytes
        if left:
            self._scope_bytes[tenant] = left
        else:
            del self._scope_bytes[tenant]
        self.total_bytes -= entry.size_bytes
        return entry

    def _cuttable(self, tokens: list[int]) -> bool:
        return self.partial_max_tokens <= 0 or len(tokens) <= self.partial_max_tokens
