"""Several web processes behind one port: ``WEB_WORKERS`` daphnes, started the same way by
``make run`` (scripts/dev.py), compose's web service (``python -m config.web_procs``), the
live tests (tests/live_service.py) and the benchmarks. Standard library only, like
``config.listen``: it runs before Django is set up.

Two ways in, one per way the web is reached:

- **Behind the door** (nginx, config/proxy.py): each daphne listens on a unix socket of its
  own (``web.sock`` for one process, ``web-0.sock``, ``web-1.sock``... for several, mode
  600) and nginx spreads requests over them with ``least_conn``: a burst goes to the
  process with the fewest requests in progress, and so do long-lived streams.
- **Without the door** (``PROXY=off``, compose's web containers): the parent binds one TCP
  socket per daphne on the same address and port with ``SO_REUSEPORT`` and each daphne
  adopts its own (``-e fd:fileno=N``); the kernel spreads new connections over the sockets
  by a hash of their addresses. One socket shared by every daphne spreads a burst unevenly:
  every process wakes on it, and Twisted's ``Port.doRead`` accepts up to ``numberAccepts``
  connections in one go (as many as it took last time, 20 more when it took all it was
  allowed), so whichever process is awake takes what is queued. Twisted's ``fd:`` endpoint
  adopts IPv4 sockets only: an IPv6 address is served by one daphne that binds it itself.

The parent closes its copies of the sockets once the daphnes hold them: a daphne that dies
takes its socket with it, and the kernel hashes new connections over those left.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script by compose
    sys.path.insert(0, str(ROOT))

from config.listen import LISTEN_BACKLOG, daphne_endpoint, daphne_unix_endpoint  # noqa: E402
from config.proxy import env_int  # noqa: E402

MAX_DEFAULT_WORKERS = 4  # WEB_WORKERS' default: the cores, at most this many
APPLICATION = "config.asgi:application"
STOP_GRACE_S = 15.0


def default_workers() -> int:
    """WEB_WORKERS when unset: the number of cores, at most ``MAX_DEFAULT_WORKERS``."""
    return max(1, min(os.cpu_count() or 1, MAX_DEFAULT_WORKERS))


def web_workers(env: Mapping[str, str] | None = None) -> int:
    """``WEB_WORKERS`` from ``env`` (the environment by default): at least 1."""
    return env_int(os.environ if env is None else env, "WEB_WORKERS", default_workers())


def unix_sockets(door: Path, workers: int) -> list[Path]:
    """The daphnes' unix sockets in ``door`` (only this user reaches them)."""
    if workers == 1:
        return [Path(door) / "web.sock"]
    return [Path(door) / f"web-{i}.sock" for i in range(workers)]


def door_upstream(door: Path, workers: int) -> str:
    """config/proxy.py's ``--upstream`` for those sockets (several: comma-separated)."""
    return ",".join(f"unix:{path}" for path in unix_sockets(door, workers))


def reuseport_sockets(host: str, port: int | str, workers: int,
                      backlog: int = LISTEN_BACKLOG) -> list[socket.socket]:
    """``workers`` TCP sockets listening on ``host``:``port``, each with ``SO_REUSEPORT``
    (port 0: a free port, the same for all of them)."""
    address = host.strip("[]")
    if ":" in address:
        raise ValueError(f"{host}: daphne adopts IPv4 sockets only (Twisted's fd: endpoint)")
    if int(port):
        ensure_free(address, int(port))
    sockets: list[socket.socket] = []
    try:
        for _ in range(workers):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((address, int(port)))
            port = sock.getsockname()[1]
            sock.listen(backlog)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def ensure_free(address: str, port: int) -> None:
    """Raise ``OSError`` (EADDRINUSE) if anything listens on ``address``:``port``: a socket
    without ``SO_REUSEPORT`` cannot bind beside a listening one, so this probe finds what
    the daphnes' own ``SO_REUSEPORT`` binds would not (daphnes of an earlier run killed
    hard, still listening: the kernel would spread connections over old and new)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no owner
        probe.bind((address, port))
    except OSError as exc:
        raise OSError(errno.EADDRINUSE, f"{address}:{port} is in use (another server, or "
                      "daphnes of an earlier run still listening)") from exc
    finally:
        probe.close()


def fd_endpoint(sock: socket.socket) -> str:
    """The ``daphne -e`` endpoint string that adopts ``sock``, an IPv4 socket (Twisted's
    ``fd:`` plugin takes no other address family from a string)."""
    if sock.family != socket.AF_INET:
        raise ValueError("daphne adopts IPv4 sockets only")
    return f"fd:fileno={sock.fileno()}"


def daphne_argv(endpoint: str, proxy_headers: bool,
                python: str = sys.executable) -> list[str]:
    """One daphne serving the project on ``endpoint``."""
    return [python, "-m", "daphne", *(["--proxy-headers"] if proxy_headers else []),
            "-e", endpoint, APPLICATION]


@dataclass
class WebPlan:
    """The daphnes to start: each one's argv and the descriptors it inherits; ``sockets``
    are the parent's copies, closed once the daphnes started (``start_web`` does)."""

    argvs: list[list[str]]
    pass_fds: list[tuple[int, ...]]
    sockets: list[socket.socket] = field(default_factory=list)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


def plan_behind_door(door: Path, workers: int, python: str = sys.executable) -> WebPlan:
    """``workers`` daphnes behind the door, each on its unix socket in ``door``; the door's
    upstream is ``door_upstream(door, workers)``."""
    argvs = [daphne_argv(daphne_unix_endpoint(str(path)), True, python)
             for path in unix_sockets(door, workers)]
    return WebPlan(argvs, [()] * workers)


def plan_tcp(host: str, port: int | str, workers: int, proxy_headers: bool = False,
             python: str = sys.executable) -> WebPlan:
    """``workers`` daphnes on ``host``:``port``, each adopting a ``SO_REUSEPORT`` socket bound
    here. ``proxy_headers``: behind a proxy of its own (compose's). An IPv6 ``host``: one
    daphne, binding it itself."""
    if ":" in host.strip("[]"):
        if workers != 1:
            raise SystemExit(f"WEB_WORKERS={workers} on {host}: several daphnes share IPv4 "
                             "addresses only; use WEB_WORKERS=1 or the door")
        return WebPlan([daphne_argv(daphne_endpoint(host, port), proxy_headers, python)], [()])
    sockets = reuseport_sockets(host, port, workers)
    return WebPlan([daphne_argv(fd_endpoint(s), proxy_headers, python) for s in sockets],
                   [(s.fileno(),) for s in sockets], sockets)


def start_web(workers: int, *, door: Path | None = None, host: str = "127.0.0.1",
              port: int | str = 0, proxy_headers: bool = False,
              env: Mapping[str, str] | None = None, cwd: Path = ROOT,
              stdout: object = None, stderr: object = None,
              python: str = sys.executable) -> list[subprocess.Popen]:
    """Start ``workers`` daphnes as ``make run`` does: on unix sockets in ``door`` (behind
    the door; start nginx with ``door_upstream(door, workers)``), or else on
    ``host``:``port`` (parent-bound ``SO_REUSEPORT`` sockets). Each in a process group of
    its own; the caller stops them (``stop_web``)."""
    plan = (plan_behind_door(door, workers, python) if door is not None
            else plan_tcp(host, port, workers, proxy_headers, python))
    procs: list[subprocess.Popen] = []
    try:
        for argv, fds in zip(plan.argvs, plan.pass_fds, strict=True):
            procs.append(subprocess.Popen(
                argv, cwd=cwd, env=None if env is None else dict(env), pass_fds=fds,
                stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, process_group=0))
    except BaseException:
        stop_web(procs)
        raise
    finally:
        plan.close()
    return procs


def stop_web(procs: list[subprocess.Popen], sig: int = signal.SIGINT,
             grace_s: float = STOP_GRACE_S) -> None:
    """Signal every daphne at once, wait ``grace_s`` for all, then kill what is left."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(sig)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Compose's web service: WEB_WORKERS daphnes on one TCP port, in the foreground, until
    a signal (passed on to them) or until one of them exits (the others are stopped, the
    exit status is the one that exited first: the container restarts)."""
    parser = argparse.ArgumentParser(description="Run WEB_WORKERS daphnes on one port.")
    parser.add_argument("--listen", default="0.0.0.0:8000", help="HOST:PORT")
    parser.add_argument("--proxy-headers", action="store_true",
                        help="take the client's address from the proxy's X-Forwarded-For")
    args = parser.parse_args(argv)
    host, _, port = args.listen.rpartition(":")
    workers = web_workers()
    procs = start_web(workers, host=host or "0.0.0.0", port=port,
                      proxy_headers=args.proxy_headers)
    print(f"web: {workers} daphne processes on {args.listen}: "
          f"{' '.join(str(p.pid) for p in procs)}", flush=True)
    stopping: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not stopping and all(p.poll() is None for p in procs):
        time.sleep(0.2)
    status = next((p.returncode for p in procs if p.poll() is not None), 0)
    stop_web(procs, signal.SIGTERM if stopping else signal.SIGINT)
    return 0 if stopping else (status or 1)


if __name__ == "__main__":
    sys.exit(main())
