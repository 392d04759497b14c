"""The issue's first attack at its own scale, on a server with the default caps, through the
door (nginx): tenant A opens 530 resumes of its one long stream at once (from three
addresses, as the door allows 256 requests in progress per address); tenant B's requests,
streamed and whole, are served meanwhile (200, never a 503), and the process never holds
more readers of A's than its caps allow."""
from __future__ import annotations

import http.client
import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.live_service import StandIn, WebServer, echo
from tests.test_limits_http import chat
from tests.test_stream_shares import held_stream, read_to_end

pytestmark = pytest.mark.database  # a live server of this module's own
GUARD_S = 60  # hang guard
RESUMES = 530  # the number
SOURCES = ["127.0.0.21", "127.0.0.22", "127.0.0.23"]  # 530 over three addresses


@pytest.fixture(scope="module")
def web() -> Iterator[WebServer]:
    server = WebServer()  # WEB_MAX_STREAMS 512 and the other caps at their defaults
    for name in ("WEB_MAX_STREAMS", "WEB_TENANT_STREAMS", "WEB_READERS_PER_REQUEST",
                 "PROXY_CONNS_PER_ADDRESS"):
        server.env.pop(name, None)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def standin() -> Iterator[StandIn]:
    daemon = StandIn().start()
    yield daemon
    daemon.stop()


def resume(web: WebServer, path: str, key: str, source: str, start: threading.Barrier,
           held: list[http.client.HTTPConnection]) -> tuple[int, str]:
    """One resume, sent when all are ready: (status, error code); an admitted one stays
    open (in ``held``) until the test ends."""
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=GUARD_S,
                                      source_address=(source, 0))
    start.wait(GUARD_S)
    conn.request("GET", path, headers={"Authorization": f"Bearer {key}"})
    reply = conn.getresponse()
    if reply.status == 200:
        held.append(conn)
        return 200, ""
    body = reply.read()
    conn.close()
    return reply.status, json.loads(body)["error"]["code"]


def test_530_resumes_of_one_stream_leave_another_tenant_served(web, standin):
    a, b = web.keys["owner"], web.keys["outsider"]
    release = threading.Event()
    stream, path = held_stream(web, standin, a, release)
    held: list[http.client.HTTPConnection] = []
    try:
        start = threading.Barrier(RESUMES)
        with ThreadPoolExecutor(RESUMES) as pool:
            outcomes = Counter(pool.map(
                lambda i: resume(web, path, a, SOURCES[i % len(SOURCES)], start, held),
                range(RESUMES)))
        standin.serve(echo, jobs=2)
        whole = chat(web, standin, b)
        assert whole.status == 200, whole.json()
        streamed = chat(web, standin, b, stream=True)
        assert streamed.status == 200, streamed.json()
        read_to_end([streamed])
        # a request has at most 4 readers: its stream and three resumes
        assert outcomes[(200, "")] == 3, outcomes
        assert set(outcomes) == {(200, ""), (429, "too_many_streams")}, outcomes
    finally:
        release.set()
        for conn in held:
            conn.close()
    read_to_end([stream])
