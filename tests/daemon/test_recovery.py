"""Reclaiming a dead daemon's jobs when two live daemons reclaim at once (found in review;
real Redis, no model).

Every daemon runs ``reclaim_dead`` every few seconds. Two of them can list the same dead
consumer and its pending entries before either claims: with ``XCLAIM`` at idle time 0 the
second claim took the entries back from the first, and both served the job (two
``accepted``, two ends on one stream, the tenant billed twice). A claim now needs the entry
idle for a while, and claiming resets that: only one daemon wins each entry.
"""

from __future__ import annotations

import time
import uuid

from scheduler_daemon.recovery import Recovery
from tests.live_service import redis_conn
from wire import protocol


class NoWriter:
    def track(self, *_):
        pass

    def terminal(self, *_):
        raise AssertionError("a job that never started is served again, not ended")


def test_two_daemons_reclaiming_the_same_dead_daemon_serve_its_job_once():
    client = redis_conn()
    stream = protocol.jobs_stream(f"m-{uuid.uuid4().hex[:6]}")
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    client.xreadgroup(protocol.JOBS_GROUP, "dead-daemon", {stream: ">"})  # then it died
    time.sleep(1.2)  # as long at least as a heartbeat key outlives its daemon's death
    served: list[str] = []
    b = Recovery(client, stream, "daemon-b", NoWriter(), lambda _e, j, _t: served.append("b"),
                 None)
    a_client = redis_conn()
    a = Recovery(a_client, stream, "daemon-a", NoWriter(), lambda _e, j, _t: served.append("a"),
                 None)
    claim = a_client.xclaim

    def b_claims_first(*args, **kwargs):  # b read the same pending list before a claimed
        b.reclaim_dead(dead_idle_ms=0)
        return claim(*args, **kwargs)

    a_client.xclaim = b_claims_first
    try:
        a.reclaim_dead(dead_idle_ms=0)
        assert served == ["b"]
    finally:
        client.delete(stream)


def test_a_dead_daemons_entries_too_recent_to_claim_are_not_dropped_with_its_consumer():
    """Deleting a consumer deletes its pending entries: it goes only once it has none."""
    client = redis_conn()
    stream = protocol.jobs_stream(f"m-{uuid.uuid4().hex[:6]}")
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    client.xreadgroup(protocol.JOBS_GROUP, "dead-daemon", {stream: ">"})
    served: list[str] = []
    recovery = Recovery(client, stream, "daemon-a", NoWriter(),
                        lambda _e, j, _t: served.append(j.id), None)
    try:
        recovery.reclaim_dead(dead_idle_ms=0)  # just read: not idle long enough to claim
        time.sleep(1.2)
        recovery.reclaim_dead(dead_idle_ms=0)
        assert served == [job.id]
        recovery.reclaim_dead(dead_idle_ms=0)  # now without pending entries: the consumer goes
        names = [c["name"] for c in client.xinfo_consumers(stream, protocol.JOBS_GROUP)]
        assert b"dead-daemon" not in names
    finally:
        client.delete(stream)
