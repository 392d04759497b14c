"""How daphne listens: one Twisted endpoint string (standard library only, like
``config.models``: ``scripts/dev.py`` and the benchmarks read it before Django is set up).

Twisted's TCP endpoints listen with a backlog of 50 unless told otherwise. A burst of more
new connections than that overflows the kernel's accept queue; the dropped handshakes are
retried by the client's kernel a second later (or reset), so every request of a burst past
the 50th waits a second or more before the web sees it (bench/fleet.py's refusals, 240 at
once: 401s and 503s alike at 1.1-2.4 s p99, and connections reset). The kernel caps the
backlog at ``net.core.somaxconn`` (4096 on current Linux; older kernels: 128)."""

from __future__ import annotations

LISTEN_BACKLOG = 1024


def daphne_endpoint(host: str, port: int | str, backlog: int = LISTEN_BACKLOG) -> str:
    """The ``daphne -e`` endpoint string for ``host``:``port`` (IPv6 colons escaped)."""
    interface = host.strip("[]").replace(":", r"\:")
    return f"tcp:port={int(port)}:interface={interface}:backlog={int(backlog)}"


def daphne_unix_endpoint(path: str, backlog: int = LISTEN_BACKLOG) -> str:
    """The ``daphne -e`` endpoint string for a unix socket at ``path`` that only this user
    can connect to (the door, nginx, runs as the same user: config/proxy.py). With its lock
    file (``<path>.lock``) a daphne started after a killed one removes the stale socket
    instead of failing with "Address already in use"."""
    escaped = str(path).replace(":", r"\:")
    return f"unix:{escaped}:mode=600:backlog={int(backlog)}:lockfile=1"
