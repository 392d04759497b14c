"""The door (nginx, config/proxy.py) in front of the real daphne, as ``make run`` serves them:
keys before bodies, bounded bodies, slow clients cut, requests per address capped, and
nginx's own refusals in the API's error shape. Raw sockets: the clients here misbehave.

Memory and disk are read from /proc and the door's body directory while the attack runs.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from config import proxy
from tests.live_service import WebServer, free_port, wait_until

LIMIT = 256 * 1024  # the test server's body limit (DATA_UPLOAD_MAX_MEMORY_SIZE)
HEAD_DEADLINE_S = 2
BODY_DEADLINE_S = 2
KEEPALIVE_S = 2
PER_ADDRESS = 4
FAILURES = 5  # AUTH_FAILURES_PER_MINUTE
GUARD_S = 60  # hang guard: far past every deadline above


@pytest.fixture(scope="module")
def web() -> Iterator[WebServer]:
    server = WebServer()
    server.env.update({
        "DATA_UPLOAD_MAX_MEMORY_SIZE": str(LIMIT),
        "PROXY_HEADER_TIMEOUT_S": str(HEAD_DEADLINE_S),
        "PROXY_BODY_TIMEOUT_S": str(BODY_DEADLINE_S),
        "PROXY_KEEPALIVE_S": str(KEEPALIVE_S),
        "PROXY_CONNS_PER_ADDRESS": str(PER_ADDRESS),
        "AUTH_FAILURES_PER_MINUTE": str(FAILURES),
    })
    server.start()
    yield server
    server.stop()


# -- raw HTTP ---------------------------------------------------------------------------------


def connect(web: WebServer, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", web.port), timeout=GUARD_S,
                                    source_address=(source, 0))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def head(path: str, headers: dict[str, str], method: str = "POST") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one reply with a Content-Length (nginx's refusals),
    after any interim ``100 Continue``."""
    data = b""
    while True:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"closed before a reply: {data!r}")
            data += chunk
        raw_head, _, body = data.partition(b"\r\n\r\n")
        if not raw_head.startswith(b"HTTP/1.1 1"):
            break
        data = body
    status_line, *header_lines = raw_head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(status_line.split()[1]), headers, body[:length]


def error_code(body: bytes) -> str:
    return json.loads(body)["error"]["code"]


def closed(sock: socket.socket) -> bool:
    """True once the server has closed the connection (reads end or reset)."""
    try:
        return sock.recv(65536) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def door_workers(web: WebServer) -> list[int]:
    assert web.door is not None
    children = Path(f"/proc/{web.door.pid}/task/{web.door.pid}/children").read_text().split()
    return [int(pid) for pid in children]


def bytes_under(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def body_dir(web: WebServer) -> Path:
    return web.door_config.workdir / "body"


def history_count(web: WebServer) -> int:
    reply = web.request("GET", "/v1/requests?limit=100", key=web.keys["owner"])
    return len(reply.json()["results"])
    return len(reply.json()["results"])


# -- keys before bodies -----------------------------------------------------------------------


def test_a_body_over_the_limit_is_refused_before_it_is_read(web):
    """100 MB announced, no key: refused in the API's shape from the headers alone."""
    with connect(web) as sock:
        sock.sendall(head("/v1/completions", {"Content-Type": "application/json",
                                              "Content-Length": str(100_000_000)}))
        status, _, body = read_reply(sock)
    assert (status, error_code(body)) == (400, "request_too_large")


def test_no_key_means_no_body_is_read(web):
    """``Expect: 100-continue`` without a key: the 401 comes before the client has sent one
    byte of its body (whatever it sends after is dropped, never stored: below)."""
    with connect(web) as sock:
        sock.sendall(head("/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": str(LIMIT // 2),
            "Expect": "100-continue"}))
        status, _, body = read_reply(sock)
    assert (status, error_code(body)) == (401, "invalid_api_key")
    assert b"provide an API key" in body


def test_a_wrong_key_is_refused_before_its_body_too(web):
    with connect(web) as sock:
        sock.sendall(head("/v1/chat/completions", {
            "Content-Type": "application/json", "Content-Length": str(LIMIT // 2),
            "Expect": "100-continue", "Authorization": "Bearer sk-abcdefgh.wrongwrongwrong"}))
        status, _, body = read_reply(sock)
    assert (status, error_code(body)) == (401, "invalid_api_key")


def endless_chunked(web: WebServer, headers: dict[str, str], seconds: float
                    ) -> tuple[int, int | None, bytes, dict[str, int]]:
    """Send a chunked body that never ends, for ``seconds`` or until the door cuts it:
    (bytes sent, status of the reply if one came, its body, and what was seen: the largest
    size of the door's body directory, daphne's and the door's RSS growth in kB, whether
    the door closed the connection, how long it was open)."""
    daphne_pid, workers = web.proc.pid, door_workers(web)
    before = {"daphne": rss_kb(daphne_pid), "door": sum(rss_kb(p) for p in workers)}
    chunk = b"%x\r\n%s\r\n" % (64 * 1024, b"x" * 64 * 1024)
    sent, largest, status, body, cut = 0, 0, None, b"", False
    started = time.monotonic()
    with connect(web) as sock:
        sock.settimeout(0.2)
        sock.sendall(head("/v1/completions", {"Content-Type": "application/json",
                                              "Transfer-Encoding": "chunked", **headers}))
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                sock.sendall(chunk)
                sent += len(chunk)
            except (TimeoutError, BrokenPipeError, ConnectionResetError):
                pass
            largest = max(largest, bytes_under(body_dir(web)))
            try:
                data = sock.recv(65536, socket.MSG_PEEK)
            except TimeoutError:
                continue
            except (ConnectionResetError, BrokenPipeError):
                cut = True
                break
            if not data:
                cut = True
                break
            if status is None and b"\r\n\r\n" in data:
                sock.settimeout(GUARD_S)
                status, _, body = read_reply(sock)
                sock.settimeout(0.2)
    after = {"daphne": rss_kb(daphne_pid), "door": sum(rss_kb(p) for p in workers)}
    growth = {name: after[name] - before[name] for name in before}
    return sent, status, body, {"largest_body_bytes": largest, **growth, "cut": cut,
                                "open_s": round(time.monotonic() - started, 1)}


def test_an_endless_anonymous_upload_is_refused_at_once_and_stored_nowhere(web):
    """The issue's attack: a chunked upload without a key that never ends. The 401 comes at
    once; what the client keeps sending is dropped (never spooled), and the connection is
    closed within the door's lingering time; memory and disk stay flat."""
    sent, status, body, seen = endless_chunked(web, {}, seconds=proxy.LINGERING_S * 4)
    assert (status, error_code(body)) == (401, "invalid_api_key")
    assert seen["cut"], seen  # the door closed it; the client never stopped
    assert seen["largest_body_bytes"] == 0
    assert seen["daphne"] < 10_000 and seen["door"] < 10_000, seen  # kB: no body held
    assert sent > 0
    print(f"anonymous endless upload: {sent / 1e6:.1f} MB sent before the close; {seen}")


def test_an_endless_upload_with_a_key_is_cut_at_the_limit(web):
    """With a good key the body is read, up to the limit: then the door refuses it and
    closes; the spooled part is never more than the limit, and is removed."""
    rows = history_count(web)
    sent, status, body, seen = endless_chunked(
        web, {"Authorization": f"Bearer {web.keys['owner']}"}, seconds=proxy.LINGERING_S * 4)
    assert (status, error_code(body)) == (400, "request_too_large")
    assert seen["cut"], seen
    assert seen["largest_body_bytes"] <= LIMIT
    assert bytes_under(body_dir(web)) == 0
    assert history_count(web) == rows  # daphne never saw it
    print(f"keyed endless upload: {sent / 1e6:.1f} MB sent before the close; {seen}")


# -- slow clients -----------------------------------------------------------------------------


def test_a_slowloris_head_is_closed_at_the_head_deadline(web):
    """One header line a second, forever: the door closes the connection at its head
    deadline, long before the client would have finished (GUARD_S lines)."""
    with connect(web) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        sock.settimeout(1.0)
        for line in range(GUARD_S):
            try:
                sock.sendall(f"X-Slow-{line}: a\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                break
            try:
                if sock.recv(65536) == b"":
                    break
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
        else:
            pytest.fail(f"the head was still being read after {GUARD_S} lines")
    assert line < GUARD_S // 2


def test_a_body_that_stops_arriving_is_cut(web):
    with connect(web) as sock:
        sock.sendall(head("/v1/completions", {"Content-Type": "application/json",
                                              "Content-Length": "1000",
                                              "Authorization": f"Bearer {web.keys['owner']}"}))
        sock.sendall(b'{"model": "x", ')
        sock.settimeout(GUARD_S)
        try:
            status, _, body = read_reply(sock)
            assert (status, error_code(body)) == (408, "request_timeout")
        except ConnectionError:
            pass  # closed without a word is a cut too
        assert closed(sock)


def test_an_idle_keep_alive_connection_is_closed(web):
    with connect(web) as sock:
        sock.sendall(head("/v1/health", {}, method="GET"))
        sock.settimeout(GUARD_S)
        status, _, _ = read_reply(sock)
        assert status == 200
        assert closed(sock)  # waits: the door closes it after PROXY_KEEPALIVE_S


# -- requests per address ---------------------------------------------------------------------


def stalled_request(web: WebServer, source: str) -> socket.socket:
    """A request in progress that stays so (a body that has not all arrived)."""
    sock = connect(web, source)
    sock.sendall(head("/v1/completions", {"Content-Type": "application/json",
                                          "Content-Length": "1000",
                                          "Authorization": f"Bearer {web.keys['owner']}"}))
    sock.sendall(b"{")
    return sock


def test_one_address_has_a_bounded_number_of_requests_in_progress(web):
    held = [stalled_request(web, "127.0.0.2") for _ in range(PER_ADDRESS)]
    try:
        time.sleep(0.3)  # the door has read their heads
        with connect(web, "127.0.0.2") as sock:
            sock.sendall(head("/v1/models", {"Authorization": f"Bearer {web.keys['owner']}"},
                              method="GET"))
            status, headers, body = read_reply(sock)
        assert (status, error_code(body)) == (429, "too_many_connections")
        assert headers.get("retry-after") == "1"
        with connect(web, "127.0.0.3") as sock:  # another address is served
            sock.sendall(head("/v1/models", {"Authorization": f"Bearer {web.keys['owner']}"},
                              method="GET"))
            status, _, _ = read_reply(sock)
        assert status == 200
    finally:
        for sock in held:
            sock.close()


# -- what daphne hears ------------------------------------------------------------------------


def test_a_client_cannot_reach_internal_paths(web):
    reply = web.request("GET", "/v1/internal/key-check", key=web.keys["owner"])
    assert (reply.status, reply.json()["error"]["code"]) == (404, "not_found")


def key_checks_seen(web: WebServer) -> int:
    """Key checks daphne has answered (its access log)."""
    return (web.tmp / "daphne.log").read_text(errors="replace").count("/v1/internal/key-check")


def wrong_key_request(web: WebServer, source: str, key: str, claimed: str) -> tuple:
    """(status, error code, Retry-After) of a POST with ``key`` claiming X-Forwarded-For."""
    with connect(web, source) as sock:
        sock.sendall(head("/v1/completions", {
            "Content-Type": "application/json", "Content-Length": "2",
            "Authorization": f"Bearer {key}", "X-Forwarded-For": claimed}) + b"{}")
        status, headers, body = read_reply(sock)
    return status, error_code(body), headers.get("retry-after", "")


def models_status(web: WebServer, source: str, key: str) -> int:
    with connect(web, source) as sock:
        sock.sendall(head("/v1/models", {"Authorization": f"Bearer {key}"}, method="GET"))
        return read_reply(sock)[0]


def test_a_wrong_key_flood_is_throttled_at_the_door_by_the_real_address(web):
    """Random well-formed keys from one address, each claiming another X-Forwarded-For:
    past AUTH_FAILURES_PER_MINUTE the address gets 429 ``auth_throttled`` (Retry-After),
    each answered by the web, so a good key in use from that address (another client
    behind the same NAT) is still served; once the address has been refused as many times
    again (a flood), the door answers it alone without asking daphne, for every key from
    it, while another address is served."""
    owner = web.keys["owner"]
    assert models_status(web, "127.0.0.6", owner) == 200  # in use: this process knows it
    statuses = []
    for i in range(FAILURES + FAILURES - 1):
        status, code, retry_after = wrong_key_request(
            web, "127.0.0.5", f"sk-{i:010d}.{'x' * 43}", f"10.0.0.{i % 250}")
        statuses.append((status, code))
        if status == 429:
            assert retry_after.isdigit()
    assert statuses[:FAILURES] == [(401, "invalid_api_key")] * FAILURES
    assert set(statuses[FAILURES:]) == {(429, "auth_throttled")}
    assert models_status(web, "127.0.0.5", owner) == 200  # not a flood yet
    for i in range(3):  # the flood goes on: refused by the web, then by the door alone
        assert wrong_key_request(web, "127.0.0.5", f"sk-{i:010d}.{'y' * 43}", "10.0.0.1")[
            :2] == (429, "auth_throttled")
    asked = key_checks_seen(web)
    for i in range(10):
        assert wrong_key_request(web, "127.0.0.5", f"sk-{i:010d}.{'z' * 43}", "10.0.0.2")[
            :2] == (429, "auth_throttled")
    assert models_status(web, "127.0.0.5", owner) == 429  # every key from it, while it floods
    assert key_checks_seen(web) == asked  # the door answered these alone
    assert models_status(web, "127.0.0.6", owner) == 200


def test_daphne_is_reached_only_through_the_door(web):
    """daphne listens on a unix socket only this user can open; no TCP port of its own."""
    assert web.socket.is_socket()
    assert (web.socket.stat().st_mode & 0o777) == 0o600
    assert f"unix:{web.socket}" in proxy.render(web.door_config)


def test_a_dead_daphne_is_a_503_in_the_api_shape(tmp_path):
    """A door whose daphne is not there answers 503 ``service_unavailable`` as JSON."""
    port = free_port()
    cfg = proxy.ProxyConfig.from_env(f"127.0.0.1:{port}", f"unix:{tmp_path / 'gone.sock'}",
                                     tmp_path, {})
    proxy.write(cfg)
    door = subprocess.Popen(proxy.nginx_argv(cfg), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        def reply() -> tuple[int, dict[str, str], bytes] | None:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=GUARD_S) as sock:
                    sock.sendall(head("/v1/health", {}, method="GET"))
                    return read_reply(sock)
            except OSError:
                return None
        status, headers, body = wait_until(reply)
        assert (status, error_code(body)) == (503, "service_unavailable")
        assert headers["content-type"] == "application/json"
    finally:
        door.terminate()
        door.wait(GUARD_S)


def test_the_configuration_is_one_nginx_accepts(tmp_path):
    cfg = proxy.ProxyConfig.from_env("127.0.0.1:1", "unix:/tmp/x.sock", tmp_path, {})
    proxy.write(cfg)
    done = subprocess.run([*proxy.nginx_argv(cfg)[:-2], "-t"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_settings_and_the_door_share_the_body_limit():
    from django.conf import settings as django_settings
    assert os.environ.get("DATA_UPLOAD_MAX_MEMORY_SIZE") or \
        django_settings.DATA_UPLOAD_MAX_MEMORY_SIZE == proxy.DATA_UPLOAD_MAX_MEMORY_SIZE


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/requests", "/v1/models"])
def test_every_keyed_path_goes_through_the_key_check(web, path):
    reply = web.request("GET" if path != "/v1/completions" else "POST", path, body=b"{}",
                        key="sk-abcdefgh.wrongwrongwrong")
    assert (reply.status, reply.json()["error"]["code"]) == (401, "invalid_api_key")


@pytest.mark.parametrize(("path", "shape"), [
    ("/v1/requests/%00", "openai"), ("/v1/models/a%00b", "openai"), ("/%00", "openai"),
    ("/v1/responses/resp_%00", "openai"), ("/v1/messages%00", "anthropic"),
    ("/v1/messages/%00/x", "anthropic")])
def test_a_path_nginx_cannot_parse_is_a_400_in_the_endpoints_shape(web, path, shape):
    """A %00 leaves nginx's request without a URI: its refusal still reaches a location of
    its own (a named one could not be reached: nginx answered 500)."""
    sock = connect(web)
    sock.sendall(head(path, {"Authorization": f"Bearer {web.keys['owner']}",
                             "Content-Length": "0"}, "GET"))
    status, _, body = read_reply(sock)
    assert status == 400, body
    reply = json.loads(body)
    if shape == "anthropic":
        assert (reply["type"], reply["error"]["type"]) == ("error", "invalid_request_error")
    else:
        assert reply["error"]["code"] == "invalid_request_error"


def test_a_client_cannot_reach_the_refusal_locations(web):
    reply = web.request("GET", f"{proxy.REFUSAL_PREFIX}too_large")
    assert reply.status == 404


def test_anonymous_paths_stay_open(web):
    assert web.request("GET", "/v1/health").status == 200
    assert web.request("GET", "/v1/openapi.json").status == 200


def test_forwarded_headers_are_believed_only_from_trusted_addresses(tmp_path):
    """Without PROXY_TRUSTED_ADDRESSES the client's address and scheme are nginx's own view;
    with it, X-Forwarded-For and X-Forwarded-Proto are taken from those addresses only."""
    plain = proxy.render(proxy.ProxyConfig.from_env("127.0.0.1:1", "unix:/x", tmp_path, {}))
    assert "set_real_ip_from" not in plain and "default 0;\n    }" in plain
    trusted = proxy.render(proxy.ProxyConfig.from_env(
        "127.0.0.1:1", "unix:/x", tmp_path, {"PROXY_TRUSTED_ADDRESSES": "10.0.0.0/8"}))
    assert "set_real_ip_from 10.0.0.0/8;" in trusted and "        10.0.0.0/8 1;" in trusted
    assert "X-Forwarded-Proto $forwarded_proto" in trusted


def test_a_method_nginx_refuses_is_answered_in_the_api_shape(web):
    """TRACE is refused by nginx itself (405): in the API's error shape, not nginx's HTML."""
    for path in ("/v1/models", "/v1/health"):
        with connect(web) as sock:
            sock.sendall(head(path, {"Authorization": f"Bearer {web.keys['owner']}"},
                              method="TRACE"))
            status, _, body = read_reply(sock)
        assert (status, error_code(body)) == (405, "method_not_allowed")


# -- requests a second ------------------------------------------------------------------------

RATE = 2  # PROXY_REQUESTS_PER_S of the rated server
BURST = 4  # PROXY_REQUEST_BURST
AT_ONCE = 24  # requests sent together, each from its own address (under the connection cap)


@pytest.fixture(scope="module")
def rated() -> Iterator[WebServer]:
    """A server whose door lets RATE requests a second per key through, past a BURST."""
    server = WebServer()
    server.env.update({"PROXY_REQUESTS_PER_S": str(RATE), "PROXY_REQUEST_BURST": str(BURST)})
    server.start()
    yield server
    server.stop()


def burst(web: WebServer, path: str, headers: dict[str, str],
          source: str | None = None) -> list[tuple[int, str, str]]:
    """AT_ONCE requests sent together, each on its own connection (from its own address, or
    all from ``source``): (status, error code or "", Retry-After) of each."""
    socks = [connect(web, source or f"127.0.1.{i + 1}") for i in range(AT_ONCE)]
    try:
        for sock in socks:
            sock.sendall(head(path, headers, method="GET"))
        out = []
        for sock in socks:
            status, reply_headers, body = read_reply(sock)
            out.append((status, error_code(body) if status >= 400 else "",
                        reply_headers.get("retry-after", "")))
        return out
    finally:
        for sock in socks:
            sock.close()


def test_one_key_past_its_rate_is_refused_at_the_door_and_another_key_is_served(rated):
    """A key's burst past PROXY_REQUESTS_PER_S + PROXY_REQUEST_BURST is refused by nginx
    (429 ``requests_per_second_exceeded``, Retry-After), whichever address sends it and
    however the key is spelled; daphne never hears of the refused ones; another tenant's
    key is served at the same moment."""
    key = rated.keys["member"]
    checks = key_checks_seen(rated)
    spellings = [f"Bearer {key}", f"bearer   {key}  ", f"BEARER {key}"]
    replies = []
    for spelling in spellings:
        replies += burst(rated, "/v1/models", {"Authorization": spelling})
    served = [r for r in replies if r[0] == 200]
    refused = [r for r in replies if r[0] == 429]
    assert len(served) + len(refused) == len(replies)
    assert len(served) <= len(spellings) * (BURST + 1 + RATE), replies  # a burst's share each
    assert refused and {code for _, code, _ in refused} == {"requests_per_second_exceeded"}
    assert {after for _, _, after in refused} == {"1"}
    assert key_checks_seen(rated) - checks == len(served)  # the refused never reached daphne
    time.sleep(1)
    other = burst(rated, "/v1/models", {"Authorization": f"Bearer {rated.keys['outsider']}"})
    assert sum(status == 200 for status, _, _ in other) >= BURST + 1


def test_the_anonymous_api_has_a_rate_per_address(rated):
    spread = burst(rated, "/v1/health", {})  # each from its own address: all served
    assert {status for status, _, _ in spread} == {200}
    one = burst(rated, "/v1/health", {}, source="127.0.2.1")
    assert {(status, code) for status, code, _ in one} == {
        (200, ""), (429, "requests_per_second_exceeded")}
    assert sum(status == 200 for status, _, _ in one) <= BURST + 1 + RATE
