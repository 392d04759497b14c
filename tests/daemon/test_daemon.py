"""The scheduler daemon end to end: real Redis, real ``run_scheduler`` process, real Gemma."""

from __future__ import annotations

import json
import signal
import time
import uuid

import pytest

from tests.live_service import wait_until
from wire import protocol, queue

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def daemon(make_daemon):
    return make_daemon().start()


def test_a_job_streams_accepted_then_tokens_then_done(daemon, daemon_env):
    _, db, _ = daemon_env
    request_id = uuid.uuid4().hex
    db.add_request(request_id)
    daemon.enqueue(id=request_id, prompt="The capital of France is", params=GREEDY)
    events = daemon.events(request_id)
    kinds = [kind for _, kind, _ in events]
    assert kinds[0] == "accepted" and kinds[-1] == "done" and set(kinds[1:-1]) == {"token"}
    assert events[0][2]["daemon_id"] == daemon.daemon_id and events[0][2]["prompt_tokens"] == 6
    done = events[-1][2]
    text = "".join(data["text"] for _, kind, data in events if kind == "token")
    assert text and done["finish_reason"] in ("stop", "length")
    usage = done["usage"]
    assert usage["completion_tokens"] == sum(d["n_tokens"] for _, k, d in events if k == "token")
    assert usage["prompt_tokens_details"] == {  # nothing cached yet; all 6 kept for reuse
        "cached_tokens": 0, "cache_read_tokens": 0, "cache_created_tokens": 6,
        "cache_hit": "none", "cache_tier": None}
    ids = [entry_id for entry_id, _, _ in events]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))  # resumable order
    assert (
        0 < daemon.redis.ttl(protocol.events_stream(request_id)) <= protocol.STREAM_RETENTION_S
    )
    row = db.row(request_id)
    assert row["status"] == "done" and row["completion_tokens"] == usage["completion_tokens"]
    assert row["prompt_tokens"] == 6 and row["ttft_ms"] > 0 and row["finished"]
    pending = daemon.redis.xpending(protocol.jobs_stream(daemon.model), protocol.JOBS_GROUP)
    assert pending["pending"] == 0  # acknowledged once its last event was written
    wait_log(daemon, "request.done")  # logged after the events' pipeline: it may trail the done
    [line] = [
        json.loads(line)
        for line in daemon.log_path.read_text().splitlines()
        if request_id in line and '"request.done"' in line
    ]
    assert line["tenant_id"] == "1" and line["completion_tokens"] == usage["completion_tokens"]
    assert line["finish_reason"] == done["finish_reason"] and line["ttft_ms"] > 0
    assert "France" not in json.dumps(line)  # no prompt text in the request log


def test_stream_interval_sends_the_first_text_at_once_and_later_tokens_together(make_daemon):
    daemon = make_daemon(STREAM_INTERVAL_MS="60000").start()  # nothing else is due in time
    request_id = uuid.uuid4().hex
    params = {"temperature": 0, "max_tokens": 24, "ignore_eos": True}
    daemon.enqueue(id=request_id, prompt="Once upon a time", params=params)
    events = daemon.events(request_id)
    tokens = [data for _, kind, data in events if kind == "token"]
    assert [kind for _, kind, _ in events] == ["accepted", "token", "token", "done"]
    assert tokens[0]["text"]  # the first text went out on its own (its TTFT does not wait)
    assert tokens[0]["n_tokens"] < 24  # the rest waited for the interval or the end
    usage = events[-1][2]["usage"]
    assert sum(d["n_tokens"] for d in tokens) == usage["completion_tokens"] == 24
    assert daemon.snapshot()["config"]["stream_interval_ms"] == 60000


def test_chat_job_uses_the_cache_scope(daemon):
    messages = [{"role": "user", "content": "Name a fruit."}]
    first = daemon.enqueue(kind="chat", messages=messages, params=GREEDY, cache_scope="tenant-x")
    daemon.events(first.id)
    again = daemon.enqueue(kind="chat", messages=messages, params=GREEDY, cache_scope="tenant-x")
    other = daemon.enqueue(kind="chat", messages=messages, params=GREEDY, cache_scope="tenant-y")
    assert daemon.events(again.id)[-1][2]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert daemon.events(other.id)[-1][2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_refusals_carry_the_http_status_and_the_numbers(daemon, daemon_env):
    _, db, _ = daemon_env
    too_long_id = uuid.uuid4().hex
    db.add_request(too_long_id)  # the row exists before the job, as the web's submit does it
    too_long = daemon.enqueue(id=too_long_id, prompt="word " * 3000, params={"max_tokens": 10})
    [(_, kind, data)] = daemon.events(too_long.id)
    assert kind == "error" and data["code"] == "context_length_exceeded" and data["status"] == 400
    # past N_CTX 2048 (and past one tenant's KV share, 1024): the context is the limit named
    assert data["limit"] == 2048 and data["prompt_tokens"] > 2048 and data["max_tokens"] == 10
    assert db.row(too_long.id)["status"] == "error"
    assert db.row(too_long.id)["error_code"] == "context_length_exceeded"
    bad_grammar = daemon.enqueue(prompt="hi", params={"grammar": "root ::= (("})
    [(_, kind, data)] = daemon.events(bad_grammar.id)
    assert (kind, data["param"], data["status"]) == ("error", "grammar", 400)
    bad_value = daemon.enqueue(prompt="hi", params={"temperature": "warm"})
    assert daemon.events(bad_value.id)[0][2]["param"] == "temperature"


def test_cancel_mid_generation_frees_the_slot(daemon, daemon_env):
    _, db, _ = daemon_env
    job_id = uuid.uuid4().hex
    db.add_request(job_id)
    job = daemon.enqueue(
        id=job_id, prompt="Tell a long story.", params={"max_tokens": 400, "ignore_eos": True}
    )
    daemon.wait_for(job.id, "token")
    daemon.cancel(job.id)
    events = daemon.events(job.id)
    done = events[-1][2]
    assert done["finish_reason"] == "cancelled" and done["usage"]["completion_tokens"] < 400
    assert db.row(job.id)["status"] == "cancelled"
    deadline = time.monotonic() + 10
    while any(s["request_id"] == job.id for s in daemon.snapshot().get("slots", [])):
        assert time.monotonic() < deadline, "the slot was not freed"
        time.sleep(0.1)


def test_a_job_cancelled_before_it_starts_never_runs(daemon):
    request_id = uuid.uuid4().hex
    daemon.redis.set(protocol.cancel_key(request_id), 1, ex=60)
    daemon.enqueue(id=request_id, prompt="hello", params=GREEDY)
    [(_, kind, data)] = daemon.events(request_id)
    assert kind == "done" and data["finish_reason"] == "cancelled"


def test_snapshot_is_published_with_a_heartbeat_and_no_text(daemon):
    snap = daemon.snapshot()
    assert snap["model"] == daemon.model and snap["config"]["n_parallel"] == 2
    assert len(snap["slots"]) == 2 and "counters" in snap and "queue" in snap
    ttl_ms = daemon.redis.pttl(protocol.daemon_key(daemon.daemon_id))
    assert 0 < ttl_ms <= protocol.HEARTBEAT_TTL_S * 1000
    assert "France" not in str(snap) and "fruit" not in str(snap)


def test_a_daemon_takes_only_what_it_can_hold_and_the_rest_waits_in_redis(make_daemon):
    """Pull by capacity: 1 slot + 1 queued here. The other jobs stay in the model's queue in
    Redis (where another daemon could take them), none is refused, and all complete."""
    daemon = make_daemon(MAX_QUEUE="1", N_PARALLEL="1", LOCAL_QUEUE="1").start()
    params = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    running = daemon.enqueue(prompt="Tell me a long story.", params=params)
    daemon.wait_for(running.id, "token")
    jobs = [
        daemon.enqueue(
            prompt=f"Count to ten, try {i}:", params={"max_tokens": 24, "temperature": 0}
        )
        for i in range(5)
    ]
    wait_until(lambda: daemon.snapshot().get("queue"), timeout_s=30)
    assert daemon.redis.zcard(queue.ready_key(daemon.model)) == 4
    fleet = json.loads(daemon.redis.hget(queue.fleet_key(daemon.model), daemon.daemon_id))
    assert (fleet["capacity"], fleet["taking"]) == (2, True)
    daemon.cancel(running.id)
    outcomes = [daemon.events(job.id)[-1] for job in jobs]
    assert [kind for _, kind, _ in outcomes] == ["done"] * 5
    assert all(d["usage"]["completion_tokens"] > 0 for _, _, d in outcomes)
    assert daemon.redis.zcard(queue.ready_key(daemon.model)) == 0


def test_sigterm_drains_and_exits_cleanly(make_daemon):
    """SIGTERM while a request is running: the daemon stops taking jobs, lets the running
    one finish (the grace is generous: nothing here depends on speed), exits 0."""
    daemon = make_daemon().start(grace_s=600)
    params = {"max_tokens": 300, "ignore_eos": True, "temperature": 0}
    job = daemon.enqueue(prompt="Tell me a long story.", params=params)
    daemon.wait_for(job.id, "token")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_log(daemon, "-> DRAINING")
    late = daemon.enqueue(prompt="The capital of France is", params=GREEDY)
    assert daemon.proc.wait(600) == 0
    _, kind, done = daemon.events(job.id, timeout_s=5)[-1]
    assert (kind, done["finish_reason"]) == ("done", "length")
    assert done["usage"]["completion_tokens"] == 300  # it ran to its end, not cancelled
    wait_log(daemon, "request.done")
    log = daemon.log_path.read_text()
    [end_line] = [i for i, line in enumerate(log.splitlines()) if "request.done" in line
                  and job.id in line]
    drain_line = next(i for i, line in enumerate(log.splitlines()) if "-> DRAINING" in line)
    assert drain_line < end_line  # the drain began while the request ran
    assert not daemon.redis.exists(protocol.events_stream(late.id))  # left for the next daemon
    assert not daemon.redis.exists(protocol.daemon_key(daemon.daemon_id))


def wait_log(daemon, text: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in daemon.log_path.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"never logged {text!r}:\n{daemon.log_tail()}"
        time.sleep(0.05)


@pytest.mark.parametrize("continue_streams", [True, False], ids=["continued", "setting-off"])
def test_a_killed_daemons_jobs_are_continued_and_a_restart_serves_the_queue(
    make_daemon, daemon_env, continue_streams
):
    _, db, _ = daemon_env
    setting = {"CONTINUE_STREAMS": str(continue_streams).lower()}
    first = make_daemon(**setting).start()
    queued_at = time.time()
    running_id = uuid.uuid4().hex
    db.add_request(running_id)
    running = first.enqueue(
        id=running_id, prompt="Tell a long story.", params={"max_tokens": 200, "ignore_eos": True}
    )
    first.wait_for(running.id, "token")
    first.stop(signal.SIGKILL)
    killed_after_ms = (time.time() - queued_at) * 1000
    queued = first.enqueue(prompt="The capital of France is", params=GREEDY)  # no daemon alive now
    second = make_daemon(model=first.model, **setting).start()
    events = second.events(running.id, timeout_s=120)
    _, kind, done = events[-1]
    if continue_streams:
        assert (kind, done["finish_reason"], done["resumed"]) == ("done", "length", 1)
        assert sum(d["n_tokens"] for _, k, d in events if k == "token") == 200
        assert db.row(running.id)["status"] == "done"
        # its timings count from its first queueing, not from the takeover
        assert done["timings"]["duration_ms"] >= killed_after_ms
    else:  # the old contract: a request that had streamed ends with the death
        assert (kind, done["code"]) == ("error", "inference_interrupted")
        assert db.row(running.id)["error_code"] == "inference_interrupted"
    assert second.events(queued.id)[-1][1] == "done"
    pending = second.redis.xpending(protocol.jobs_stream(first.model), protocol.JOBS_GROUP)
    assert pending["pending"] == 0


def send(daemon, action: str, **args) -> None:
    daemon.redis.xadd(
        protocol.control_stream(daemon.daemon_id), protocol.encode_command(action, **args)
    )


def wait_snapshot(daemon, predicate, timeout_s: float = 15) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = daemon.snapshot()
        if snap and predicate(snap):
            return snap
        time.sleep(0.1)
    raise AssertionError(f"snapshot never matched: {daemon.snapshot()}")


def test_drain_leaves_jobs_in_the_stream_until_resume(daemon):
    send(daemon, "drain")
    try:
        wait_snapshot(daemon, lambda s: s["draining"])
        job = daemon.enqueue(prompt="The capital of France is", params=GREEDY)
        time.sleep(1.5)  # several intake polls
        assert not daemon.redis.exists(protocol.events_stream(job.id))  # not taken while draining
    finally:
        send(daemon, "resume")  # never leave the module's daemon drained for the next tests
    assert daemon.events(job.id)[-1][1] == "done"
    assert not daemon.snapshot()["draining"]


def test_evict_scope_drops_only_that_tenants_cached_prefixes(daemon):
    messages = [
        {"role": "user", "content": "A message long enough to leave a cached prefix behind."}
    ]
    for scope in ("evict-me", "keep-me"):
        daemon.events(
            daemon.enqueue(kind="chat", messages=messages, params=GREEDY, cache_scope=scope).id
        )
    scopes = lambda s: {e["cache_scope"] for e in s["cache"]["entries"]}  # noqa: E731
    wait_snapshot(daemon, lambda s: {"evict-me", "keep-me"} <= scopes(s))
    send(daemon, "evict_scope", scope="evict-me")
    snap = wait_snapshot(daemon, lambda s: "evict-me" not in scopes(s))
    assert "keep-me" in scopes(snap)
    again = daemon.enqueue(kind="chat", messages=messages, params=GREEDY, cache_scope="evict-me")
    assert daemon.events(again.id)[-1][2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
