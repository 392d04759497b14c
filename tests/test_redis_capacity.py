"""The web's Redis connections (issue 12): an explicitly sized pool, readers that hold none
of it (one stream reader per process, issue 15), a 503 instead of a 500 when a process is
full or its pool is exhausted. In-process, real test Redis."""
from __future__ import annotations

import asyncio
import gc
import threading
import uuid

import pytest
import redis
from channels.testing import WebsocketCommunicator

from config.asgi import application
from inference import broker
from inference.errors import ApiError
from tests.live_service import StandIn, echo, wait_until
from wire import protocol

pytestmark = pytest.mark.asyncio
GUARD_S = 30  # hang guard


async def test_the_pool_is_sized_by_the_settings(settings):
    settings.WEB_REDIS_MAX_CONNECTIONS = 40
    client = broker.async_client()
    assert client.connection_pool.max_connections == 40


async def _read_all(request_ids: list[str], redis_client, block_ms: int) -> list[list]:
    readers = [asyncio.create_task(broker.read_events(r, "0-0", block_ms)) for r in request_ids]
    followed = {protocol.events_stream(r) for r in request_ids}
    async with asyncio.timeout(GUARD_S):  # all of them waiting
        while not followed <= broker.stream_reader().streams():
            await asyncio.sleep(0.01)
    assert await broker.stream_exists(request_ids[0]) is False  # a short command still runs
    for request_id in request_ids:
        redis_client.xadd(protocol.events_stream(request_id),
                          protocol.encode_event(protocol.TOKEN, {"text": "x", "n_tokens": 1}))
    try:
        return await asyncio.wait_for(asyncio.gather(*readers), GUARD_S)
    finally:
        redis_client.delete(*(protocol.events_stream(r) for r in request_ids))


async def test_130_readers_on_the_default_pool_all_get_their_events(redis_client):
    """Before: redis-py's pool of 100 raised MaxConnectionsError for the 101st reader (a 500)."""
    request_ids = [uuid.uuid4().hex for _ in range(130)]
    results = await _read_all(request_ids, redis_client, block_ms=GUARD_S * 1000)
    assert [len(events) for events in results] == [1] * 130


async def test_readers_hold_no_pooled_connection(settings, redis_client):
    """30 readers on a pool of 2: they follow through the process's one stream reader."""
    settings.WEB_REDIS_MAX_CONNECTIONS = 2
    request_ids = [uuid.uuid4().hex for _ in range(30)]
    results = await _read_all(request_ids, redis_client, block_ms=GUARD_S * 1000)
    assert [len(events) for events in results] == [1] * 30
    pool = broker.async_client().connection_pool
    assert len(pool._in_use_connections) + len(pool._available_connections) <= 2


async def test_an_empty_read_still_returns_after_its_block_time(settings):
    settings.WEB_REDIS_MAX_CONNECTIONS = 2
    results = await asyncio.wait_for(asyncio.gather(
        *(broker.read_events(uuid.uuid4().hex, "0-0", 200) for _ in range(5))), GUARD_S)
    assert results == [[]] * 5


async def test_an_exhausted_pool_is_a_503_not_a_500(settings):
    settings.WEB_REDIS_MAX_CONNECTIONS = 2
    settings.WEB_REDIS_POOL_TIMEOUT_S = 0.1
    pool = broker.async_client().connection_pool
    held = [await pool.get_connection() for _ in range(2)]
    try:
        with pytest.raises(ApiError) as caught:
            await broker.stream_exists("x")
        assert caught.value.status == 503 and caught.value.code == "service_unavailable"
        assert caught.value.headers["Retry-After"] == "1"
        assert isinstance(caught.value, redis.ConnectionError)  # Redis-tolerant code copes
    finally:
        for connection in held:
            await pool.release(connection)
    assert await broker.stream_exists("x") is False


async def test_a_readers_place_is_given_back_once_and_when_dropped(settings):
    """A place goes back once however often it is released, and a place nobody released
    (a reply nobody iterated) goes back when it is collected; the process's count and the
    tenant's follow."""
    settings.WEB_MAX_STREAMS = 2
    settings.WEB_TENANT_STREAMS = 2
    place = broker.take_place("t", "r1")
    other = broker.take_place("t", "r2")
    assert (broker.open_readers(), broker.open_readers("t")) == (2, 2)
    with pytest.raises(ApiError) as caught:
        broker.take_place("u", "r3")
    assert (caught.value.status, caught.value.code) == (503, "service_unavailable")
    place.release()
    place.release()
    assert (broker.open_readers(), broker.open_readers("t")) == (1, 1)
    del other
    gc.collect()
    assert (broker.open_readers(), broker.open_readers("t")) == (0, 0)


def hold(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=GUARD_S)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


@pytest.mark.django_db(transaction=True)
async def test_a_full_process_answers_503_service_unavailable(parties, standin, settings):
    settings.WEB_MAX_STREAMS = 2
    settings.WEB_TENANT_STREAMS = 10  # past the process: its refusal is the 503
    release = threading.Event()
    for _ in range(2):
        standin.serve(lambda d, j: hold(d, j, release))
    ws = WebsocketCommunicator(application, "/ws/v1/stream",
                               headers=[(b"authorization", f"Bearer {parties.owner}".encode())])
    await ws.connect()
    try:
        for client_id in (1, 2):
            await ws.send_json_to({"type": "completions", "id": client_id,
                                   "model": standin.model, "prompt": "Hi"})
            accepted = await ws.receive_json_from(timeout=GUARD_S)
            assert accepted["type"] == "accepted", accepted
        for _ in range(GUARD_S * 10):  # both are following their streams
            if broker.open_readers() >= 2:
                break
            await asyncio.sleep(0.1)
        await ws.send_json_to({"type": "completions", "id": 3, "model": standin.model,
                               "prompt": "Hi"})
        refused = await ws.receive_json_from(timeout=GUARD_S)
        assert (refused["id"], refused["type"], refused["status"]) == (3, "error", 503)
        assert refused["error"]["code"] == "service_unavailable"
    finally:
        release.set()
    await ws.disconnect()


@pytest.mark.django_db(transaction=True)
async def test_130_resumes_of_one_tenant_leave_the_other_tenant_served(parties, standin,
                                                                       settings):
    """The issue's attack: tenant A (no max_concurrent) opens 130 resumes of a request it
    keeps running, over 5 sockets; tenant B's request meanwhile is served. Before, the
    101st Redis connection raised MaxConnectionsError: B got 500 internal_error. (The
    tenant's share of the process and a request's readers are lifted here: what is
    tested is the Redis connections; tests/test_stream_shares.py has the shares.)"""
    settings.WEB_TENANT_STREAMS = 200
    settings.WEB_READERS_PER_REQUEST = 200
    release = threading.Event()
    standin.serve(lambda d, j: hold(d, j, release))
    owner = [(b"authorization", f"Bearer {parties.owner}".encode())]
    sockets = [WebsocketCommunicator(application, "/ws/v1/stream", headers=owner)
               for _ in range(5)]
    for ws in sockets:
        await ws.connect()
    try:
        await sockets[0].send_json_to({"type": "completions", "id": "held",
                                       "model": standin.model, "prompt": "Hi"})
        accepted = await sockets[0].receive_json_from(timeout=GUARD_S)
        request_id = accepted["request_id"]
        for n in range(130):
            await sockets[n % 5].send_json_to({"type": "resume", "id": f"r{n}",
                                               "request_id": request_id})
        for i, ws in enumerate(sockets):  # every resume is reading: its first event came
            waiting = {f"r{n}" for n in range(i, 130, 5)}
            while waiting:
                message = await ws.receive_json_from(timeout=GUARD_S)
                if message["id"] in waiting:
                    assert message["type"] == "accepted", message
                    waiting.discard(message["id"])
        assert broker.open_readers() >= 131
        other = WebsocketCommunicator(
            application, "/ws/v1/stream",
            headers=[(b"authorization", f"Bearer {parties.outsider}".encode())])
        await other.connect()
        standin.serve(echo)
        await other.send_json_to({"type": "completions", "id": "b", "model": standin.model,
                                  "prompt": "Hi"})
        seen = []
        while not seen or seen[-1]["type"] not in ("done", "error"):
            seen.append(await other.receive_json_from(timeout=GUARD_S))
        assert seen[-1]["type"] == "done", seen[-1]
        await other.disconnect()
    finally:
        release.set()
    for ws in sockets:
        await ws.disconnect()
