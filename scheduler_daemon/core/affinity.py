"""What this daemon tells the fleet it probably holds: the affinity chains of the jobs it
started (wire/affinity.py), per tenant, bounded.

``llm:affinity:<daemon>`` is a Redis set of chain hashes (each salted by its tenant, so no
tenant's hashes match another's, and none shows any text). The intake adds a job's chain
as it starts the job, in the pipeline it runs anyway, and removes what the bounds evict:
``PER_TENANT`` hashes per tenant (a tenant's own traffic evicts its own entries first, so
one tenant cannot push the others out), ``TOTAL`` in all (the largest tenant gives way).
An operator's ``evict_scope`` forgets the tenant's. Like SGLang's router tree, it is an
approximation of the prefix cache (what was sent here lately), not a copy of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

PER_TENANT = 512
TOTAL = 8192
SUMMARY_TTL_S = 60  # the set outlives a daemon that dies this long (its beat renews it)
SESSION_TTL_S = 3600  # a session sticks to its daemon this long after its last turn


class AffinitySummary:
    """Thread-safe: the preparer records, the control thread forgets, the heartbeat reads."""

    def __init__(self, per_tenant: int = PER_TENANT, total: int = TOTAL) -> None:
        self.per_tenant = per_tenant
        self.total = total
        self._tenants: dict[str, OrderedDict[str, None]] = {}
        self._size = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return self._size

    def record(self, tenant: str, chain: list[str]) -> tuple[list[str], list[str]]:
        """Note a started job's chain; (hashes to add to the set, hashes to remove)."""
        with self._lock:
            held = self._tenants.setdefault(tenant, OrderedDict())
            added = []
            for digest in chain:
                if digest in held:
                    held.move_to_end(digest)
                else:
                    held[digest] = None
                    added.append(digest)
                    self._size += 1
            removed = self._evict(held)
            return [d for d in added if d not in removed], removed

    def forget(self, tenant: str) -> list[str]:
        """Drop one tenant's entries (its cached prefixes were evicted); what to remove."""
        with self._lock:
            held = self._tenants.pop(tenant, OrderedDict())
            self._size -= len(held)
            return list(held)

    def all(self) -> list[str]:
        with self._lock:
            return [d for held in self._tenants.values() for d in held]

    def by_tenant(self) -> dict[str, int]:
        """Entries per tenant (for the snapshot: counts, never hashes)."""
        with self._lock:
            return {t: len(held) for t, held in self._tenants.items() if held}

    def _evict(self, held: OrderedDict[str, None]) -> list[str]:
        removed = []
        while len(held) > self.per_tenant:
            removed.append(held.popitem(last=False)[0])
            self._size -= 1
        while self._size > self.total:
            largest = max(self._tenants.values(), key=len)
            removed.append(largest.popitem(last=False)[0])
            self._size -= 1
        return removed
