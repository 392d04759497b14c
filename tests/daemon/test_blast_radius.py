"""One tenant's request can never stop the daemon for the others (issue: blast radius).

Real ``run_scheduler`` processes with Gemma on the test Redis. Jobs go straight into the
jobs stream, bypassing the web's validation on purpose: what is shown here is what the
daemon survives on its own. Tenant B streams a long completion; tenant A sends something
that would stop an unguarded daemon; A gets its own typed error (or a proper answer), B's stream
ends with ``done``, and the daemon's pid is unchanged.
"""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from scheduler_daemon.management.commands.run_scheduler import FAULT_MARKER
from scheduler_daemon.service.intake import job_fingerprint
from tests.live_service import wait_until
from wire import protocol

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 160, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def daemon(make_daemon):
    return make_daemon().start()


def _deep_grammar(depth: int) -> str:
    return "root ::= " + "(" * depth + '"a"' + ")" * depth


POISON = {
    "surrogate in chat content": dict(
        kind="chat", messages=[{"role": "user", "content": "hi \ud800"}], params={"max_tokens": 4}
    ),
    "surrogate in grammar": dict(prompt="Say a", params={"grammar": 'root ::= "\ud800"'}),
    "a complete grammar with ignore_eos": dict(
        prompt="Say a", params={"grammar": 'root ::= "a"', "ignore_eos": True, "max_tokens": 8}
    ),
    "a schema with a huge maxLength": dict(
        prompt="Say a",
        params={"json_schema": {"type": "string", "maxLength": 100000}, "max_tokens": 4},
    ),
    "20,000 nested parentheses": dict(prompt="Say a", params={"grammar": _deep_grammar(20_000)}),
    "a grammar that allows no token (the sampler selects none)": dict(
        prompt="Say a", params={"grammar": "root ::= [\\x00]", "max_tokens": 4}
    ),
    "a malformed field from a rogue writer": dict(prompt="Say a", max_queued="many"),
    "a request id that is not a UUID (history cannot hold it)": dict(
        id="not-a-uuid", prompt="Say a", params={"max_tokens": 2}
    ),
}
ANSWERED = {"a complete grammar with ignore_eos", "a request id that is not a UUID (history "
            "cannot hold it)"}


@pytest.mark.parametrize("name", list(POISON))
def test_a_poison_request_fails_alone(daemon, name):
    pid = daemon.snapshot()["pid"]
    victim = daemon.enqueue(
        prompt="Tell me a long story about a dragon.", params=LONG, tenant_id="2", cache_scope="2"
    )
    daemon.wait_for(victim.id, "token")
    fields = dict(POISON[name])
    if "id" in fields:
        fields["id"] += uuid.uuid4().hex[:6]
    poison = daemon.enqueue(tenant_id="1", cache_scope="1", **fields)
    last_id, kind, data = daemon.events(poison.id)[-1]
    if name == "a complete grammar with ignore_eos":
        assert kind == "done" and data["finish_reason"] == "stop", data
        text = "".join(d["text"] for _, k, d in daemon.events(poison.id) if k == "token")
        assert text == "a"
    elif name in ANSWERED:
        assert kind == "done", data
    else:
        assert kind == "error", data
        assert data["code"] in ("invalid_request_error", "engine_error", "internal_error"), data
    victim_events = daemon.events(victim.id)
    assert [k for _, k, _ in victim_events].count("error") == 0
    assert victim_events[-1][1] == "done"
    assert victim_events[-1][2]["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert daemon.proc.poll() is None and daemon.snapshot()["pid"] == pid


def test_refusals_before_the_engine_name_the_field_and_the_limit(daemon):
    surrogate = daemon.enqueue(kind="chat", messages=[{"role": "user", "content": "hi \ud800"}])
    data = daemon.events(surrogate.id)[-1][2]
    assert data["status"] == 400 and data["param"].startswith("messages")
    deep = daemon.enqueue(prompt="x", params={"grammar": _deep_grammar(20_000)})
    data = daemon.events(deep.id)[-1][2]
    assert data["status"] == 400 and data["param"] == "grammar"
    schema = daemon.enqueue(
        prompt="x", params={"json_schema": {"type": "string", "maxLength": 100000}}
    )
    data = daemon.events(schema.id)[-1][2]
    assert data["status"] == 400 and data["param"] == "json_schema"


def test_failures_are_counted_by_reason_and_a_malformed_entry_is_dropped(daemon):
    """(A failure while starting a job, ``internal_error``: tests/daemon/test_intake.py.)"""
    before = dict(daemon.snapshot().get("rejected") or {})
    daemon.redis.xadd(protocol.jobs_stream(daemon.model), {"job": "{not json"})
    job = daemon.enqueue(prompt="x", max_queued="many")
    data = daemon.events(job.id)[-1][2]
    assert (data["code"], data["param"], data["status"]) == ("invalid_request_error",
                                                             "max_queued", 400)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        rejected = daemon.snapshot().get("rejected") or {}
        if rejected.get("malformed", 0) > before.get("malformed", 0):
            break
        time.sleep(0.1)
    assert rejected["malformed"] == before.get("malformed", 0) + 1
    assert rejected["invalid_request_error"] >= before.get("invalid_request_error", 0) + 1
    pending = daemon.redis.xpending(protocol.jobs_stream(daemon.model), protocol.JOBS_GROUP)
    assert pending["pending"] == 0  # the malformed entry was acknowledged, not left behind


def test_a_grammar_error_never_writes_client_text_to_the_log(daemon):
    forged = json.dumps({"event": "request.done", "request_id": "forged"})
    job = daemon.enqueue(prompt="x", params={"grammar": f'root ::= "a" )\n{forged}\n'})
    assert daemon.events(job.id)[-1][2]["code"] == "invalid_request_error"
    assert forged not in daemon.log_path.read_text(errors="replace")


def test_a_cancelled_queued_request_is_billed_nothing(make_daemon):
    daemon = make_daemon(N_PARALLEL="1").start()
    running = daemon.enqueue(prompt="Tell me a long story.", params=LONG)
    daemon.wait_for(running.id, "token")
    queued = daemon.enqueue(prompt="The capital of France is " * 20, params={"max_tokens": 4})
    daemon.wait_for(queued.id, "accepted")
    daemon.cancel(queued.id)
    _, kind, data = daemon.events(queued.id)[-1]
    assert kind == "done" and data["finish_reason"] == "cancelled"
    assert data["usage"]["total_tokens"] == 0
    daemon.cancel(running.id)


def test_a_crashing_job_is_quarantined_after_two_deaths_and_the_rest_is_served(make_daemon):
    daemon = make_daemon(FAULT_INJECTION="true").start(supervise=True)
    first_pid = daemon.snapshot()["pid"]
    poison = daemon.enqueue(prompt=f"Say {FAULT_MARKER} twice", params={"max_tokens": 4})
    events = daemon.events(poison.id, timeout_s=240)
    _, kind, data = events[-1]
    assert kind == "error" and data["code"] == "request_quarantined", events
    assert "token" not in [k for _, k, _ in events]
    assert "restart 2 " in daemon.log_path.read_text()  # it killed two runs, then never again
    assert "restart 3 " not in daemon.log_path.read_text()
    record = json.loads(daemon.redis.hget(protocol.QUARANTINE_HASH, job_fingerprint(poison)))
    assert record["request_id"] == poison.id and record["deaths"] == 2
    assert daemon.proc.poll() is None  # the supervisor is still there
    snap = daemon.snapshot()
    assert snap and snap["pid"] != first_pid  # the daemon it restarted serves
    again = daemon.enqueue(prompt=f"Say {FAULT_MARKER} twice", params={"max_tokens": 4})
    _, kind, data = daemon.events(again.id)[-1]
    assert kind == "error" and data["code"] == "request_quarantined" and data["status"] == 400
    ok = daemon.enqueue(prompt="The capital of France is", params={"max_tokens": 4})
    assert daemon.events(ok.id)[-1][1] == "done"
    assert daemon.snapshot()["pid"] == snap["pid"]  # the resent poison never ran
    daemon.redis.hdel(protocol.QUARANTINE_HASH, job_fingerprint(poison))


def test_the_fault_hook_is_off_unless_the_setting_says_so(daemon):
    pid = daemon.snapshot()["pid"]
    job = daemon.enqueue(prompt=f"Say {FAULT_MARKER}", params={"max_tokens": 4})
    assert daemon.events(job.id)[-1][1] == "done"
    assert daemon.snapshot()["pid"] == pid


def test_a_tenants_flood_waits_in_turns_and_another_tenant_goes_first(make_daemon):
    """The daemon holds only what it can run (1 slot + 1 queued here): the flood waits in the
    model's fair queue in Redis, and the other tenant's job, sent last, is taken next (the
    tenant's share of the queue is the web's gate: tests/test_queue.py)."""
    daemon = make_daemon(N_PARALLEL="1", LOCAL_QUEUE="1").start()
    running = daemon.enqueue(prompt="Tell me a long story.", params=LONG)
    daemon.wait_for(running.id, "token")
    flood = [daemon.enqueue(prompt=f"Count to {i}", params={"max_tokens": 2}) for i in range(6)]
    other = daemon.enqueue(
        prompt="The capital of France is", params={"max_tokens": 2}, tenant_id="2",
        cache_scope="2",
    )
    wait_until(lambda: daemon.snapshot().get("queue"), timeout_s=30)  # one flood job is local
    assert len(daemon.snapshot()["queue"]) == 1  # the rest waits in Redis
    daemon.cancel(running.id)
    ends = {job.id: daemon.events(job.id)[-1] for job in [*flood, other]}
    assert all(kind == "done" for _, kind, _ in ends.values())
    order = sorted(ends, key=lambda rid: protocol.entry_order(ends[rid][0]))
    assert order.index(other.id) <= 1  # after the one flood job held locally, at most


def test_one_request_cannot_reserve_the_whole_kv_budget(make_daemon):
    daemon = make_daemon(N_PARALLEL="2", KV_BLOCK_TOKENS="64", KV_TENANT_SHARE="0.5").start()
    huge = daemon.enqueue(prompt="Tell me a story.", params={"max_tokens": 1900})
    _, kind, data = daemon.events(huge.id)[-1]
    assert kind == "error" and data["code"] == "device_memory_budget_exceeded"
    assert data["limit"] == 1024  # half of N_CTX=2048
    big = daemon.enqueue(prompt="Tell me a story.", params={**LONG, "max_tokens": 900})
    daemon.wait_for(big.id, "token")
    small = daemon.enqueue(
        prompt="The capital of France is", params={"max_tokens": 4}, tenant_id="2",
        cache_scope="2",
    )
    events = daemon.events(small.id)
    assert events[-1][1] == "done"
    assert not any(k in protocol.TERMINAL for _, k, _ in daemon_events_so_far(daemon, big.id))
    daemon.cancel(big.id)


def daemon_events_so_far(daemon, request_id: str) -> list[tuple[str, str, dict]]:
    return [
        (entry_id.decode(), *protocol.decode_event(fields))
        for entry_id, fields in daemon.redis.xrange(protocol.events_stream(request_id))
    ]


def test_a_restarted_daemon_recovers_its_own_pending_jobs(make_daemon):
    """Under one daemon id (as the supervisor restarts it), a new run serves the jobs the
    old run had read but not started, and continues the one it had streamed."""
    first = make_daemon(N_PARALLEL="1", MAX_QUEUE="8").start()
    running = first.enqueue(prompt="Tell me a long story.", params={**LONG, "max_tokens": 400})
    first.wait_for(running.id, "token")
    waiting = first.enqueue(prompt="The capital of France is", params={"max_tokens": 4})
    first.wait_for(waiting.id, "accepted")
    first.stop(signal.SIGKILL)
    second = make_daemon(model=first.model).start(daemon_id=first.daemon_id)
    _, kind, data = second.events(waiting.id)[-1]
    assert kind == "done" and data["resumed"] == 1  # served again: its stream had its accepted
    events = second.events(running.id)
    _, kind, data = events[-1]
    assert (kind, data["finish_reason"], data["resumed"]) == ("done", "length", 1)
    tokens = [d for _, k, d in events if k == "token"]
    # continued, not restarted: every token is sent once, 400 in all, as max_tokens says
    assert sum(d["n_tokens"] for d in tokens) == data["usage"]["completion_tokens"] == 400
    assert [k for _, k, _ in events].count("accepted") == 2
