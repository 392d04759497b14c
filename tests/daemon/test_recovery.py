"""Reclaiming a dead daemon's jobs (real Redis, no model).

Every daemon runs ``reclaim_dead`` every few seconds. Two of them can list the same dead
consumer and its pending entries before either claims: with ``XCLAIM`` at idle time 0 the
second claim took the entries back from the first, and both served the job (two
``accepted``, two ends on one stream, the tenant billed twice). A claim now needs the entry
idle for a while, and claiming resets that: only one daemon wins each entry.

The quarantine counts distinct deaths (a run of a daemon id ending uncleanly): copies of a
request at one death, and two daemons recovering one death, count it once; a request
running at two deaths (two runs of one id, restarted as the supervisor does) is refused.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.intake import job_fingerprint
from scheduler_daemon.service.recovery import CLAIM_MIN_IDLE_MS, Recovery
from tests.live_service import redis_conn, wait_until
from wire import protocol


class NoWriter:
    def track(self, *_):
        pass

    def terminal(self, *_):
        raise AssertionError("a job that never started is served again, not ended")


def until_claimable(client, stream: str) -> None:
    """Wait until every pending entry of the jobs group has been idle CLAIM_MIN_IDLE_MS, as a
    claim needs (Redis's own idle time, so no guess at the clocks)."""
    wait_until(lambda: all(
        entry["time_since_delivered"] >= CLAIM_MIN_IDLE_MS
        for entry in client.xpending_range(stream, protocol.JOBS_GROUP, "-", "+", count=100)),
        timeout_s=CLAIM_MIN_IDLE_MS / 1000 + 10)


def test_two_daemons_reclaiming_the_same_dead_daemon_serve_its_job_once():
    client = redis_conn()
    model = f"m-{uuid.uuid4().hex[:6]}"
    stream = protocol.jobs_stream(model)
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    client.xreadgroup(protocol.JOBS_GROUP, "dead-daemon", {stream: ">"})  # then it died
    until_claimable(client, stream)
    served: list[str] = []
    b = Recovery(DaemonContext(client, model, "daemon-b"), NoWriter(),
                 lambda _e, j, _t: served.append("b"), None)
    a_client = redis_conn()
    a = Recovery(DaemonContext(a_client, model, "daemon-a"), NoWriter(),
                 lambda _e, j, _t: served.append("a"), None)
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
    model = f"m-{uuid.uuid4().hex[:6]}"
    stream = protocol.jobs_stream(model)
    client.xgroup_create(stream, protocol.JOBS_GROUP, id="0", mkstream=True)
    job = protocol.Job(id=uuid.uuid4().hex, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="x")
    client.xadd(stream, job.encode())
    client.xreadgroup(protocol.JOBS_GROUP, "dead-daemon", {stream: ">"})
    served: list[str] = []
    recovery = Recovery(DaemonContext(client, model, "daemon-a"), NoWriter(),
                        lambda _e, j, _t: served.append(j.id), None)
    try:
        recovery.reclaim_dead(dead_idle_ms=0)  # just read: not idle long enough to claim
        assert served == []
        until_claimable(client, stream)
        recovery.reclaim_dead(dead_idle_ms=0)
        assert served == [job.id]
        recovery.reclaim_dead(dead_idle_ms=0)  # now without pending entries: the consumer goes
        names = [c["name"] for c in client.xinfo_consumers(stream, protocol.JOBS_GROUP)]
        assert b"dead-daemon" not in names
    finally:
        client.delete(stream)


# -- the quarantine counts distinct deaths -----------------------------------------------------


class Ends:
    """The writer and refuse callback of a Recovery: what each job became."""

    def __init__(self) -> None:
        self.served: list[str] = []  # requeued here (served again or continued)
        self.refused: list[tuple[str, str]] = []  # (request id, code)

    def track(self, *_: Any) -> None:
        pass

    def terminal(self, request_id: str, _entry: str, kind: str, data: dict[str, Any]) -> None:
        self.refused.append((request_id, data["code"]))

    def recovery(self, client, model: str, daemon_id: str) -> Recovery:
        return Recovery(DaemonContext(client, model, daemon_id), self,
                        lambda _e, job, _t: self.served.append(job.id),
                        lambda request_id, _e, refusal: self.refused.append(
                            (request_id, refusal.code)))


class DeadRun:
    """Jobs read by one run of a daemon id that then died: its pending entries and its
    running hash, as intake.py writes them."""

    def __init__(self, client, daemon_id: str) -> None:
        self.redis, self.daemon_id = client, daemon_id
        self.model = f"m-{uuid.uuid4().hex[:6]}"
        self.stream = protocol.jobs_stream(self.model)
        client.xgroup_create(self.stream, protocol.JOBS_GROUP, id="0", mkstream=True)
        self.jobs: list[protocol.Job] = []
        self.entries: dict[str, bytes] = {}  # request id -> its jobs stream entry

    def read(self, *jobs: protocol.Job) -> None:
        for job in jobs:
            self.entries[job.id] = self.redis.xadd(self.stream, job.encode())
        self.redis.xreadgroup(protocol.JOBS_GROUP, self.daemon_id, {self.stream: ">"})
        self.jobs.extend(jobs)

    def start(self, run_id: str, *jobs: protocol.Job) -> None:
        """Run ``run_id`` starts ``jobs`` (as intake.py records them before native code)."""
        for job in jobs:
            self.redis.hset(protocol.running_key(self.daemon_id), job.id,
                            protocol.running_entry(run_id, job_fingerprint(job)))

    def deaths(self, job: protocol.Job) -> set[str]:
        return {m.decode() for m in
                self.redis.smembers(protocol.deaths_key(job_fingerprint(job)))}

    def quarantined(self, job: protocol.Job) -> bool:
        return bool(self.redis.hexists(protocol.QUARANTINE_HASH, job_fingerprint(job)))

    def clean(self) -> None:
        for job in self.jobs:
            self.redis.delete(protocol.deaths_key(job_fingerprint(job)),
                              protocol.owner_key(job.id))
            self.redis.hdel(protocol.QUARANTINE_HASH, job_fingerprint(job))
        self.redis.delete(self.stream, protocol.running_key(self.daemon_id))


def same_request(tenant_id: str = "1") -> protocol.Job:
    """A common request: every copy has the same content (and so, per tenant, the same
    fingerprint)."""
    return protocol.Job(id=uuid.uuid4().hex, kind="chat", model="m", tenant_id=tenant_id,
                        cache_scope=tenant_id, messages=[{"role": "user", "content": "Hi"}],
                        params={"max_tokens": 16})


def test_copies_of_one_request_at_one_death_count_once_and_all_go_on():
    client = redis_conn()
    run = DeadRun(client, f"d-{uuid.uuid4().hex[:6]}")
    copies = [same_request("1"), same_request("1"), same_request("2")]
    try:
        run.read(*copies)
        run.start("run1", *copies)
        ends = Ends()
        ends.recovery(client, run.model, run.daemon_id).reclaim_own()  # restarted, same id
        assert ends.refused == []
        assert ends.served == [job.id for job in copies]
        assert run.deaths(copies[0]) == {f"{run.daemon_id}/run1"}
        assert not any(run.quarantined(job) for job in copies)
        assert not client.hlen(protocol.running_key(run.daemon_id))  # the dead run's records
    finally:
        run.clean()


def test_a_request_running_at_two_deaths_of_one_daemon_id_is_quarantined():
    client = redis_conn()
    run = DeadRun(client, f"d-{uuid.uuid4().hex[:6]}")
    job = same_request()
    try:
        run.read(job)
        run.start("run1", job)
        first = Ends()
        second_run = first.recovery(client, run.model, run.daemon_id)
        second_run.reclaim_own()
        assert first.served == [job.id] and first.refused == []
        run.start(second_run.run_id, job)  # the restarted run starts it again, and dies too
        third = Ends()
        third.recovery(client, run.model, run.daemon_id).reclaim_own()
        assert third.refused == [(job.id, protocol.REQUEST_QUARANTINED)]
        assert third.served == []
        record = json.loads(client.hget(protocol.QUARANTINE_HASH, job_fingerprint(job)))
        assert record["deaths"] == 2 and record["request_id"] == job.id
        assert record["death_ids"] == sorted([f"{run.daemon_id}/run1",
                                              f"{run.daemon_id}/{second_run.run_id}"])
    finally:
        run.clean()


def test_another_tenants_copy_at_another_death_quarantines_nothing():
    """Tenant 2's copy of a request was running at one death, tenant 1's at another: neither
    tenant's request was present at two deaths."""
    client = redis_conn()
    run = DeadRun(client, f"d-{uuid.uuid4().hex[:6]}")
    theirs, mine = same_request("2"), same_request("1")
    try:
        run.read(theirs)
        run.start("run1", theirs)
        ends = Ends()
        second_run = ends.recovery(client, run.model, run.daemon_id)
        second_run.reclaim_own()
        assert ends.served == [theirs.id]
        client.xack(run.stream, protocol.JOBS_GROUP, run.entries[theirs.id])  # it ended
        run.read(mine)
        run.start(second_run.run_id, mine)
        ends = Ends()
        ends.recovery(client, run.model, run.daemon_id).reclaim_own()
        assert ends.served == [mine.id] and ends.refused == []
        assert not run.quarantined(mine) and not run.quarantined(theirs)
    finally:
        run.clean()


def test_two_daemons_recovering_one_death_at_once_count_it_once():
    """The restarted daemon (its own pending jobs, at start) and another daemon (the dead
    consumer's, every few seconds) can recover the same entry of the same death: the second
    recovery finds the job taken over, and the death is counted once."""
    client = redis_conn()
    run = DeadRun(client, f"d-{uuid.uuid4().hex[:6]}")
    job = same_request()
    try:
        run.read(job)
        run.start("run1", job)
        wait_until(lambda: all(
            p["time_since_delivered"] >= 1100 for p in client.xpending_range(
                run.stream, protocol.JOBS_GROUP, "-", "+", 10)), timeout_s=10)
        other = Ends()
        other_daemon = other.recovery(redis_conn(), run.model, "daemon-b")
        restarted_client = redis_conn()
        restarted = Ends()
        own = restarted.recovery(restarted_client, run.model, run.daemon_id)
        read_running = restarted_client.hgetall
        raced: list[int] = []

        def the_other_daemon_recovers_it_meanwhile(key):
            found = read_running(key)
            if not raced:  # after the restarted daemon read the running record
                raced.append(other_daemon.reclaim_dead(dead_idle_ms=0))
            return found

        restarted_client.hgetall = the_other_daemon_recovers_it_meanwhile
        own.reclaim_own()
        assert raced == [1]
        assert other.served == [job.id] and other.refused == []
        assert restarted.served == [] and restarted.refused == []  # taken over: left to b
        assert run.deaths(job) == {f"{run.daemon_id}/run1"}
        assert not run.quarantined(job)
    finally:
        run.clean()
