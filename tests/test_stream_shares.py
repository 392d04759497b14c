"""A web process's readers shared between tenants (issue 32), over a real daphne with a
stand-in daemon: a tenant past its share of the process's readers (WEB_TENANT_STREAMS) gets
429 ``too_many_streams`` while another tenant is served; the process's cap
(WEB_MAX_STREAMS) is exact under a flood of concurrent resumes; one request has at most
WEB_READERS_PER_REQUEST readers; replays of a finished request count against the tenant's
replay rate (REPLAYS_PER_MINUTE) and its requests per minute, and a refused replay is
remembered by the web process until its Retry-After: the tenant's next replays are refused
without Redis (its MONITOR sees no command about them), unless the limit that refused them
is raised. Small caps keep it cheap."""
from __future__ import annotations

import asyncio
import gc
import json
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import websockets
from django.utils import timezone

from inference import api_views, broker, consumers, idempotency, service, watch
from tests.live_service import (
    TEST_REDIS_URL,
    Reply,
    StandIn,
    WebServer,
    echo,
    redis_conn,
    wait_until,
)
from tests.test_limits_http import assert_429, chat, make_tenant, set_limits, shell
from wire import limits as wire_limits
from wire import protocol

pytestmark = pytest.mark.database  # live servers of this module's own
GUARD_S = 30  # hang guard
TENANT_STREAMS = 4  # the shares server's WEB_TENANT_STREAMS (its WEB_MAX_STREAMS: 16)
REPLAYS = 3  # the shares server's REPLAYS_PER_MINUTE
MAX_STREAMS = 8  # the cap server's WEB_MAX_STREAMS (one tenant may take all of it)
PER_REQUEST = 4  # the cap server's WEB_READERS_PER_REQUEST


def _server(**env: int) -> Iterator[WebServer]:
    server = WebServer()
    server.env.update({name: str(value) for name, value in env.items()})
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shares_web() -> Iterator[WebServer]:
    yield from _server(WEB_MAX_STREAMS=16, WEB_TENANT_STREAMS=TENANT_STREAMS,
                       WEB_READERS_PER_REQUEST=100, REPLAYS_PER_MINUTE=REPLAYS)


@pytest.fixture(scope="module")
def cap_web() -> Iterator[WebServer]:
    yield from _server(WEB_MAX_STREAMS=MAX_STREAMS, WEB_TENANT_STREAMS=100,
                       WEB_READERS_PER_REQUEST=PER_REQUEST)


def hold(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    daemon.emit(job.id, protocol.TOKEN, {"text": "x", "n_tokens": 1})
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=GUARD_S)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


def held_stream(web: WebServer, standin: StandIn, key: str,
                release: threading.Event) -> tuple[Reply, str]:
    """A streamed chat the stand-in keeps running until ``release``: (reply, its events path)."""
    standin.serve(lambda d, j: hold(d, j, release))
    reply = chat(web, standin, key, stream=True)
    assert reply.status == 200
    return reply, f"/v1/requests/{reply.header('X-Request-Id')}/events"


def at_once(calls: list[Callable[[], Reply]]) -> list[Reply]:
    """Every call on a thread of its own, released together."""
    start = threading.Barrier(len(calls))

    def run(call: Callable[[], Reply]) -> Reply:
        start.wait(GUARD_S)
        return call()

    with ThreadPoolExecutor(len(calls)) as pool:
        return list(pool.map(run, calls))


def resumer(web: WebServer, path: str, key: str) -> Callable[[], Reply]:
    return lambda: web.request("GET", path, key=key, timeout=GUARD_S)


def read_to_end(replies: list[Reply]) -> None:
    for reply in replies:
        assert [data for _id, data in reply.sse()][-1] == "[DONE]"


def error_of(reply: Reply) -> tuple[int, str]:
    return reply.status, reply.json()["error"]["code"]


def finish_row(web: WebServer, request_id: str) -> None:
    """Close the request's history row as its daemon would (the stand-in writes none)."""
    shell(web, "from django.utils import timezone; from inference.models import "
               f"InferenceRequest; InferenceRequest.objects.filter(id='{request_id}')"
               ".update(status='done', finished=timezone.now())")


async def ws_resume(web: WebServer, key: str, request_id: str) -> dict:
    """A websocket resume's first message for it (``accepted``, or the refusal)."""
    async with websockets.connect(web.ws_url, additional_headers={
            "Authorization": f"Bearer {key}"}) as ws:
        await ws.send(json.dumps({"type": "resume", "id": 1, "request_id": request_id}))
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), GUARD_S))
            if message.get("id") == 1:
                return message


def test_a_tenant_past_its_share_gets_429_and_the_others_are_served(shares_web, standin):
    """The issue's attack, small: tenant A floods resumes of its own running stream, more
    than the whole process holds. A gets its share (its stream and three resumes) and 429
    too_many_streams past it, SSE and websocket alike; tenant B's streamed and whole
    requests are served meanwhile (never a 503)."""
    web, a, b = shares_web, shares_web.keys["owner"], shares_web.keys["outsider"]
    release = threading.Event()
    held, path = held_stream(web, standin, a, release)
    try:
        replies = at_once([resumer(web, path, a) for _ in range(20)])
        admitted = [r for r in replies if r.status == 200]
        standin.serve(echo, jobs=2)
        whole = chat(web, standin, b)
        assert whole.status == 200, whole.json()
        assert whole.json()["choices"][0]["message"]["content"] == "Hello world"
        streamed = chat(web, standin, b, stream=True)
        assert streamed.status == 200, streamed.json()
        read_to_end([streamed])
        assert len(admitted) == TENANT_STREAMS - 1  # its stream holds a place too
        for reply in replies:
            if reply.status != 200:
                assert_429(reply, "too_many_streams")
        refusal = asyncio.run(ws_resume(web, a, held.header("X-Request-Id")))
        assert (refusal["type"], refusal["status"], refusal["error"]["code"]) == (
            "error", 429, "too_many_streams"), refusal
    finally:
        release.set()
    read_to_end([held, *admitted])


def test_the_process_cap_is_exact_under_concurrent_resumes(cap_web, standin):
    """Three running streams hold three of the process's eight places; thirty resumes of
    them at once: exactly five are admitted (all open together), the others are refused
    (429 past a request's readers, 503 service_unavailable once the process is full)."""
    web, key = cap_web, cap_web.keys["owner"]
    release = threading.Event()
    held = [held_stream(web, standin, key, release) for _ in range(3)]
    try:
        replies = at_once([resumer(web, path, key) for _ in range(10) for _r, path in held])
        admitted = [r for r in replies if r.status == 200]
        refusals = [error_of(r) for r in replies if r.status != 200]
        assert len(admitted) == MAX_STREAMS - len(held), (len(admitted), refusals)
        assert set(refusals) <= {(429, "too_many_streams"), (503, "service_unavailable")}
        assert (503, "service_unavailable") in refusals
    finally:
        release.set()
    read_to_end([reply for reply, _path in held] + admitted)


def test_one_request_has_at_most_its_readers(cap_web, standin):
    """A running stream and three resumes of it are its four readers: a fifth is 429
    too_many_streams, while another request of the same tenant is still followed."""
    web, key = cap_web, cap_web.keys["member"]
    release = threading.Event()
    first, path = held_stream(web, standin, key, release)
    second, other_path = held_stream(web, standin, key, release)
    try:
        resumes = [web.request("GET", path, key=key, timeout=GUARD_S)
                   for _ in range(PER_REQUEST - 1)]
        assert [r.status for r in resumes] == [200] * (PER_REQUEST - 1)
        refused = web.request("GET", path, key=key, timeout=GUARD_S)
        assert_429(refused, "too_many_streams")
        other = web.request("GET", other_path, key=key, timeout=GUARD_S)
        assert other.status == 200
    finally:
        release.set()
    read_to_end([first, second, *resumes, other])


def finished_request(web: WebServer, standin: StandIn, key: str) -> str:
    """A chat answered and closed: its events path (a resume of it is a replay)."""
    standin.serve(echo)
    reply = chat(web, standin, key)
    assert reply.status == 200
    reply.json()
    request_id = reply.header("X-Request-Id")
    finish_row(web, request_id)
    return f"/v1/requests/{request_id}/events"


def test_replays_past_the_tenants_replay_rate_are_429(shares_web, standin):
    web = shares_web
    _, key = make_tenant(web)
    path = finished_request(web, standin, key)
    for _ in range(REPLAYS):
        replay = web.request("GET", path, key=key, timeout=GUARD_S)
        assert replay.status == 200
        read_to_end([replay])
    assert_429(web.request("GET", path, key=key, timeout=GUARD_S), "replays_exceeded")


def test_replays_count_against_the_tenants_requests_per_minute(shares_web, standin):
    """requests_per_minute 3: the chat and two replays of it take all three; the next
    replay and the next chat are refused alike."""
    web = shares_web
    _, key = make_tenant(web, requests_per_minute=3)
    path = finished_request(web, standin, key)
    for _ in range(2):
        replay = web.request("GET", path, key=key, timeout=GUARD_S)
        assert replay.status == 200
        read_to_end([replay])
    assert_429(web.request("GET", path, key=key, timeout=GUARD_S), "rpm_exceeded")
    assert_429(chat(web, standin, key), "rpm_exceeded")


@contextmanager
def redis_commands_naming(text: str) -> Iterator[list[str]]:
    """The commands Redis runs on the test database while inside (its MONITOR, every
    client's, scripts' own commands included) that name ``text``."""
    url = redis_conn().connection_pool.connection_kwargs
    db, seen, end = url.get("db", 0), [], f"end-{uuid.uuid4().hex}"
    sock = socket.create_connection((url.get("host", "127.0.0.1"), url.get("port", 6379)),
                                    timeout=GUARD_S)
    sock.sendall(b"MONITOR\r\n")
    started, ended = threading.Event(), threading.Event()

    def read() -> None:
        buffer = b""
        while not ended.is_set():
            chunk = sock.recv(65536)
            if not chunk:
                return
            *lines, buffer = (buffer + chunk).split(b"\r\n")
            for line in lines:
                started.set()  # +OK: monitoring from here
                command = line.decode("utf-8", "replace")
                if end in command:
                    ended.set()
                elif f"[{db} " in command and text in command:
                    seen.append(command)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(GUARD_S), f"no MONITOR on {TEST_REDIS_URL}"
    try:
        yield seen
    finally:
        redis_conn().echo(end)  # after every command of the block: all of them are read
        assert ended.wait(GUARD_S), "MONITOR did not see the block end"
        sock.close()
        reader.join(GUARD_S)


def replay(web: WebServer, path: str, key: str) -> Reply:
    return web.request("GET", path, key=key, timeout=GUARD_S)


def test_a_refused_replay_is_remembered_until_its_retry_after(shares_web, standin):
    """Past its replay rate, a tenant's replay is refused by the script (Redis runs it); its
    next replays are refused alike by the web process alone until the Retry-After the script
    gave (no Redis command names the tenant's replay window), each Retry-After what is left
    of the first; the refusals so made are counted in Redis by the tenant's next script."""
    web = shares_web
    tenant_id, key = make_tenant(web)
    window = wire_limits.replays_key(str(tenant_id))
    path = finished_request(web, standin, key)
    for _ in range(REPLAYS):
        admitted = replay(web, path, key)
        assert admitted.status == 200
        read_to_end([admitted])
    with redis_commands_naming(window) as seen:
        first = replay(web, path, key)
    assert_429(first, "replays_exceeded")
    assert seen, "the first refusal is the script's"
    with redis_commands_naming(window) as seen:
        later = [replay(web, path, key) for _ in range(3)]
    for reply in later:
        assert_429(reply, "replays_exceeded")
        assert int(reply.header("Retry-After")) <= int(first.header("Retry-After"))
    assert seen == []
    counted = wire_limits.refusal_counts(redis_conn(), str(tenant_id))
    assert counted.get(wire_limits.REPLAYS_EXCEEDED) == 1  # the others: with the next script


def test_a_raised_requests_per_minute_lets_the_next_replay_in(shares_web, standin):
    """A replay refused for the tenant's requests per minute is remembered only under that
    limit: raised, the tenant's next replay is admitted (within the second a key's limits
    are cached), not refused until the old Retry-After."""
    web = shares_web
    tenant_id, key = make_tenant(web, requests_per_minute=2)
    path = finished_request(web, standin, key)
    admitted = replay(web, path, key)
    assert admitted.status == 200
    read_to_end([admitted])
    refused = replay(web, path, key)
    assert_429(refused, "rpm_exceeded")
    assert int(refused.header("Retry-After")) > 5
    set_limits(web, tenant_id, requests_per_minute=100)
    again = wait_until(lambda: (r := replay(web, path, key)).status == 200 and r, timeout_s=10,
                       step_s=0.3)
    read_to_end([again])


# -- a reader's place, in process (no server) ---------------------------------------------


@pytest.fixture
def no_gc() -> Iterator[None]:
    """No cyclic GC inside: a place given back is given back by the code, not its finalizer."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.fixture
def guard_never_enters(monkeypatch) -> asyncio.Event:
    """Every ``CancelIfAbandoned`` waits for ever in its entry (as on its Redis write);
    the event is set once one has begun to."""
    entered = asyncio.Event()

    async def enter(self: watch.Watching) -> watch.Watching:
        entered.set()
        await asyncio.Event().wait()
        return self

    monkeypatch.setattr(watch.Watching, "__aenter__", enter)
    return entered


async def cancel_once_in(task: asyncio.Task, entered: asyncio.Event) -> None:
    await asyncio.wait_for(entered.wait(), GUARD_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_a_collected_reply_cancelled_before_its_first_read_gives_its_place_back(
        no_gc, guard_never_enters):
    """A whole reply cancelled while its guard enters (its events not started yet): the
    place goes back as the task ends, not when (if ever) the place is collected."""
    tenant, request_id = f"t-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    accepted = broker.StreamEvent("1-0", protocol.ACCEPTED, {"daemon_id": "d"})
    submission = service.Submission(request_id, "completion", "m", 0, accepted,
                                    broker.take_place(tenant, request_id))
    task = asyncio.create_task(service.collect(submission))
    await cancel_once_in(task, guard_never_enters)
    assert broker.open_readers(tenant) == 0


@pytest.mark.asyncio
async def test_a_websocket_resume_cancelled_before_its_first_read_gives_its_place_back(
        no_gc, guard_never_enters, monkeypatch):
    """A websocket resume cancelled while its guard enters: its place and its slot go back
    as the task ends."""
    tenant, request_id = f"t-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    row = SimpleNamespace(id=request_id, finished=None, model="m", created=timezone.now())
    freed: list[tuple[str, str]] = []

    async def owned_row(_tenant: object, _request_id: str) -> SimpleNamespace:
        return row

    async def stream_exists(_request_id: str) -> bool:
        return True

    async def take_resume_slot(_api_key: object, ttl_s: float) -> str:
        return "slot-1"

    async def free_slot_quietly(tenant_id: str, member: str) -> None:
        freed.append((tenant_id, member))

    monkeypatch.setattr(service, "owned_row", owned_row)
    monkeypatch.setattr(broker, "stream_exists", stream_exists)
    monkeypatch.setattr(service.limits, "take_resume_slot", take_resume_slot)
    monkeypatch.setattr(service.limits, "free_slot_quietly", free_slot_quietly)
    consumer = consumers.StreamConsumer()
    consumer.api_key = SimpleNamespace(tenant_id=tenant, tenant=None, read_only=False)
    task = asyncio.create_task(consumer._resume(1, consumers._Running(),
                                                {"request_id": request_id}))
    await asyncio.wait_for(guard_never_enters.wait(), GUARD_S)
    assert broker.open_readers(tenant) == 1
    await cancel_once_in(task, guard_never_enters)
    assert broker.open_readers(tenant) == 0
    assert freed == [(tenant, "slot-1")]


@pytest.mark.asyncio
async def test_a_place_collected_off_the_loop_is_given_back_on_it():
    """Cyclic GC may collect a place nobody released on any thread (the web's database
    thread): its finalizer does not touch the loop's counts there (a read-modify-write
    racing ``take_place``); the loop gives the place back when it next counts."""
    tenant = f"t-{uuid.uuid4().hex[:8]}"
    cycle: list[object] = [broker.take_place(tenant, str(uuid.uuid4()))]
    cycle.append(cycle)
    state = broker._state()
    del cycle
    collector = threading.Thread(target=gc.collect)
    collector.start()
    collector.join(GUARD_S)
    assert state.tenant_readers.get(tenant) == 1  # not changed off the loop
    assert broker.open_readers(tenant) == 0


def placed_submission() -> tuple[str, service.Submission]:
    """A tenant and a submission holding a reader place of its (no server: first event only)."""
    tenant, request_id = f"t-{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
    accepted = broker.StreamEvent("1-0", protocol.ACCEPTED, {"daemon_id": "d"})
    return tenant, service.Submission(request_id, "completion", "m", 0, accepted,
                                      broker.take_place(tenant, request_id))


@pytest.mark.asyncio
async def test_an_sse_stream_cancelled_before_its_first_read_gives_its_place_back(
        no_gc, guard_never_enters):
    """The SSE body cancelled while its guard enters (the events not started): the place
    goes back as the task ends."""
    tenant, submission = placed_submission()
    formatter = SimpleNamespace(request_id=submission.request_id, chunks=lambda event: [])
    body = api_views._sse(formatter, service.events(submission))
    task = asyncio.create_task(anext(body))
    await cancel_once_in(task, guard_never_enters)
    assert broker.open_readers(tenant) == 0


@pytest.mark.asyncio
async def test_an_idempotent_retry_cancelled_before_its_first_read_gives_its_place_back(
        no_gc, guard_never_enters):
    """A retry's replay of the original request (idempotency.Replay) cancelled while the
    guard enters: closing its events closes the stream they wrap, started or not."""
    tenant, submission = placed_submission()
    replay = idempotency.Replay(submission.request_id, "completion", "m", 0, submission.first,
                                service.events(submission))
    task = asyncio.create_task(replay.collect())
    await cancel_once_in(task, guard_never_enters)
    assert broker.open_readers(tenant) == 0
