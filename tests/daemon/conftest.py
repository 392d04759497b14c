"""Real scheduler daemons (``manage.py run_scheduler`` subprocesses with Gemma) on the test Redis.

Each daemon serves its own model name, so tests never share a jobs stream with another
daemon. A module's daemons write history to a database of their own on the engine the tests
run on (an SQLite file, or a PostgreSQL database: tests/live_service.OwnDatabase), which
tests read with plain SQL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from tests.live_service import OwnDatabase
from wire import protocol, queue

ROOT = Path(__file__).resolve().parents[2]
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


class Daemon:
    """A running ``run_scheduler`` process and what tests need to talk to it."""

    def __init__(self, model: str, env: dict[str, str], log_path: Path) -> None:
        self.model, self.env, self.log_path = model, env, log_path
        self.proc: subprocess.Popen | None = None
        self.redis = redis.Redis.from_url(TEST_REDIS_URL)
        self.daemon_id = ""

    def start(
        self,
        timeout_s: float = 120,
        supervise: bool = False,
        daemon_id: str | None = None,
        grace_s: float = 5,
    ) -> Daemon:
        """``supervise``: run it under ``run_scheduler --supervise`` (``proc`` is then the
        supervisor; the daemon's own pid is in its snapshot). ``daemon_id``: reuse an id
        (a restart), else a new one. ``grace_s``: ``--grace``, what in-flight requests get
        to finish after SIGTERM."""
        self.daemon_id = daemon_id or f"test-{uuid.uuid4().hex[:8]}"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "run_scheduler",
                "--grace",
                str(grace_s),
                "--daemon-id",
                self.daemon_id,
                *(["--supervise"] if supervise else []),
            ],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout_s
        while not self._published(supervise):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def _published(self, supervised: bool) -> bool:
        """Whether this process (not an earlier run under the same id) has a heartbeat."""
        snap = self.snapshot()
        return bool(snap) and (supervised or snap.get("pid") == self.proc.pid)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def snapshot(self) -> dict:
        raw = self.redis.get(protocol.daemon_key(self.daemon_id))
        return json.loads(raw) if raw else {}

    def enqueue(self, **fields) -> protocol.Job:
        job = protocol.Job(
            id=fields.pop("id", uuid.uuid4().hex),
            model=self.model,
            tenant_id=fields.pop("tenant_id", "1"),
            cache_scope=fields.pop("cache_scope", "1"),
            kind=fields.pop("kind", "completion"),
            **fields,
        )
        queue.enqueue(self.redis, job)
        return job

    def events(self, request_id: str, timeout_s: float = 120) -> list[tuple[str, str, dict]]:
        """(entry id, type, data) of a request's stream, waiting for its terminal event."""
        stream, last, out = protocol.events_stream(request_id), "0", []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            reply = self.redis.xread({stream: last}, block=500)
            for _name, entries in reply or []:
                for entry_id, fields in entries:
                    last = entry_id.decode()
                    kind, data = protocol.decode_event(fields)
                    out.append((last, kind, data))
                    if kind in protocol.TERMINAL:
                        return out
        raise AssertionError(f"no terminal event for {request_id}: {out}\n{self.log_tail()}")

    def wait_for(self, request_id: str, kind: str, timeout_s: float = 60) -> None:
        stream = protocol.events_stream(request_id)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            kinds = [protocol.decode_event(f)[0] for _, f in self.redis.xrange(stream)]
            if kind in kinds:
                return
            time.sleep(0.05)
        raise AssertionError(f"{request_id} never got a {kind} event")

    def cancel(self, request_id: str) -> None:
        self.redis.set(protocol.cancel_key(request_id), 1, ex=protocol.CANCEL_TTL_S)
        self.redis.publish(protocol.CANCEL_CHANNEL, request_id)


class HistoryDb:
    """The daemons' history database, read and seeded with plain SQL (sqlite3 or psycopg)."""

    def __init__(self, database: OwnDatabase) -> None:
        self.database = database

    def add_request(self, request_id: str) -> None:
        mark = self.database.placeholder
        self._execute(
            "INSERT INTO inference_inferencerequest (id, tenant_id, kind, model, status, "
            "session, finish_reason, error_code, cache_hit, cache_tier, created) "
            f"VALUES ({mark}, 1, 'completion', 'm', 'queued', '', '', '', '', '', "
            "CURRENT_TIMESTAMP)",
            (self._key(request_id),),
        )

    def row(self, request_id: str) -> dict:
        found = self._execute(
            "SELECT * FROM inference_inferencerequest WHERE id = "
            f"{self.database.placeholder}",
            (self._key(request_id),),
            fetch=True,
        )
        return dict(found) if found else {}

    def _key(self, request_id: str) -> object:
        """Django's UUIDField: a native uuid on PostgreSQL, 32 hex digits on SQLite."""
        value = uuid.UUID(request_id)
        return value if self.database.is_postgres else value.hex

    def _execute(self, sql: str, params: tuple, fetch: bool = False) -> object:
        """One statement in its own committed transaction; with ``fetch``, its first row."""
        con = self.database.connect()
        try:
            cursor = con.execute(sql, params)  # always: only the fetch is conditional
            found = cursor.fetchone() if fetch else None
            con.commit()
            return found
        finally:
            con.close()


@pytest.fixture(scope="module")
def daemon_env(tmp_path_factory):
    """Environment for daemon subprocesses: their own history database (migrated, on the
    tests' engine), test Redis."""
    tmp = tmp_path_factory.mktemp("daemon")
    database = OwnDatabase(tmp, "history")
    env = {
        **os.environ,
        "REDIS_URL": TEST_REDIS_URL,
        "DATABASE_URL": database.url,
        "N_CTX": "2048",
        "N_PARALLEL": "2",
        "N_BATCH": "512",
        "LOG_LEVEL": "INFO",
    }
    database.migrate(env)
    subprocess.run(
        [sys.executable, "manage.py", "create_tenant", "t1"],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    yield env, HistoryDb(database), tmp
    database.drop()


@pytest.fixture(scope="module")
def make_daemon(daemon_env):
    """Start daemons with extra settings; all are stopped (SIGKILL if need be) at the end."""
    env, _, tmp = daemon_env
    started: list[Daemon] = []

    def make(model: str | None = None, **settings: str) -> Daemon:
        name = model or f"gemma-test-{uuid.uuid4().hex[:6]}"
        daemon = Daemon(name, {**env, "MODEL_NAME": name, **settings}, tmp / f"{name}.log")
        started.append(daemon)
        return daemon

    yield make
    for daemon in started:
        try:
            daemon.stop(timeout_s=30)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()
