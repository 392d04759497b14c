"""Several web processes behind one port (``WEB_WORKERS``, config/web_procs.py), live.

- The launcher: ``make run``'s ``serve_web`` starts WEB_WORKERS daphnes; without the door
  each holds its own ``SO_REUSEPORT`` listening socket of the one port and accepts a share
  of a burst of connections (the kernel's /proc tables say which process holds which
  socket: no header or health field tells a client which process served it); behind the
  door each daphne listens on a socket of its own, all of them in nginx's upstream.
- Behind the door, concurrent requests are spread over the processes (each daphne's
  access log names the requests it served).
- Nothing a process keeps for itself makes another process wrong: a stream started
  through process 0 is cancelled and resumed (Last-Event-ID) through process 1, a resume
  through process 1 keeps a request watched after process 0's reader dropped, and a key
  revoked elsewhere stops working on every process within KEY_CACHE_S.
"""
from __future__ import annotations

import json
import os
import re
import runpy
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from config import proxy, web_procs
from inference.auth import KEY_CACHE_S
from tests.live_service import ROOT, WebServer, free_port, wait_until
from wire import protocol

WORKERS = 2
MANAGE = [sys.executable, "manage.py"]
GRACE_S = 3  # the WebServer's RESUME_GRACE_S
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def web():
    """Two daphnes behind the door (their access logs unbuffered: a test reads them)."""
    server = WebServer(workers=WORKERS)
    server.env["PYTHONUNBUFFERED"] = "1"
    server.start()
    yield server
    server.stop()


# -- who holds which socket: the kernel's tables ------------------------------------------------


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        match = re.fullmatch(r"socket:\[(\d+)\]", target)
        if match:
            inodes.add(int(match.group(1)))
    return inodes


def tcp_sockets(port: int, state: str) -> set[int]:
    """Inodes of the IPv4 TCP sockets on local ``port`` in ``state`` (0A listen,
    01 established), from /proc/net/tcp."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == state:
            inodes.add(int(fields[9]))
    return inodes


def unix_listeners(path: Path) -> set[int]:
    """Inodes of the unix sockets listening at ``path`` (flags 00010000: listening)."""
    inodes = set()
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] == str(path) and fields[3] == "00010000":
            inodes.add(int(fields[6]))
    return inodes


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


@pytest.fixture
def make_run(web, monkeypatch):
    """``scripts/dev.py``'s ``serve_web`` (what ``make run`` starts) with WEB_WORKERS=2, on
    the module's database and Redis; its processes stopped after the test."""
    dev = runpy.run_path(str(ROOT / "scripts" / "dev.py"))
    for name, value in web.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("WEB_WORKERS", str(WORKERS))
    monkeypatch.chdir(ROOT)
    door = Path(tempfile.mkdtemp(prefix="web-workers-door-"))
    started: list[subprocess.Popen] = []

    def serve(proxy_on: bool, port: int) -> list[tuple[str, subprocess.Popen]]:
        monkeypatch.setenv("PROXY", "on" if proxy_on else "off")
        procs = dev["serve_web"]("127.0.0.1", str(port), door)
        started.extend(p for _, p in procs)
        return procs

    serve.door = door  # type: ignore[attr-defined]
    yield serve
    dev["stop"](list(reversed([(str(p.pid), p) for p in started])))
    shutil.rmtree(door, ignore_errors=True)


def health(port: int) -> int:
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/health", timeout=2) as r:
                return r.status
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_make_run_without_the_door_starts_daphnes_sharing_one_tcp_port(make_run):
    """PROXY=off: two daphnes, each holding one of the port's two listening sockets (bound
    by the launcher, which keeps no copy), and a burst of connections accepted by both."""
    port = free_port()
    procs = make_run(False, port)
    assert [name for name, _ in procs] == ["daphne 1/2", "daphne 2/2"]
    assert health(port) == 200
    pids = [p.pid for _, p in procs]
    listeners = tcp_sockets(port, "0A")
    held = [socket_inodes(pid) & listeners for pid in pids]
    assert len(listeners) == WORKERS and all(len(h) == 1 for h in held)
    assert held[0] != held[1]
    assert not socket_inodes(os.getpid()) & listeners  # the launcher closed its copies
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(32)]
    try:
        def accepted() -> list[int] | None:
            established = tcp_sockets(port, "01")
            counts = [len(socket_inodes(pid) & established) for pid in pids]
            return counts if sum(counts) >= len(clients) else None

        counts = wait_until(accepted, timeout_s=10)
        # the kernel hashes connections over the sockets: all 32 on one is a 2**-31 chance
        assert all(c > 0 for c in counts), counts
    finally:
        for client in clients:
            client.close()


def test_make_run_behind_the_door_gives_each_daphne_its_socket_in_the_upstream(make_run):
    port = free_port()
    procs = make_run(True, port)
    assert [name for name, _ in procs] == ["daphne 1/2", "daphne 2/2", "the door (nginx)"]
    assert health(port) == 200
    sockets = web_procs.unix_sockets(make_run.door, WORKERS)
    for (_, proc), path in zip(procs, sockets, strict=False):
        assert unix_listeners(path) and unix_listeners(path) <= socket_inodes(proc.pid)
        assert (path.stat().st_mode & 0o777) == 0o600
    conf = (make_run.door / "nginx.conf").read_text()
    assert "least_conn;" in conf
    assert all(f"server unix:{path};" in conf for path in sockets)


# -- behind the door: the module's two daphnes ------------------------------------------------


def served(web: WebServer, line: str) -> list[int]:
    """How many of each daphne's access log lines name ``line`` ("POST /v1/...")."""
    return [path.read_text(errors="replace").count(f'"{line}"') for path in web.logs]


def test_the_door_spreads_concurrent_requests_over_the_processes(web, standin):
    """Four streams held open at once through the door: least_conn gives each daphne two
    (a daphne's access log names each request it served, once it ended)."""
    release = threading.Event()

    def hold(daemon, job):  # accepts each job and answers the next: all four held at once
        daemon.accept(job)
        threading.Thread(target=lambda: (release.wait(30), daemon.finish(job)),
                         daemon=True).start()

    line = "POST /v1/chat/completions"
    before = served(web, line)
    standin.serve(hold, jobs=4)
    body = {"model": standin.model, "messages": HELLO, "stream": True}
    replies = []
    try:
        for _ in range(4):
            replies.append(web.request("POST", "/v1/chat/completions", body, web.keys["owner"]))
            assert replies[-1].status == 200
    finally:
        release.set()
    for reply in replies:
        assert [d for _, d in reply.sse()][-1] == "[DONE]"
    after = wait_until(lambda: (lambda n: n if sum(n) - sum(before) == 4 else None)(
        served(web, line)))
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]


def test_a_stream_of_process_0_is_resumed_and_cancelled_through_process_1(web, standin):
    cancelled = threading.Event()

    def until_cancelled(daemon, job):
        daemon.accept(job)
        daemon.emit(job.id, protocol.TOKEN, {"text": "one", "n_tokens": 1})
        daemon.emit(job.id, protocol.TOKEN, {"text": " two", "n_tokens": 1})
        wait_until(lambda: daemon.is_cancelled(job.id), timeout_s=30)
        daemon.emit(job.id, protocol.TOKEN, {"text": " three", "n_tokens": 1})
        daemon.finish(job, reason="cancelled")
        cancelled.set()

    standin.serve(until_cancelled)
    body = {"model": standin.model, "messages": HELLO, "stream": True}
    reply = web.request_to(0, "POST", "/v1/chat/completions", body, web.keys["owner"])
    assert reply.status == 200
    request_id = reply.header("X-Request-Id")
    stream = reply.sse()
    first = [next(stream) for _ in range(3)]  # the role, "one", " two"
    assert json.loads(first[1][1])["choices"][0]["delta"] == {"content": "one"}
    resumed = web.request_to(1, "GET", f"/v1/requests/{request_id}/events",
                             key=web.keys["member"], headers={"Last-Event-ID": first[1][0]})
    assert resumed.status == 200
    resumed_events = resumed.sse()
    event_id, data = next(resumed_events)
    assert (event_id, json.loads(data)["choices"][0]["delta"]) == (first[2][0],
                                                                    {"content": " two"})
    answer = web.request_to(1, "POST", f"/v1/requests/{request_id}/cancel",
                            key=web.keys["member"])
    assert answer.status == 200 and answer.json()["cancel_requested"] is True
    assert cancelled.wait(30)
    rest = [(i, d if d == "[DONE]" else json.loads(d)) for i, d in resumed_events]
    original = [(i, d if d == "[DONE]" else json.loads(d)) for i, d in stream]
    assert rest == original  # both readers see the same events, ids and all
    assert rest[0][1]["choices"][0]["delta"] == {"content": " three"}
    assert rest[1][1]["choices"][0]["finish_reason"] == "cancelled"
    assert rest[-1] == (None, "[DONE]")
    row = web.request_to(1, "GET", f"/v1/requests/{request_id}", key=web.keys["owner"]).json()
    assert row["id"] == request_id


def test_a_resume_on_process_1_keeps_the_request_of_a_dropped_reader_on_process_0(
        web, standin):
    """Process 0's reader goes away; process 1's resume renews the watch: the key outlives
    two graces (a real daemon would cancel the request once it expired)."""
    release = threading.Event()

    def held(daemon, job):
        daemon.accept(job)
        daemon.emit(job.id, protocol.TOKEN, {"text": "one", "n_tokens": 1})
        release.wait(30)
        daemon.finish(job)

    standin.serve(held)
    body = {"model": standin.model, "messages": HELLO, "stream": True}
    reply = web.request_to(0, "POST", "/v1/chat/completions", body, web.keys["owner"])
    request_id = reply.header("X-Request-Id")
    stream = reply.sse()
    next(stream)
    resumed = web.request_to(1, "GET", f"/v1/requests/{request_id}/events",
                             key=web.keys["owner"])
    assert resumed.status == 200
    events = resumed.sse()
    next(events)
    reply.close()
    time.sleep(2 * GRACE_S)
    try:
        assert standin.redis.exists(protocol.watch_key(request_id))
        assert not standin.is_cancelled(request_id)
    finally:
        release.set()
    assert [d for _, d in events][-1] == "[DONE]"


def test_a_key_revoked_elsewhere_stops_on_every_process(web):
    """Each process caches a good key KEY_CACHE_S; a revocation made by another process
    (here manage.py) is seen by both within that."""
    made = subprocess.run(
        [*MANAGE, "shell", "-c",
         "from accounts.models import ApiKey, Tenant; "
         "print(ApiKey.issue(Tenant.objects.get(slug='alpha'), 'short-lived')[1])"],
        cwd=ROOT, env=web.env, check=True, capture_output=True, text=True)
    key = made.stdout.strip().splitlines()[-1]
    for worker in range(WORKERS):  # cached as good on both
        assert web.request_to(worker, "GET", "/v1/models", key=key).json()["object"] == "list"
    subprocess.run([*MANAGE, "shell", "-c",
                    "from accounts.models import ApiKey; "
                    "[k.revoke() for k in ApiKey.objects.filter(name='short-lived')]"],
                   cwd=ROOT, env=web.env, check=True, capture_output=True)
    revoked_at = time.monotonic()
    for worker in range(WORKERS):
        def refused(worker: int = worker) -> bool:
            return web.request_to(worker, "GET", "/v1/models", key=key).status == 401

        wait_until(refused, timeout_s=10)
    assert time.monotonic() - revoked_at < KEY_CACHE_S + 2


def test_the_door_lists_every_process_in_its_upstream(web):
    conf = proxy.render(web.door_config)
    assert all(f"server unix:{path};" in conf for path in web.sockets)
    assert [p.poll() for p in web.procs] == [None] * WORKERS


def test_the_launcher_refuses_a_port_an_earlier_run_still_listens_on():
    """Daphnes of a run killed hard keep the port's SO_REUSEPORT group: a new launch must
    fail, not bind beside them and share the connections with old code."""
    from config import web_procs

    old = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        old.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        old.bind(("127.0.0.1", 0))
        old.listen(8)
        port = old.getsockname()[1]
        with pytest.raises(OSError, match="in use"):
            web_procs.reuseport_sockets("127.0.0.1", port, 2)
    finally:
        old.close()
    for sock in web_procs.reuseport_sockets("127.0.0.1", port, 2):  # free again: it binds
        sock.close()
