"""The model's fair queue in Redis and the web's gate in front of it (wire/queue.py, issue
17), against the real test Redis. No model: these are the queue's own rules.

- jobs are taken fair across tenants (one tenant's burst delays another's job by a turn),
  each tenant's in its order, only as many as a daemon asks for;
- a taken job is pending under the daemon that took it (the dead-daemon recovery's view);
  a waiting one under the placeholder consumer, which recovery never takes for dead;
- entries added without the script, or deleted while waiting, cost nothing;
- the gate refuses ``queue_full`` (503) and ``tenant_queue_full`` (429) from what Redis
  holds, with a Retry-After from the daemons' drain rate, and counts what it refused; no
  live daemon in the fleet hash: it admits (the web waits for one, as before).
"""

from __future__ import annotations

import time
import uuid

import pytest

from inference import limits
from inference.errors import ApiError
from scheduler_daemon.recovery import Recovery
from tests.live_service import redis_conn
from wire import limits as wire_limits
from wire import protocol, queue


@pytest.fixture
def model():
    name = f"q-{uuid.uuid4().hex[:8]}"
    yield name
    redis_conn().delete(*queue.keys_of(name))


def job(model: str, tenant: str, prompt: str = "x") -> protocol.Job:
    return protocol.Job(id=uuid.uuid4().hex, kind="completion", model=model, tenant_id=tenant,
                        cache_scope=tenant, prompt=prompt)


def take_all(r, model: str, daemon: str = "d1", count: int = 1) -> list[protocol.Job]:
    out = []
    while True:
        entries, _ = queue.take(r, model, daemon, count)
        if not entries:
            return out
        out += [protocol.Job.decode(fields) for _, fields in entries]


def test_one_tenants_burst_delays_another_by_one_turn(model):
    r = redis_conn()
    a = [job(model, "A", f"a{i}") for i in range(40)]
    for j in a:
        queue.enqueue(r, j)
    b = job(model, "B", "b0")
    queue.enqueue(r, b)
    order = [j.id for j in take_all(r, model)]
    assert len(order) == 41 and order.index(b.id) <= 1  # not after A's forty
    assert [i for i in order if i != b.id] == [j.id for j in a]  # A's own order kept


def test_turns_alternate_between_tenants_and_keep_each_fifo(model):
    r = redis_conn()
    for name in ("a0", "a1", "a2", "a3"):
        queue.enqueue(r, job(model, "A", name))
    for name in ("b0", "b1"):
        queue.enqueue(r, job(model, "B", name))
    queue.enqueue(r, job(model, "C", "c0"))
    order = [j.prompt for j in take_all(r, model)]
    assert order == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_tenant_arriving_late_waits_one_turn_not_for_what_was_taken(model):
    r = redis_conn()
    for i in range(6):
        queue.enqueue(r, job(model, "A", f"a{i}"))
    entries, _ = queue.take(r, model, "d1", 3)  # a0..a2 taken: the clock is at a2's turn
    assert len(entries) == 3
    queue.enqueue(r, job(model, "B", "b0"))
    order = [j.prompt for j in take_all(r, model)]
    assert order[:2] in (["a3", "b0"], ["b0", "a3"]) and order[2:] == ["a4", "a5"]


def test_take_gives_at_most_count_and_moves_them_to_the_daemon(model):
    r = redis_conn()
    for i in range(5):
        queue.enqueue(r, job(model, "A", f"p{i}"))
    entries, _ = queue.take(r, model, "d1", 2)
    assert len(entries) == 2
    stream = protocol.jobs_stream(model)
    by_consumer = {protocol.as_text(c["name"]): c["pending"]
                   for c in r.xpending(stream, protocol.JOBS_GROUP)["consumers"]}
    assert by_consumer == {"d1": 2, queue.HOLDER: 3}
    assert r.zcard(queue.ready_key(model)) == 3
    assert int(r.hget(queue.tenants_key(model), "A")) == 3
    assert len(take_all(r, model, "d2", 10)) == 3
    assert not r.exists(queue.tenants_key(model), queue.tags_key(model), queue.clock_key(model))
    assert r.zcard(queue.ready_key(model)) == 0


def test_count_zero_takes_nothing_but_shows_the_consumer_alive(model):
    r = redis_conn()
    queue.enqueue(r, job(model, "A"))
    entries, _ = queue.take(r, model, "d1", 0)
    assert entries == []
    consumers = {protocol.as_text(c["name"]): c
                 for c in r.xinfo_consumers(protocol.jobs_stream(model), protocol.JOBS_GROUP)}
    assert consumers["d1"]["pending"] == 0 and consumers["d1"]["idle"] < 1000
    assert r.zcard(queue.ready_key(model)) == 1


def test_entries_added_without_the_script_are_swept_in_and_taken(model):
    r = redis_conn()
    queue.enqueue(r, job(model, "A", "first"))  # makes the group
    stray = job(model, "B", "stray")
    r.xadd(protocol.jobs_stream(model), stray.encode())
    r.xadd(protocol.jobs_stream(model), {"job": "{not json"})
    taken = [fields for _, fields in queue.take(r, model, "d1", 10)[0]]
    assert len(taken) == 3
    assert protocol.Job.decode(taken[1]).id == stray.id or \
        protocol.Job.decode(taken[0]).id == stray.id
    assert {"job": "{not json"} in [{protocol.as_text(k): protocol.as_text(v)
                                     for k, v in f.items()} for f in taken]


def test_a_job_deleted_while_waiting_is_skipped(model):
    r = redis_conn()
    gone = queue.enqueue(r, job(model, "A", "gone"))
    kept = job(model, "A", "kept")
    queue.enqueue(r, kept)
    r.xdel(protocol.jobs_stream(model), gone)
    assert [j.id for j in take_all(r, model, count=5)] == [kept.id]


def test_the_bell_wakes_a_waiting_daemon_only_for_a_new_job(model):
    r = redis_conn()
    queue.enqueue(r, job(model, "A"))
    _, bell = queue.take(r, model, "d1", 5)
    assert not queue.wait_for_bell(r, model, bell, block_ms=50)
    queue.enqueue(r, job(model, "A"))
    assert queue.wait_for_bell(r, model, bell, block_ms=50)


def test_recovery_never_takes_the_waiting_jobs_for_a_dead_daemons(model):
    r = redis_conn()
    for i in range(3):
        queue.enqueue(r, job(model, "A", f"w{i}"))
    requeued = []
    recovery = Recovery(r, protocol.jobs_stream(model), "d-live", writer=None,
                        requeue=lambda *args: requeued.append(args), refuse=None)
    assert recovery.reclaim_dead(dead_idle_ms=0) == 0 and not requeued
    assert r.zcard(queue.ready_key(model)) == 3


# -- the gate ----------------------------------------------------------------------------------


def fleet(r, model: str, daemon: str = "d1", at: float | None = None, **fields) -> None:
    entry = {"at": time.time() if at is None else at, "taking": True, "max_queue": 3,
             "max_queue_per_tenant": 2, "drain_per_s": 0.5, "capacity": 4, "held": 4, **fields}
    r.hset(queue.fleet_key(model), daemon, queue.FleetEntry(**entry).encode())


def admit(model: str, tenant: str, max_queued: int | None = None) -> ApiError | None:
    try:
        limits.admit_sync(tenant, uuid.uuid4().hex, limits.Limits(), model=model,
                          max_queued=max_queued)
    except ApiError as error:
        return error
    return None


def test_the_gate_refuses_a_full_queue_with_503_and_a_retry_after_from_the_drain(model):
    r = redis_conn()
    fleet(r, model)
    tenants = ["t1", "t2", "t3"]
    for t in tenants:
        assert admit(model, t) is None
        queue.enqueue(r, job(model, t))
    refused = admit(model, "t4")
    assert refused is not None and refused.code == "queue_full" and refused.status == 503
    # 3 waiting, drained at 0.5 jobs/s: 6 s
    assert refused.headers["Retry-After"] == "6" == str(queue.retry_after(3, 0.5))
    assert wire_limits.refusal_counts(r, "t4") == {"queue_full": 1}
    fleet(r, model, "d2")  # a second live daemon doubles the room
    assert admit(model, "t4") is None


def test_the_gate_refuses_a_tenants_full_share_with_429(model):
    r = redis_conn()
    fleet(r, model, max_queue=10)
    for _ in range(2):
        assert admit(model, "A") is None
        queue.enqueue(r, job(model, "A"))
    refused = admit(model, "A")
    assert refused is not None and (refused.code, refused.status) == ("tenant_queue_full", 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert admit(model, "B") is None  # another tenant is not held by A's share
    assert admit(model, "A", max_queued=5) is None  # the tenant's own cap wins


def test_the_gate_counts_only_live_daemons_that_take_jobs(model):
    r = redis_conn()
    for t in ("t1", "t2", "t3"):
        queue.enqueue(r, job(model, t))
    fleet(r, model, "stale", at=time.time() - 10)
    fleet(r, model, "drained", taking=False)
    assert admit(model, "t9") is None  # none counts: admitted, the web waits for a daemon
    fleet(r, model, "live")
    assert admit(model, "t9").code == "queue_full"


def test_the_room_daemons_have_free_counts_at_the_gate(model):
    r = redis_conn()
    fleet(r, model, max_queue=1, held=2)  # 2 of its 4 free at its last beat
    for t in ("t1", "t2", "t3"):
        assert admit(model, t) is None
        queue.enqueue(r, job(model, t))
    assert admit(model, "t4").code == "queue_full"


def test_taking_a_job_makes_room_at_the_gate(model):
    r = redis_conn()
    fleet(r, model, max_queue=1)
    queue.enqueue(r, job(model, "A"))
    assert admit(model, "B").code == "queue_full"
    queue.take(r, model, "d1", 1)
    assert admit(model, "B") is None
