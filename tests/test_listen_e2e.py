"""daphne listens with the backlog of config/listen.py (live, the tests' daphne, started as
``make run`` starts it). Twisted's default of 50 overflowed the kernel's accept queue under
bench/fleet.py's 240-request bursts (658 dropped handshakes in one run, requests reset or
retried a second later); with 1024 the same bursts drop none."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from config.listen import LISTEN_BACKLOG, daphne_endpoint


def listen_backlog(port: int) -> int:
    """The backlog of the socket listening on ``port`` (``ss``'s Send-Q for a listener)."""
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], check=True, capture_output=True,
                         text=True).stdout.split()
    return int(out[2])


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (Debian's iproute2)")
def test_daphne_listens_with_the_configured_backlog(web):
    somaxconn = int(Path("/proc/sys/net/core/somaxconn").read_text())
    assert listen_backlog(web.port) == min(LISTEN_BACKLOG, somaxconn)


def test_the_endpoint_escapes_ipv6_addresses():
    assert daphne_endpoint("::", 8000) == r"tcp:port=8000:interface=\:\::backlog=1024"
    assert daphne_endpoint("[::1]", "80", 64) == r"tcp:port=80:interface=\:\:1:backlog=64"
