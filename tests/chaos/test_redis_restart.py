"""Redis restarts under a running service (issue #14, deliverable 2): a redis-server of this
module's own (AOF, ``appendfsync everysec``, on its own port and directory), a real daemon
(Gemma) and a real daphne pointed at it. Redis is stopped and started again on the same port
and directory while requests stream and wait in the queue, and while one is being enqueued.

What must hold: no process exits; queued jobs complete; a stream continues (Redis back within
REDIS_OUTAGE_S) or ends with a typed error (not a hang, not a 500); the daemon heartbeats,
takes jobs and hears cancels again; a request Redis refuses is a 503 ``service_unavailable``
with Retry-After, its history row closed as failed and its slot freed once Redis is back.
Every wait is bounded (socket timeouts, ``wait_until``); nothing passes or fails on time.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import signal
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from inference import broker
from tests.live_service import RealDaemon, RedisServer, Reply, WebServer, wait_until
from wire import limits, protocol

pytestmark = [pytest.mark.slow, pytest.mark.database]

DOWN_S = protocol.HEARTBEAT_TTL_S + 1  # heartbeat keys expire meanwhile
LONG = {"temperature": 0, "max_tokens": 120, "ignore_eos": True}
SHORT = {"temperature": 0, "max_tokens": 8}


class Stack:
    """This module's Redis, daphne and daemon (N_PARALLEL 1: a second job waits queued)."""

    def __init__(self, tmp) -> None:
        self.redis = RedisServer(tmp / "redis").start()
        self.web = WebServer(redis_url=self.redis.url).start()
        self.daemon = RealDaemon(self.web, f"gemma-redis-{uuid.uuid4().hex[:6]}",
                                 N_PARALLEL="1").start()
        self.pids = (self.web.proc.pid, self.daemon.proc.pid)

    def close(self) -> None:
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()  # a failed test may have left it down
        with contextlib.suppress(redis.RedisError):
            self.daemon.stop()
        self.web.stop()
        self.redis.close()

    def post(self, body: dict[str, Any], timeout: float = 120) -> Reply:
        return self.web.request("POST", "/v1/completions",
                                {"model": self.daemon.model, **body},
                                key=self.web.keys["owner"], timeout=timeout)

    def assert_all_running(self) -> None:
        """No process exited (and none was restarted: the same pids)."""
        assert self.web.proc.poll() is None, self.web.log_tail()
        assert self.daemon.proc.poll() is None, self.daemon.log_tail()
        assert (self.web.proc.pid, self.daemon.proc.pid) == self.pids

    def jobs_added(self) -> int:
        info = self.redis.client().xinfo_stream(protocol.jobs_stream(self.daemon.model))
        return int(info["entries-added"])

    def in_flight(self) -> set[str]:
        """The alpha tenant's concurrency slots (request ids)."""
        key = limits.inflight_key(str(self.web.keys["tenant_a"]))
        return {m.decode() for m in self.redis.client().zrange(key, 0, -1)}

    def row(self, request_id: str) -> dict[str, Any]:
        """The request's history row in daphne's database ({} when there is none)."""
        database = self.web.database
        key: object = uuid.UUID(request_id) if database.is_postgres else uuid.UUID(request_id).hex
        con = database.connect()
        try:
            found = con.execute("SELECT status, error_code, finished FROM "
                                f"inference_inferencerequest WHERE id = {database.placeholder}",
                                (key,)).fetchone()
            return dict(found) if found else {}
        finally:
            con.close()

    def rows(self) -> int:
        con = self.web.database.connect()
        try:
            return int(con.execute("SELECT COUNT(*) AS n FROM inference_inferencerequest")
                       .fetchone()["n"])
        finally:
            con.close()

    @contextlib.contextmanager
    def history_locked(self) -> Iterator[None]:
        """Hold the history table's write lock: the web's row insert waits (readers do not)."""
        database = self.web.database
        con = database.connect()
        try:
            if database.is_postgres:
                con.execute("LOCK TABLE inference_inferencerequest IN SHARE MODE")
            else:
                con.isolation_level = None
                con.execute("BEGIN IMMEDIATE")
            yield
        finally:
            con.rollback() if database.is_postgres else con.execute("ROLLBACK")
            con.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("redis-restart"))
    yield stack
    stack.close()


def read_stream(reply: Reply, until_text: bool = False) -> tuple[str, str | None, dict | None]:
    """(text, finish reason, typed error) of an SSE reply, to its end (or, ``until_text``, to
    its first text). Every read is bounded by the reply's socket timeout."""
    text, reason = "", None
    for _event_id, data in reply.sse():
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            return text, None, chunk["error"]
        for choice in chunk.get("choices", []):
            text += choice.get("text") or ""
            reason = choice.get("finish_reason") or reason
        if until_text and text:
            break
    return text, reason, None


def test_a_restart_mid_stream_and_with_jobs_queued_loses_nothing(stack):
    added = stack.jobs_added()
    streaming = stack.post({"prompt": "Tell a long story about a lighthouse.", "stream": True,
                            **LONG}, timeout=60)
    assert streaming.status == 200
    first_text, _, error = read_stream(streaming, until_text=True)
    assert first_text and error is None
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        queued = [pool.submit(lambda n=n: stack.post({"prompt": f"Count to {n}:", **SHORT}))
                  for n in range(3, 6)]
        wait_until(lambda: stack.jobs_added() == added + 4, timeout_s=30)  # all in the queue
        stack.redis.restart(down_s=DOWN_S)

        rest, reason, error = read_stream(streaming)
        assert error is None, error  # back within REDIS_OUTAGE_S: the stream continues
        assert reason == "length" and rest
        replies = [future.result(timeout=180) for future in queued]
    for reply in replies:
        assert reply.status == 200
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")
    stack.assert_all_running()


def test_after_a_restart_the_daemon_heartbeats_takes_jobs_and_hears_cancels(stack):
    stack.redis.restart(down_s=DOWN_S)
    wait_until(lambda: stack.daemon.snapshot().get("pid") == stack.daemon.proc.pid,
               timeout_s=15)
    reply = stack.post({"prompt": "The capital of France is", **SHORT})
    body = reply.json()
    assert reply.status == 200 and body["choices"][0]["text"], (body, stack.web.log_tail())

    streaming = stack.post({"prompt": "Tell a long story about a dragon.", "stream": True,
                            **LONG, "max_tokens": 1000}, timeout=60)
    request_id = streaming.header("X-Request-Id")
    assert read_stream(streaming, until_text=True)[0]
    cancel = stack.web.request("POST", f"/v1/requests/{request_id}/cancel",
                               key=stack.web.keys["owner"])
    assert cancel.status == 200
    _, reason, error = read_stream(streaming)
    assert error is None and reason == "cancelled"
    stack.assert_all_running()


def test_redis_away_longer_than_the_readers_patience_is_a_typed_503(stack):
    """A request waiting on Redis ends with 503 service_unavailable and Retry-After once Redis
    has been away REDIS_OUTAGE_S; the daemon finishes it when Redis is back (row kept)."""
    before = stack.in_flight()
    outcome: dict[str, Reply] = {}
    waiting = threading.Thread(target=lambda: outcome.update(reply=stack.post(
        {"prompt": "Tell a long story about a river.", **LONG}, timeout=90)))
    waiting.start()
    [request_id] = wait_until(lambda: stack.in_flight() - before, timeout_s=30)
    stream = protocol.events_stream(request_id)
    wait_until(lambda: protocol.TOKEN in {protocol.decode_event(f)[0]
                                          for _, f in stack.redis.client().xrange(stream)},
               timeout_s=60)
    stack.redis.stop()
    waiting.join(broker.REDIS_OUTAGE_S + 60)
    try:
        reply = outcome["reply"]
        assert reply.status == 503
        assert reply.json()["error"]["code"] == "service_unavailable"
        assert int(reply.header("Retry-After")) > 0
    finally:
        stack.redis.start()
    wait_until(lambda: stack.row(request_id).get("status") == "done", timeout_s=120)
    stack.assert_all_running()


def test_redis_down_before_admission_is_a_503_and_leaves_no_row(stack):
    rows = stack.rows()
    stack.redis.stop(signal.SIGKILL)  # nothing in flight: nothing to lose
    try:
        reply = stack.post({"prompt": "Hello", **SHORT}, timeout=60)
        assert reply.status == 503 and reply.json()["error"]["code"] == "service_unavailable"
        assert int(reply.header("Retry-After")) > 0
    finally:
        stack.redis.start()
    assert stack.rows() == rows
    assert stack.post({"prompt": "Hello", **SHORT}).status == 200  # and back at once
    stack.assert_all_running()


def test_redis_refusing_the_admission_is_a_503_and_leaves_no_row(stack):
    rows = stack.rows()
    admin = stack.redis.client()
    admin.execute_command("ACL", "SETUSER", "default", "-eval")  # the admission script
    try:
        reply = stack.post({"prompt": "Hello", **SHORT}, timeout=60)
        assert reply.status == 503 and reply.json()["error"]["code"] == "service_unavailable"
        assert int(reply.header("Retry-After")) > 0
    finally:
        admin.execute_command("ACL", "SETUSER", "default", "+eval")
    assert stack.rows() == rows
    stack.assert_all_running()


def test_redis_down_at_enqueue_closes_the_row_failed_and_frees_the_slot_once_back(stack):
    before = stack.in_flight()
    outcome: dict[str, Reply] = {}
    with stack.history_locked():  # admitted (slot taken), its row insert waits
        sending = threading.Thread(target=lambda: outcome.update(
            reply=stack.post({"prompt": "Hello", **SHORT}, timeout=60)))
        sending.start()
        [request_id] = wait_until(lambda: stack.in_flight() - before, timeout_s=30)
        stack.redis.stop()  # SIGTERM: the AOF keeps the slot
    sending.join(60)
    try:
        reply = outcome["reply"]
        assert reply.status == 503 and reply.json()["error"]["code"] == "service_unavailable"
        assert int(reply.header("Retry-After")) > 0
        row = stack.row(request_id)
        assert row["status"] == "error" and row["error_code"] == "service_unavailable"
        assert row["finished"] is not None
    finally:
        stack.redis.start()
    wait_until(lambda: request_id not in stack.in_flight(), timeout_s=30)
    stack.assert_all_running()
