"""Fairness between tenants: one FIFO per key behind a round-robin of turns.

Used twice with the tenant as the key: by the scheduler for admission (key: the request's
``cache_scope``) and by the daemon's intake for the jobs it has read but not yet started
(key: the job's ``tenant_id``). The rules, in both places:

- each key keeps its own order (FIFO);
- the key whose turn it is offers its oldest item (``heads()`` lists the keys in turn order,
  so a caller that cannot take one key's head right now may look at the next key's);
- taking an item sends its key to the back of the turns if it still has items, and a key
  that starts waiting joins at the back. One key's burst therefore delays another key's
  next item by at most one item per other waiting key, however long the burst;
- removing an item without taking it (a cancel) leaves the turns as they were.

Not thread-safe: the scheduler holds its own lock around it; the intake wraps it in a
condition (``intake.PrepareQueue``).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class FairQueue(Generic[K, T]):
    """Items kept per key; the keys take turns."""

    def __init__(self) -> None:
        self._queues: dict[K, deque[tuple[int, T]]] = {}  # (arrival number, item), oldest first
        self._turns: deque[K] = deque()  # keys with items, in turn order
        self._arrivals = itertools.count()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[T]:
        """Every item in arrival order, whatever its key."""
        for _, item in heapq.merge(*self._queues.values(), key=lambda entry: entry[0]):
            yield item

    def count(self, key: K) -> int:
        """How many items ``key`` has waiting."""
        queue = self._queues.get(key)
        return len(queue) if queue else 0

    def push(self, key: K, item: T) -> None:
        """Queue ``item`` at the back of its key's FIFO (a new key joins the turns last)."""
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
            self._turns.append(key)
        queue.append((next(self._arrivals), item))
        self._size += 1

    def heads(self) -> Iterator[tuple[K, T]]:
        """(key, its oldest item) for every key, the one whose turn it is first."""
        for key in self._turns:
            yield key, self._queues[key][0][1]

    def pop(self) -> tuple[K, T] | None:
        """Take the oldest item of the key whose turn it is (None when empty)."""
        for key, item in self.heads():
            self.take(key, item)
            return key, item
        return None

    def take(self, key: K, item: T) -> None:
        """Take ``item`` (usually its key's head; any of its items may be taken): its key
        goes to the back of the turns if it still has items."""
        self._remove(key, item)
        if key in self._queues:
            self._turns.remove(key)
            self._turns.append(key)

    def remove(self, key: K, item: T) -> None:
        """Drop ``item`` without it counting as a turn (a cancel): the turns keep their order."""
        self._remove(key, item)

    def __contains__(self, item: object) -> bool:
        return any(entry[1] is item for queue in self._queues.values() for entry in queue)

    def _remove(self, key: K, item: T) -> None:
        queue = self._queues.get(key, ())
        for i, (_, queued) in enumerate(queue):
            if queued is item:  # by identity: two items may be equal
                del queue[i]
                break
        else:
            raise ValueError(f"the item is not queued under {key!r}")
        self._size -= 1
        if not queue:
            del self._queues[key]
            self._turns.remove(key)
