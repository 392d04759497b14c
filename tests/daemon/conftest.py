"""Real scheduler daemons (``manage.py run_scheduler`` subprocesses with Gemma) on the test Redis.

Each daemon serves its own model name, so tests never share a jobs stream with another
daemon, and writes history to its own SQLite file, which tests read with sqlite3.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis

from wire import protocol

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
        self, timeout_s: float = 120, supervise: bool = False, daemon_id: str | None = None
    ) -> Daemon:
        """``supervise``: run it under ``run_scheduler --supervise`` (``proc`` is then the
        supervisor; the daemon's own pid is in its snapshot). ``daemon_id``: reuse an id
        (a restart), else a new one."""
        self.daemon_id = daemon_id or f"test-{uuid.uuid4().hex[:8]}"
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "run_scheduler",
                "--grace",
                "5",
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
        self.redis.xadd(protocol.jobs_stream(self.model), job.encode())
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
    """The daemons' SQLite history database, read and seeded with plain sqlite3."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def add_request(self, request_id: str) -> None:
        with sqlite3.connect(self.path) as con:
            con.execute(
                "INSERT INTO inference_inferencerequest (id, tenant_id, kind, model, status, "
                "session, finish_reason, error_code, created) "
                "VALUES (?, 1, 'completion', 'm', 'queued', '', '', '', "
                "datetime('now'))",
                (uuid.UUID(request_id).hex,),
            )

    def row(self, request_id: str) -> dict:
        with sqlite3.connect(self.path) as con:
            con.row_factory = sqlite3.Row
            found = con.execute(
                "SELECT * FROM inference_inferencerequest WHERE id = ?",
                (uuid.UUID(request_id).hex,),
            ).fetchone()
            return dict(found) if found else {}


@pytest.fixture(scope="module")
def daemon_env(tmp_path_factory):
    """Environment for daemon subprocesses: own SQLite history DB (migrated), test Redis."""
    tmp = tmp_path_factory.mktemp("daemon")
    db_path = tmp / "history.sqlite3"
    env = {
        **os.environ,
        "REDIS_URL": TEST_REDIS_URL,
        "DATABASE_URL": f"sqlite:///{db_path}",
        "N_CTX": "2048",
        "N_PARALLEL": "2",
        "N_BATCH": "512",
        "LOG_LEVEL": "INFO",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env, check=True
    )
    subprocess.run(
        [sys.executable, "manage.py", "create_tenant", "t1"],
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return env, HistoryDb(db_path), tmp


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
