"""The model's fair queue in Redis and the web's gate in front of it (wire/queue.py, issue
17), against the real test Redis. No model: these are the queue's own rules.

- jobs are taken fair across tenants (one tenant's burst delays another's job by a turn),
  each tenant's in its order, only as many as a daemon asks for;
- a taken job is pending under the daemon that took it (the dead-daemon recovery's view);
  a waiting one under the placeholder consumer, which recovery never takes for dead;
- entries added without the script, or deleted while waiting, cost nothing;
- the gate refuses ``queue_full`` (503) and ``tenant_queue_full`` (429) from what Redis
  holds, with a Retry-After from the daemons' drain rate, and counts what it refused; no
  live daemon in the fleet hash: it admits (the web waits for one).
"""

from __future__ import annotations

import time
import uuid

import pytest

from inference import limits
from inference.errors import ApiError
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.recovery import Recovery
from tests.live_service import redis_conn
from wire import affinity, protocol, queue
from wire import limits as wire_limits


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
    assert not r.exists(queue.tenants_key(model))
    assert r.hkeys(queue.tags_key(model)) == [b"A"]  # only the tenant served last (ahead)
    assert r.zcard(queue.ready_key(model)) == 0


def test_a_tenant_served_as_the_queue_empties_is_still_behind_a_newcomer(model):
    """A's job is taken as soon as it comes (the queue empties), A floods, then B sends one:
    B goes before A's flood. Forgetting A's tag when the queue emptied tied B with A's
    next job, and the tie went to A (found by a daemon test that failed now and then)."""
    r = redis_conn()
    queue.enqueue(r, job(model, "A", "a0"))
    assert len(take_all(r, model, count=1)) == 1  # taken: nothing waits now
    for i in range(1, 3):
        queue.enqueue(r, job(model, "A", f"a{i}"))
    queue.enqueue(r, job(model, "B", "b0"))
    assert [j.prompt for j in take_all(r, model)] == ["b0", "a1", "a2"]


def test_a_take_sent_again_gets_the_same_jobs_back_and_no_others(model):
    """A take whose reply was lost (the jobs pending under the daemon, which never saw
    them) is sent again under the same number: the same jobs come back, nothing more is
    taken; the next number takes on."""
    r = redis_conn()
    for tenant in ("A", "B", "C"):
        queue.enqueue(r, job(model, tenant))
    first, _ = queue.take(r, model, "d1", 2, seq=7)  # its reply "lost"
    again, _ = queue.take(r, model, "d1", 2, seq=7)
    assert [e[0] for e in again] == [e[0] for e in first] and len(first) == 2
    assert queue.take(r, model, "d1", 0, seq=8)[0] == []  # a touch takes nothing
    rest, _ = queue.take(r, model, "d1", 5, seq=8)
    assert len(rest) == 1 and rest[0][0] not in {e[0] for e in first}
    assert queue.take(r, model, "d1", 5, seq=8)[0] == rest  # that one sent again too
    r.xclaim(queue.jobs_stream(model), protocol.JOBS_GROUP, "d2", 0, [rest[0][0]])
    assert queue.take(r, model, "d1", 5, seq=8)[0] == []  # d2 reclaimed it: not d1's


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


def test_an_enqueue_sent_again_places_the_job_once(model):
    """A resent ENQUEUE (its first reply lost to a broken connection) gets the first
    placement back: one entry, taken once, never run twice."""
    r = redis_conn()
    queued = job(model, "A")
    first = queue.enqueue(r, queued)
    assert queue.enqueue(r, queued) == first
    assert r.xlen(queue.jobs_stream(model)) == 1
    assert len(take_all(r, model, count=5)) == 1


def test_a_job_deleted_while_waiting_is_skipped(model):
    r = redis_conn()
    gone = queue.enqueue(r, job(model, "A", "gone")).entry_id
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
    recovery = Recovery(DaemonContext(r, model, "d-live"), writer=None,
                        requeue=lambda *args: requeued.append(args), refuse=None)
    assert recovery.reclaim_dead(dead_idle_ms=0) == 0 and not requeued
    assert r.zcard(queue.ready_key(model)) == 3


# -- the gate ----------------------------------------------------------------------------------


def fleet(r, model: str, daemon: str = "d1", at: float | None = None, **fields) -> None:
    entry = {"at": time.time() if at is None else at, "taking": True, "max_queue": 3,
             "max_queue_per_tenant": 2, "drain_per_s": 0.5, "capacity": 4, "held": 4, **fields}
    r.hset(queue.fleet_key(model), daemon, queue.FleetEntry(**entry).encode())
    r.hset(queue.load_key(model), daemon, entry["held"])  # as its heartbeat sets it


def admit(model: str, tenant: str, max_queued: int | None = None, request_id: str = "",
          now: float | None = None) -> ApiError | None:
    try:
        limits.admit_sync(tenant, request_id or uuid.uuid4().hex, limits.Limits(), model=model,
                          max_queued=max_queued, now=now)
    except ApiError as error:
        return error
    return None


def admit_and_enqueue(r, model: str, tenant: str, route: queue.Route | None = None,
                      **kw) -> ApiError | None:
    """What the web does: the gate admits, then the job is enqueued under the same id."""
    queued = job(model, tenant)
    refused = admit(model, tenant, request_id=queued.id, **kw)
    if refused is None:
        queue.enqueue(r, queued, route=route)
    return refused


def test_the_gate_refuses_a_full_queue_with_503_and_a_retry_after_from_the_drain(model):
    r = redis_conn()
    fleet(r, model)
    tenants = ["t1", "t2", "t3"]
    for t in tenants:
        assert admit_and_enqueue(r, model, t) is None
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
        assert admit_and_enqueue(r, model, "A") is None
    refused = admit(model, "A")
    assert refused is not None and (refused.code, refused.status) == ("tenant_queue_full", 429)
    assert int(refused.headers["Retry-After"]) >= 1
    assert admit(model, "B") is None  # another tenant is not held by A's share
    assert admit(model, "A", max_queued=5) is None  # the tenant's own cap wins


def test_a_tenants_retry_after_tells_nothing_of_other_tenants_queues(model):
    """A 429's Retry-After is the tenant's own jobs over the drain rate: the same whether
    no other tenant or many have work waiting (it must not let a tenant count them)."""
    r = redis_conn()
    fleet(r, model, max_queue=50)
    for _ in range(2):
        assert admit_and_enqueue(r, model, "A") is None
    alone = admit(model, "A")
    for other in ("B", "C", "D", "E"):
        assert admit_and_enqueue(r, model, other) is None
    crowded = admit(model, "A")
    assert alone.code == crowded.code == "tenant_queue_full"
    # A's 2 jobs drained at 0.5 jobs/s: 4 s, alone or behind four other tenants
    assert alone.headers["Retry-After"] == crowded.headers["Retry-After"] == "4" \
        == str(queue.retry_after(2, 0.5))


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
        assert admit_and_enqueue(r, model, t) is None
    assert admit(model, "t4").code == "queue_full"


def test_a_live_load_below_zero_gives_no_more_room_than_an_idle_daemon(model):
    """Ends the daemon never took through TAKE (a dead one's jobs it took over) take the
    live load below zero until the next beat resets it: it counts as idle, no more."""
    r = redis_conn()
    fleet(r, model, max_queue=0, capacity=2, held=0)
    r.hset(queue.load_key(model), "d1", -5)
    assert [admit_and_enqueue(r, model, t) for t in ("t1", "t2")] == [None, None]
    assert admit(model, "t3").code == "queue_full"


def test_a_burst_admitted_at_once_counts_before_it_is_enqueued(model):
    r = redis_conn()
    fleet(r, model, max_queue=3)
    held = [uuid.uuid4().hex for _ in range(3)]
    for request_id in held:  # admitted, none enqueued yet (the web's gap between the two)
        assert admit(model, "A", max_queued=9, request_id=request_id) is None
    assert admit(model, "B").code == "queue_full"
    pipe = r.pipeline()
    queue.unadmit(pipe, model, "A", held[0])  # one will not be enqueued after all
    pipe.execute()
    assert admit(model, "B") is None
    # a place held by a web that died lapses after ADMIT_HOLD_S
    later = time.time() + queue.ADMIT_HOLD_S + 1
    fleet(r, model, max_queue=3, at=later)  # the daemon is still there then
    assert admit(model, "C", now=later - queue.ADMIT_HOLD_S).code == "queue_full"
    assert admit(model, "C", now=later) is None


def test_taking_a_job_makes_room_at_the_gate(model):
    r = redis_conn()
    fleet(r, model, max_queue=1)
    queue.enqueue(r, job(model, "A"))
    assert admit(model, "B").code == "queue_full"
    queue.take(r, model, "d1", 1)
    assert admit(model, "B") is None


# -- routing (ENQUEUE's placement; the web computes the chain: wire/affinity.py) ----------------


def route(mode: str = queue.ROUTE_CACHE_AWARE, session: str = "", chain=(),
          **kw) -> queue.Route:
    return queue.Route(mode=mode, session_key=session, chain=tuple(chain), **kw)


def two_daemons(r, model: str, **loads) -> None:
    for daemon in ("d1", "d2"):
        fleet(r, model, daemon, max_queue=50, held=loads.get(daemon, 0))


def summary(r, daemon: str, *hashes: str) -> None:
    r.delete(affinity.summary_key(daemon))
    if hashes:
        r.sadd(affinity.summary_key(daemon), *hashes)


@pytest.fixture
def daemons():
    yield
    redis_conn().delete(affinity.summary_key("d1"), affinity.summary_key("d2"),
                        affinity.summary_key("d3"))


def test_the_longest_affinity_match_wins_and_only_that_daemon_takes_it(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    summary(r, "d2", "h1", "h2")
    placed = queue.enqueue(r, job(model, "A"), route=route(chain=["h1", "h2", "h3"]))
    assert (placed.reason, placed.daemon) == ("affinity", "d2")
    assert r.zcard(queue.routed_key(model, "d2")) == 1 and r.zcard(queue.ready_key(model)) == 0
    assert queue.take(r, model, "d1", 5)[0] == []  # routed elsewhere: not d1's to take
    assert len(queue.take(r, model, "d2", 5)[0]) == 1
    assert int(r.hget(queue.routes_key(model), "affinity:d2")) == 1


def test_a_match_must_start_at_the_first_piece(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h2", "h3")  # the same later pieces after another first one
    placed = queue.enqueue(r, job(model, "A"), route=route(chain=["h1", "h2", "h3"]))
    assert placed.reason == "least_loaded" and placed.daemon in ("d1", "d2")


def test_a_busy_affinity_daemon_is_passed_over_for_the_least_loaded(model, daemons):
    r = redis_conn()
    two_daemons(r, model, d1=8, d2=0)
    summary(r, "d1", "h1")
    placed = queue.enqueue(r, job(model, "A"), route=route(chain=["h1"], balance_abs=4,
                                                            balance_rel=1.5))
    assert (placed.reason, placed.daemon) == ("least_loaded", "d2")  # it has room
    two_daemons(r, model, d1=12, d2=4)  # d2 full too (capacity 4): the shared queue
    r.delete(queue.routed_key(model, "d2"))
    placed = queue.enqueue(r, job(model, "A"), route=route(chain=["h1"], balance_abs=4,
                                                            balance_rel=1.5))
    assert (placed.reason, placed.daemon) == ("least_loaded", "")
    assert r.zcard(queue.ready_key(model)) == 1
    # within the thresholds it still goes there
    placed = queue.enqueue(r, job(model, "A"), route=route(chain=["h1"], balance_abs=10))
    assert (placed.reason, placed.daemon) == ("affinity", "d1")


def test_jobs_routed_to_a_daemon_count_in_its_load(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    reasons = [queue.enqueue(r, job(model, "A"), route=route(chain=["h1"], balance_abs=2,
                                                              balance_rel=1.0)).reason
               for _ in range(5)]
    # d1's load reaches 3, past 2 more than d2's 0: one to d2, whose load then counts too
    assert reasons == ["affinity"] * 3 + ["least_loaded", "affinity"]
    assert r.zcard(queue.routed_key(model, "d2")) == 1


def test_a_session_sticks_to_its_daemon_over_affinity(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    key = affinity.session_key(model, "s" * 16)
    r.set(key, "d2", ex=60)
    try:
        placed = queue.enqueue(r, job(model, "A"), route=route(session=key, chain=["h1"]))
        assert (placed.reason, placed.daemon) == ("session", "d2")
        r.set(key, "gone-daemon", ex=60)  # its daemon is not live: affinity decides
        placed = queue.enqueue(r, job(model, "A"), route=route(session=key, chain=["h1"]))
        assert (placed.reason, placed.daemon) == ("affinity", "d1")
    finally:
        r.delete(key)


def test_no_hint_one_daemon_or_shared_routing_use_the_shared_queue(model, daemons):
    r = redis_conn()
    fleet(r, model, "d1", max_queue=50)
    summary(r, "d1", "h1")
    assert queue.enqueue(r, job(model, "A"), route=route(chain=["h1"])).reason == "fallback"
    fleet(r, model, "d2", max_queue=50)
    assert queue.enqueue(r, job(model, "A"), route=route()).reason == "fallback"
    placed = queue.enqueue(r, job(model, "A"), route=route(queue.ROUTE_SHARED, chain=["h1"]))
    assert (placed.reason, placed.daemon) == ("fallback", "")
    assert r.zcard(queue.ready_key(model)) == 3


def test_round_robin_takes_the_live_daemons_in_turn(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    fleet(r, model, "d3", taking=False)  # drained: never routed to
    placed = [queue.enqueue(r, job(model, "A"), route=route(queue.ROUTE_ROUND_ROBIN)).daemon
              for _ in range(4)]
    assert sorted(placed) == ["d1", "d1", "d2", "d2"] and placed[0] != placed[1]


def test_what_was_routed_to_a_gone_or_drained_daemon_goes_back_to_the_shared_queue(model,
                                                                                daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    routed = [queue.enqueue(r, job(model, "A"), route=route(chain=["h1"])) for _ in range(2)]
    assert {p.daemon for p in routed} == {"d1"}
    assert queue.waiting(r, model) == 2
    fleet(r, model, "d1", taking=False)  # an operator drained it
    assert len(queue.take(r, model, "d2", 1)[0]) == 1
    fleet(r, model, "d1", at=time.time() - 60)  # now it died
    assert len(queue.take(r, model, "d2", 5)[0]) == 1
    assert not r.exists(queue.routed_key(model, "d1"))


def test_a_stopping_daemon_hands_its_routed_jobs_to_the_shared_queue(model, daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    queue.enqueue(r, job(model, "A"), route=route(chain=["h1"]))
    assert queue.drain_back(r, model, "d1") == 1
    assert r.zcard(queue.ready_key(model)) == 1


def test_leaving_moves_the_routed_jobs_and_the_fleet_entry_in_one_step(model, daemons):
    """A stopping daemon's move and its fleet entry's removal are one script: had the entry
    gone first and the move never come (Redis away, the process killed between), its routed
    jobs would wait in a set no TAKE looks at (only the listed daemons' sets are drained)."""
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    queue.enqueue(r, job(model, "A"), route=route(chain=["h1"]))
    assert queue.drain_back(r, model, "d1", leave=True) == 1
    assert not r.hexists(queue.fleet_key(model), "d1")
    assert not r.hexists(queue.load_key(model), "d1")
    assert len(queue.take(r, model, "d2", 5)[0]) == 1


def test_a_daemon_that_never_said_goodbye_has_its_routed_jobs_taken_once_stale(model,
                                                                              daemons):
    r = redis_conn()
    two_daemons(r, model)
    summary(r, "d1", "h1")
    queue.enqueue(r, job(model, "A"), route=route(chain=["h1"]))
    assert queue.take(r, model, "d2", 5)[0] == []  # d1 is alive: its job waits for it
    fleet(r, model, "d1", at=time.time() - 60)  # its entry, still listed, goes stale
    assert len(queue.take(r, model, "d2", 5)[0]) == 1


def test_the_gate_counts_routed_jobs_as_waiting(model, daemons):
    r = redis_conn()
    fleet(r, model, "d1", max_queue=1)
    fleet(r, model, "d2", max_queue=1)
    summary(r, "d1", "h1")
    for _ in range(2):
        assert admit_and_enqueue(r, model, "A", route(chain=["h1"], balance_abs=9),
                                 max_queued=9) is None
    assert r.zcard(queue.ready_key(model)) == 0
    assert admit(model, "B").code == "queue_full"


# -- affinity chains ----------------------------------------------------------------------------


def test_a_chain_hashes_whole_leading_pieces_and_shares_a_common_prefix():
    salt = affinity.tenant_salt("secret", "7")
    base = "s" * affinity.PIECE_CHARS * 2
    one, two = affinity.chain(salt, base + "x" * 300), affinity.chain(salt, base + "y" * 300)
    assert len(one) == len(two) == 3 and one[:2] == two[:2] and one[2] != two[2]
    assert affinity.chain(salt, "short") == []  # no whole piece: no hint
    assert len(affinity.chain(salt, "z" * 10**6)) == affinity.MAX_PIECES


def test_another_tenants_chain_of_the_same_text_shares_nothing():
    text = "The system prompt of tenant A. " * 40
    a = affinity.chain(affinity.tenant_salt("secret", "1"), text)
    b = affinity.chain(affinity.tenant_salt("secret", "2"), text)
    assert a and b and not set(a) & set(b)
    # and under another service secret, another chain again
    assert not set(a) & set(affinity.chain(affinity.tenant_salt("other", "1"), text))


def test_chat_messages_hash_by_role_and_content():
    salt = affinity.tenant_salt("secret", "1")
    system = {"role": "system", "content": "Be brief. " * 60}
    first = affinity.prompt_text(None, [system, {"role": "user", "content": "Hi"}])
    later = affinity.prompt_text(None, [system, {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "Hello"}])
    assert affinity.chain(salt, later)[:len(affinity.chain(salt, first))] == \
        affinity.chain(salt, first)
    as_user = affinity.prompt_text(None, [{**system, "role": "user"}])
    assert affinity.chain(salt, as_user)[0] != affinity.chain(salt, first)[0]


def test_the_load_is_live_between_two_heartbeats(model):
    """TAKE counts what a daemon takes at once (a job's end takes it off: the writer), so
    the gate and the routing do not wait for the next heartbeat to see a daemon fill up."""
    r = redis_conn()
    fleet(r, model, max_queue=0, held=0, capacity=2)
    for _ in range(2):
        assert admit_and_enqueue(r, model, "A") is None
    assert len(queue.take(r, model, "d1", 2)[0]) == 2
    assert int(r.hget(queue.load_key(model), "d1")) == 2
    assert admit(model, "B").code == "queue_full"  # its beat still says 0 held
