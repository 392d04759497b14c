"""A real web server (daphne subprocess) and daemons for the API and websocket tests.

- ``web_server()``: the door (nginx, config/proxy.py) on a free port in front of daphne on
  a unix socket, as ``make run`` serves them; its own migrated database (``OwnDatabase``:
  on the engine the tests run on), tenants alpha (owner and member keys) and beta
  (outsider key). One per test session (module-level singleton: several test modules share it),
  stopped at exit.
- ``StandIn``: a pretend daemon inside the test process that heartbeats like a real one
  and answers jobs by writing protocol events itself. It tests the web's handling of the
  wire (dead daemons, refusals, resumes) next to, never instead of, the real daemon.
- ``RealDaemon``: ``manage.py run_scheduler`` with Gemma, sharing the web's database.

Nothing here flushes Redis: the daemons of other tests may be running on it.
"""
from __future__ import annotations

import atexit
import http.client
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import redis
from django.conf import settings

from config import proxy, web_procs
from config.models import CATALOG, SMOLLM2, SMOLLM2_PIN
from wire import protocol, queue

ROOT = Path(__file__).resolve().parent.parent
TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
MAKE_KEYS = """
import json
from accounts.models import ApiKey, Tenant
a = Tenant.objects.create(slug="alpha", name="Alpha")
b = Tenant.objects.create(slug="beta", name="Beta")
print(json.dumps({"tenant_a": a.id, "owner": ApiKey.issue(a, "owner")[1],
                  "member": ApiKey.issue(a, "member")[1], "outsider": ApiKey.issue(b, "out")[1]}))
"""


class OwnDatabase:
    """A database of its own for subprocesses (daphne, ``run_scheduler``), on the engine and
    server the test process uses (``DATABASE_URL``): an SQLite file in ``directory``, or a
    PostgreSQL database named after pytest-django's test database
    (``test_<name>_<purpose>_<hex>``), created here, filled by ``migrate()``, dropped by
    ``drop()`` (at exit at the latest).

    Not the test database itself: transactional tests empty every table after each test,
    which would delete the tenants and keys a session-long server was started with.
    """

    def __init__(self, directory: Path, purpose: str) -> None:
        self._settings = dict(settings.DATABASES["default"])
        self.is_postgres = self._settings["ENGINE"] == "django.db.backends.postgresql"
        if not self.is_postgres:
            self.name = str(directory / f"{purpose}.sqlite3")
            self.url = f"sqlite:///{self.name}"
            return
        base = self._settings["NAME"]
        base = base if base.startswith("test_") else f"test_{base}"
        self.name = f"{base}_{purpose}_{uuid.uuid4().hex[:6]}"
        self._admin(f"CREATE DATABASE {_quote_name(self.name)}")
        atexit.register(self.drop)  # also when the owner's stop() never runs
        self.url = self._postgres_url()

    def migrate(self, env: dict[str, str]) -> None:
        """``manage.py migrate`` into this database (``env`` must name it)."""
        subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=env,
                       check=True)

    def connect(self) -> Any:
        """A DB-API connection (sqlite3, or psycopg with dict rows); the caller closes it."""
        if not self.is_postgres:
            con = sqlite3.connect(self.name)
            con.row_factory = sqlite3.Row
            return con
        import psycopg
        from psycopg.rows import dict_row

        return psycopg.connect(**self._connect_args(self.name), row_factory=dict_row)

    @property
    def placeholder(self) -> str:
        """The DB-API parameter marker of this engine."""
        return "%s" if self.is_postgres else "?"

    def drop(self) -> None:
        """Drop a PostgreSQL database (closing what still uses it); an SQLite file goes
        with its directory."""
        if self.is_postgres:
            self._admin(f"DROP DATABASE IF EXISTS {_quote_name(self.name)} WITH (FORCE)")

    def _admin(self, statement: str) -> None:
        import psycopg

        with psycopg.connect(**self._connect_args("postgres"), autocommit=True) as con:
            con.execute(statement)

    def _connect_args(self, dbname: str) -> dict[str, Any]:
        s = self._settings
        args = {"dbname": dbname, "host": s.get("HOST") or None, "port": s.get("PORT") or None,
                "user": s.get("USER") or None, "password": s.get("PASSWORD") or None}
        return {**{k: v for k, v in args.items() if v is not None}, **self._libpq_options()}

    def _libpq_options(self) -> dict[str, str]:
        """OPTIONS that are libpq's (sslmode...), not Django's own (pool, ...)."""
        return {k: v for k, v in self._settings.get("OPTIONS", {}).items() if isinstance(v, str)}

    def _postgres_url(self) -> str:
        s = self._settings
        user = quote(s.get("USER") or "", safe="")
        password = quote(s.get("PASSWORD") or "", safe="")
        login = f"{user}:{password}@" if password else (f"{user}@" if user else "")
        host = quote(s.get("HOST") or "", safe="")
        port = f":{s['PORT']}" if s.get("PORT") else ""
        options = self._libpq_options()
        query = f"?{urlencode(options)}" if options else ""
        return f"postgres://{login}{host}{port}/{quote(self.name, safe='')}{query}"


def _quote_name(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def patient_web() -> Iterator[WebServer]:
    """A module's web server that waits 120 s for another daemon to take over a dead one's
    requests (RECOVERY_TIMEOUT_S; a hang guard, not a speed bound): for daemon kills."""
    server = WebServer()
    server.env["RECOVERY_TIMEOUT_S"] = "120"
    server.start()
    yield server
    server.stop()


class WebServer:
    """daphne serving config.asgi on 127.0.0.1 with its own database. ``redis_url``: another
    Redis than the tests' (a test that restarts its own). ``workers``: that many daphnes
    behind the door (``WEB_WORKERS``, config/web_procs.py: a unix socket and a log each,
    ``daphne-<i>.log``); ``proc`` is the first, ``procs`` all of them."""

    def __init__(self, redis_url: str | None = None, workers: int = 1) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="web-test-"))
        self.database = OwnDatabase(self.tmp, "web")
        self.env = {
            **os.environ, "REDIS_URL": redis_url or TEST_REDIS_URL, "DEBUG": "true",
            "DATABASE_URL": self.database.url,
            "SECRET_KEY": "web-tests-" + uuid.uuid4().hex, "ACCEPT_TIMEOUT_S": "15",
            "LOG_LEVEL": "WARNING", "N_CTX": "2048", "N_PARALLEL": "2", "N_BATCH": "512",
            "RESUME_GRACE_S": "3",  # a dropped client's request is cancelled this soon
            # tests send bursts of hundreds of requests with one key; the door's rate at its
            # defaults is tested by tests/test_door.py and bench/door_floods.py
            "PROXY_REQUESTS_PER_S": "100000", "PROXY_REQUEST_BURST": "100000",
            # and wrong keys from one address (127.0.0.1) all session long: one module's
            # refused keys must not throttle the next's requests; the throttle is tested by
            # tests/test_door.py (a server of its own) and tests/test_door_auth.py
            "AUTH_FAILURES_PER_MINUTE": "100000",
            # its daemons share one disk tier (as a fleet on one host does), removed with it
            "PROMPT_CACHE_DIR": str(self.tmp / "prompt-cache"),
        }
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}/ws/v1/stream"
        self.workers = workers
        # daphne's (one per process); only the door connects to them
        self.sockets = web_procs.unix_sockets(self.tmp, workers)
        self.socket = self.sockets[0]
        self.keys: dict[str, Any] = {}
        self.proc: subprocess.Popen | None = None
        self.procs: list[subprocess.Popen] = []
        self.door: subprocess.Popen | None = None

    def start(self) -> WebServer:
        manage = [sys.executable, "manage.py"]
        self.database.migrate(self.env)
        made = subprocess.run([*manage, "shell", "-c", MAKE_KEYS], cwd=ROOT, env=self.env,
                              check=True, capture_output=True, text=True)
        self.keys = json.loads(made.stdout.strip().splitlines()[-1])
        argvs = ([self.daphne_argv()] if self.workers == 1
                 else web_procs.plan_behind_door(self.tmp, self.workers).argvs)
        for path, argv in zip(self.logs, argvs, strict=True):
            log = path.open("ab")
            self.procs.append(subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT))
        self.proc = self.procs[0]
        log = self.logs[0].open("ab")
        self.door = subprocess.Popen(self.door_argv(), cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                if not all(path.exists() for path in self.sockets):
                    raise OSError("not every daphne listens yet")
                with urllib.request.urlopen(f"{self.base_url}/v1/health", timeout=2):
                    return self
            except OSError:
                if (any(p.poll() is not None for p in self.procs)
                        or self.door.poll() is not None or time.monotonic() > deadline):
                    tail = self.log_tail()
                    self.stop()  # no daphne or nginx left behind
                    raise RuntimeError(f"daphne did not start:\n{tail}") from None
                time.sleep(0.2)

    def daphne_argv(self) -> list[str]:
        """daphne on this server's (first) unix socket, behind the door, as ``make run``
        starts it."""
        return web_procs.plan_behind_door(self.tmp, 1).argvs[0]

    @property
    def logs(self) -> list[Path]:
        """Each daphne's log (the door's output goes to the first)."""
        if self.workers == 1:
            return [self.tmp / "daphne.log"]
        return [self.tmp / f"daphne-{i}.log" for i in range(self.workers)]

    @property
    def door_config(self) -> proxy.ProxyConfig:
        """The door's configuration: ``make run``'s, from this server's environment."""
        return proxy.ProxyConfig.from_env(f"127.0.0.1:{self.port}",
                                          web_procs.door_upstream(self.tmp, self.workers),
                                          self.tmp / "door", self.env)

    def door_argv(self) -> list[str]:
        """nginx on this server's port (its configuration written first)."""
        cfg = self.door_config
        proxy.write(cfg)
        return proxy.nginx_argv(cfg)

    def stop(self) -> None:
        """Stop the door and daphne and remove their files (database, logs)."""
        # (a subclass may have started another daphne as ``proc``: tests/chaos)
        for proc in (self.door, self.proc, *self.procs):
            if proc and proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.database.drop()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        text = ""
        for path in (*self.logs, self.door_config.error_log):
            if path.exists():
                text += "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) + "\n"
        return text

    # -- plain HTTP (http.client: streams SSE line by line) --------------------------------

    def request(self, method: str, path: str, body: Any = None, key: str | None = None,
                headers: dict[str, str] | None = None, timeout: float = 60) -> Reply:
        """Send a request; the reply's body is read lazily (``json()``, ``sse()``)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        all_headers = {"Content-Type": "application/json", **(headers or {})}
        if key:
            all_headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=all_headers)
        return Reply(conn, conn.getresponse())

    def request_to(self, worker: int, method: str, path: str, body: Any = None,
                   key: str | None = None, headers: dict[str, str] | None = None,
                   timeout: float = 60) -> Reply:
        """``request`` sent to daphne number ``worker`` on its own socket, past the door
        (with the headers the door sets), so that a test chooses the process."""
        conn = _UnixConnection(str(self.sockets[worker]), timeout=timeout)
        all_headers = {"Content-Type": "application/json", "Host": f"127.0.0.1:{self.port}",
                       "X-Forwarded-For": "127.0.0.1", "X-Forwarded-Proto": "http",
                       **(headers or {})}
        if key:
            all_headers["Authorization"] = f"Bearer {key}"
        data = body if isinstance(body, (bytes, str)) or body is None else json.dumps(body)
        conn.request(method, path, body=data, headers=all_headers)
        return Reply(conn, conn.getresponse())


class _UnixConnection(http.client.HTTPConnection):
    """HTTP over a unix socket (a daphne's, behind the door)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


@dataclass
class Reply:
    """An HTTP reply whose body is read on demand."""

    conn: http.client.HTTPConnection
    response: http.client.HTTPResponse

    @property
    def status(self) -> int:
        return self.response.status

    def header(self, name: str) -> str | None:
        return self.response.getheader(name)

    def json(self) -> Any:
        try:
            return json.loads(self.response.read())
        finally:
            self.conn.close()

    def sse(self) -> Iterator[tuple[str | None, str]]:
        """(id, data) of each SSE event, as it arrives; comments are skipped."""
        event_id, data = None, []
        while True:
            line = self.response.readline()
            if not line:
                return
            text = line.decode().rstrip("\r\n")
            if text.startswith("id: "):
                event_id = text[4:]
            elif text.startswith("data: "):
                data.append(text[6:])
            elif not text and data:
                yield event_id, "\n".join(data)
                event_id, data = None, []

    def close(self) -> None:
        """Drop the connection (a client going away mid-stream)."""
        self.conn.sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


_web: WebServer | None = None


def web_server() -> WebServer:
    """The session's web server (started on first use)."""
    global _web
    if _web is None:
        _web = WebServer().start()
        atexit.register(_web.stop)
    return _web


def openai_client(web: WebServer, key: str | None = None):
    """The official SDK against ``web`` (the owner's key unless another), no retries."""
    import openai

    return openai.OpenAI(base_url=f"{web.base_url}/v1", api_key=key or web.keys["owner"],
                         max_retries=0)


def redis_conn() -> redis.Redis:
    return redis.Redis.from_url(TEST_REDIS_URL)


def wait_until(check: Callable[[], Any], timeout_s: float = 10, step_s: float = 0.05) -> Any:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {check}")
        time.sleep(step_s)


# -- a stand-in daemon -------------------------------------------------------------------------


@dataclass
class StandIn:
    """Heartbeats under its own model name; the test answers its jobs by hand."""

    model: str = field(default_factory=lambda: f"standin-{uuid.uuid4().hex[:8]}")
    daemon_id: str = field(default_factory=lambda: f"standin-{uuid.uuid4().hex[:8]}")
    redis: redis.Redis = field(default_factory=redis_conn)
    _beating: threading.Event = field(default_factory=threading.Event)

    def start(self) -> StandIn:
        try:
            self.redis.xgroup_create(protocol.jobs_stream(self.model), protocol.JOBS_GROUP,
                                     id="0", mkstream=True)
        except redis.ResponseError:
            pass
        self._beating.set()
        self._heartbeat()
        threading.Thread(target=self._beat, daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        now = time.time()
        snap = {"daemon_id": self.daemon_id, "model": self.model, "started_at": now,
                "heartbeat_at": now, "config": {"n_parallel": 1, "n_ctx": 2048},
                "slots": [{"id": 0, "state": "idle"}], "queue": [], "counters": {}}
        self.redis.set(protocol.daemon_key(self.daemon_id), json.dumps(snap),
                       px=int(protocol.HEARTBEAT_TTL_S * 1000))
        self.redis.zadd(protocol.DAEMONS_ZSET, {self.daemon_id: now})

    def _beat(self) -> None:
        while self._beating.is_set():
            self._heartbeat()
            time.sleep(0.5)

    def die(self) -> None:
        """Stop heartbeating, as a killed process would: the key expires within 3 s."""
        self._beating.clear()

    def stop(self) -> None:
        self._beating.clear()
        self.redis.delete(protocol.daemon_key(self.daemon_id), *queue.keys_of(self.model))
        self.redis.zrem(protocol.DAEMONS_ZSET, self.daemon_id)

    def next_job(self, timeout_s: float = 10) -> protocol.Job:
        """The next job of the model's queue, taken as a daemon takes it."""
        deadline = time.monotonic() + timeout_s
        while True:
            entries, bell = queue.take(self.redis, self.model, self.daemon_id, 1)
            if entries:
                return protocol.Job.decode(entries[0][1])
            left_ms = int((deadline - time.monotonic()) * 1000)
            assert left_ms > 0, f"no job for {self.model} within {timeout_s} s"
            queue.wait_for_bell(self.redis, self.model, bell, min(left_ms, 500))

    def emit(self, request_id: str, kind: str, data: dict[str, Any]) -> str:
        entry = self.redis.xadd(protocol.events_stream(request_id),
                                protocol.encode_event(kind, data))
        return entry.decode()

    def accept(self, job: protocol.Job, prompt_tokens: int = 5) -> str:
        return self.emit(job.id, protocol.ACCEPTED, {
            "daemon_id": self.daemon_id, "prompt_tokens": prompt_tokens, "model": self.model})

    def finish(self, job: protocol.Job, reason: str = "stop", completion_tokens: int = 2,
               cached_tokens: int = 0) -> str:
        return self.emit(job.id, protocol.DONE, {
            "finish_reason": reason, "stop": None, "timings": {},
            "usage": protocol.usage(5, cached_tokens, completion_tokens)})

    def is_cancelled(self, request_id: str) -> bool:
        return bool(self.redis.exists(protocol.cancel_key(request_id)))

    def serve(self, handler: Callable[[StandIn, protocol.Job], None],
              jobs: int = 1) -> threading.Thread:
        """Answer the next ``jobs`` jobs with ``handler`` on a background thread."""

        def run() -> None:
            for _ in range(jobs):
                handler(self, self.next_job(timeout_s=30))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def echo(standin: StandIn, job: protocol.Job) -> None:
    """Accept, send "Hello" and " world" as two token events, finish with usage."""
    standin.accept(job)
    standin.emit(job.id, protocol.TOKEN, {"text": "Hello", "n_tokens": 1})
    standin.emit(job.id, protocol.TOKEN, {"text": " world", "n_tokens": 1})
    standin.finish(job, cached_tokens=3)


# -- a real daemon -------------------------------------------------------------------------------


class RealDaemon:
    """``manage.py run_scheduler`` (Gemma) on the web server's database and Redis."""

    def __init__(self, web: WebServer, model: str, **settings: str) -> None:
        self.model = model
        self.daemon_id = f"test-{uuid.uuid4().hex[:8]}"
        # short default replies keep fuzzed requests quick; tests that want more say so
        self.env = {**web.env, "MODEL_NAME": model, "DEFAULT_MAX_TOKENS": "16", **settings}
        self.log_path = web.tmp / f"{model}.log"
        self.proc: subprocess.Popen | None = None
        self.redis = redis.Redis.from_url(self.env["REDIS_URL"])

    def start(self, timeout_s: float = 180, daemon_id: str | None = None) -> RealDaemon:
        """``daemon_id``: run under this id (a restart, as the supervisor does it)."""
        self.daemon_id = daemon_id or f"test-{uuid.uuid4().hex[:8]}"
        argv = [sys.executable, "manage.py", "run_scheduler", "--grace", "5",
                "--daemon-id", self.daemon_id]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while not self.redis.exists(protocol.daemon_key(self.daemon_id)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"run_scheduler did not start:\n{self.log_tail()}")
            time.sleep(0.2)
        return self

    def snapshot(self) -> dict[str, Any]:
        raw = self.redis.get(protocol.daemon_key(self.daemon_id))
        return json.loads(raw) if raw else {}

    def kill(self) -> None:
        """SIGKILL: no goodbye, the heartbeat key just expires."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        """SIGTERM (drain), SIGKILL after 30 s; then drop the model's jobs stream."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.redis.delete(*queue.keys_of(self.model))

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


_daemons: dict[str, RealDaemon] = {}


def shared_daemon(web: WebServer, role: str = "main") -> RealDaemon:
    """The session's daemon for ``role`` (N_CTX 2048, N_PARALLEL 2), started on first use.
    Its model name is unique to this session, so no other test's jobs reach it.
    ``role="chat"``: SmolLM2-135M-Instruct under its catalog name (the web's default model,
    the first of ``MODELS``), from its installed wheel."""
    if role not in _daemons:
        if role == "chat":
            path = CATALOG[SMOLLM2].path()
            if path is None:
                raise RuntimeError(f"{SMOLLM2_PIN} is not installed: run `make setup`")
            daemon = RealDaemon(web, SMOLLM2, MODEL_PATH=str(path))
        else:
            daemon = RealDaemon(web, f"gemma-{role}-{uuid.uuid4().hex[:6]}")
        _daemons[role] = daemon.start()
        atexit.register(_daemons[role].stop)
    return _daemons[role]


# -- a Redis of a test's own (the fault tests restart it; never the shared one) ------------------


class RedisServer:
    """``redis-server`` on a free port of 127.0.0.1, its data (AOF, ``appendfsync everysec``,
    as in docker-compose.yml) in a directory of its own: ``stop`` and ``start`` again is a
    Redis restart that keeps what was written."""

    def __init__(self, directory: Path | None = None, port: int | None = None) -> None:
        self.dir = directory or Path(tempfile.mkdtemp(prefix="redis-test-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 30) -> RedisServer:
        argv = [shutil.which("redis-server") or "redis-server", "--port", str(self.port),
                "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
                "--appendonly", "yes", "--appendfsync", "everysec", "--loglevel", "warning",
                "--logfile", str(self.dir / "redis.log")]
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        client = self.client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    if client.ping():  # answers once the AOF is loaded (LOADING before)
                        return self
                except redis.RedisError:
                    pass
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on {self.port}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> None:
        """SIGTERM: Redis fsyncs the AOF and exits; SIGKILL: up to a second of writes lost."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout_s)

    def restart(self, down_s: float = 0.0, sig: int = signal.SIGTERM) -> None:
        """Stop, stay down ``down_s``, start again on the same port and directory."""
        self.stop(sig)
        time.sleep(down_s)
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=2)

    def close(self) -> None:
        """Stop for good and remove the data."""
        self.stop(signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)
