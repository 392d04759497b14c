"""``FairQueue``: one FIFO per key behind a round-robin of turns (the scheduler's admission
and the daemon's prepare queue both use it)."""

from __future__ import annotations

import threading

import pytest

from scheduler_daemon.core.fair_queue import FairQueue
from scheduler_daemon.service.intake import PrepareQueue
from wire import protocol


def filled(*items: str) -> FairQueue[str, str]:
    """Items named key + number ("a0", "b1"): the key is the first letter."""
    queue: FairQueue[str, str] = FairQueue()
    for item in items:
        queue.push(item[0], item)
    return queue


def drain(queue: FairQueue[str, str]) -> list[str]:
    out = []
    while (taken := queue.pop()) is not None:
        out.append(taken[1])
    return out


def test_keys_take_turns_and_each_keeps_its_order():
    queue = filled("a0", "a1", "a2", "a3", "b0", "b1", "c0")
    assert drain(queue) == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]
    assert len(queue) == 0 and not queue


def test_a_burst_delays_another_key_by_at_most_one_item_per_waiting_key():
    queue = filled(*[f"a{i}" for i in range(40)])
    queue.push("b", "b0")
    assert drain(queue).index("b0") == 1


def test_a_single_key_is_strict_fifo():
    assert drain(filled("a0", "a1", "a2")) == ["a0", "a1", "a2"]


def test_a_key_that_starts_waiting_joins_the_turns_last():
    queue = filled("a0", "a1", "b0")
    assert queue.pop() == ("a", "a0")  # a goes behind b
    queue.push("c", "c0")
    assert drain(queue) == ["b0", "a1", "c0"]


def test_heads_lists_every_keys_oldest_item_in_turn_order():
    queue = filled("a0", "a1", "b0", "c0")
    queue.take("a", "a0")
    assert list(queue.heads()) == [("b", "b0"), ("c", "c0"), ("a", "a1")]


def test_taking_an_item_that_is_not_the_head_still_ends_its_keys_turn():
    """The scheduler's session bypass takes a request from the middle of its scope's FIFO."""
    queue = filled("a0", "a1", "b0")
    queue.take("a", "a1")
    assert list(queue.heads()) == [("b", "b0"), ("a", "a0")]


def test_removing_an_item_leaves_the_turns_as_they_were():
    """A cancel is not a turn: the key keeps its place."""
    queue = filled("a0", "a1", "b0")
    queue.remove("a", "a0")
    assert list(queue.heads()) == [("a", "a1"), ("b", "b0")]
    queue.remove("b", "b0")  # the key's last item: the key leaves the turns
    assert list(queue.heads()) == [("a", "a1")]
    assert queue.count("b") == 0 and len(queue) == 1


def test_iteration_is_arrival_order_and_counts_are_per_key():
    queue = filled("a0", "b0", "a1", "c0", "b1")
    queue.pop()
    assert list(queue) == ["b0", "a1", "c0", "b1"]
    assert (queue.count("a"), queue.count("b"), queue.count("c"), queue.count("z")) == (1, 2, 1, 0)


def test_items_are_found_by_identity_not_equality():
    queue: FairQueue[str, list[int]] = FairQueue()
    first, second = [1], [1]  # equal, not the same
    queue.push("a", first)
    queue.push("a", second)
    queue.remove("a", second)
    assert queue.pop()[1] is first
    assert second not in queue and len(queue) == 0
    with pytest.raises(ValueError):
        queue.remove("a", second)


def _job(request_id: str, tenant: str) -> protocol.Job:
    return protocol.Job(id=request_id, kind="completion", model="m", tenant_id=tenant,
                        cache_scope=tenant, prompt="hello")


def test_the_prepare_queue_takes_tenants_in_turn():
    queue = PrepareQueue()
    for job in [_job(f"a{i}", "A") for i in range(3)] + [_job("b0", "B")]:
        queue.put(f"entry-{job.id}", job)
    taken = [queue.get(timeout=0) for _ in range(4)]
    assert [(entry, job.id) for entry, job, _takeover in taken] == [
        ("entry-a0", "a0"), ("entry-b0", "b0"), ("entry-a1", "a1"), ("entry-a2", "a2")
    ]
    assert queue.get(timeout=0) is None and len(queue) == 0


def test_the_prepare_queue_wakes_a_waiting_reader():
    queue = PrepareQueue()
    got = []
    reader = threading.Thread(target=lambda: got.append(queue.get(timeout=3600)), daemon=True)
    reader.start()
    queue.put("1-0", _job("x", "A"))
    reader.join(60)  # a hang guard: woken by the put, not by its hour-long timeout
    assert got and got[0][1].id == "x"
