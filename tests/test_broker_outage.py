"""inference.broker across a Redis outage: a reader of a request's stream waits Redis out with
backoff, and past REDIS_OUTAGE_S ends with RedisDown (503 ``service_unavailable``, Retry-After).
Each test starts and stops a redis-server of its own (tests/live_service.RedisServer)."""

import asyncio
import threading
import uuid

import pytest

from inference import broker
from tests.live_service import RedisServer
from wire import protocol

pytestmark = pytest.mark.asyncio

OUTAGE_S = 1.5  # several failed tries of the reader


@pytest.fixture
def server(tmp_path, settings):
    server = RedisServer(tmp_path).start()
    settings.REDIS_URL = server.url
    yield server
    server.close()


async def test_a_reader_waits_out_a_redis_restart_and_gets_what_came_after(server):
    request_id = str(uuid.uuid4())
    server.stop()
    read = asyncio.ensure_future(broker.read_events(request_id, "0-0", 1000))
    await asyncio.sleep(OUTAGE_S)
    assert not read.done()  # waiting, not failed
    await asyncio.to_thread(server.start)
    server.client().xadd(protocol.events_stream(request_id),
                         protocol.encode_event(protocol.TOKEN, {"text": "hi", "n_tokens": 1}))
    events = await asyncio.wait_for(read, timeout=15)
    assert [(e.kind, e.data["text"]) for e in events] == [("token", "hi")]


async def test_a_reader_ends_typed_when_redis_stays_away(server, monkeypatch):
    monkeypatch.setattr(broker, "REDIS_OUTAGE_S", 1.0)
    server.stop()
    with pytest.raises(broker.RedisDown) as raised:
        await asyncio.wait_for(broker.read_events(str(uuid.uuid4()), "0-0", 1000), timeout=15)
    error = raised.value
    assert error.status == 503 and error.code == "service_unavailable"
    assert int(error.headers["Retry-After"]) > 0


async def test_a_follower_mid_stream_ends_typed_when_redis_goes_and_stays_away(server,
                                                                             monkeypatch):
    """Redis stops while a follower waits in the process's shared read (issue 15): its reads
    fail (a read that only timed out would look like Redis answering, and the follower
    would wait for ever)."""
    monkeypatch.setattr(broker, "REDIS_OUTAGE_S", 3.0)
    request_id = str(uuid.uuid4())
    server.client().xadd(protocol.events_stream(request_id),
                         protocol.encode_event(protocol.TOKEN, {"text": "hi", "n_tokens": 1}))

    async def follow() -> list[str]:
        texts, after = [], "0-0"
        with broker.reader(request_id) as follower:
            while True:
                for event in await broker.read_events(request_id, after, 300,
                                                      follower=follower):
                    after = event.entry_id
                    texts.append(event.data["text"])
                if texts:
                    await asyncio.to_thread(server.stop)  # after the first event: mid-stream

    with pytest.raises(broker.RedisDown):
        await asyncio.wait_for(follow(), timeout=30)


async def test_a_liveness_check_after_an_outage_waits_for_the_heartbeats_to_come_back(server):
    """The daemon's key expired while Redis was away; it is published again a moment after
    Redis answers: the daemon is alive, not interrupted."""
    daemon_id = f"d-{uuid.uuid4().hex[:6]}"
    server.stop()
    alive = asyncio.ensure_future(broker.daemon_alive(daemon_id))
    await asyncio.sleep(OUTAGE_S)
    assert not alive.done()
    await asyncio.to_thread(server.start)

    beating = threading.Event()

    def beat() -> None:
        # a late daemon: its first beat lands after the reader's first check (which comes
        # within the backoff's cap, 2 s, of Redis back) and within the heartbeat TTL
        if beating.wait(protocol.HEARTBEAT_TTL_S - protocol.HEARTBEAT_INTERVAL_S / 2):
            return
        while True:
            server.client().set(protocol.daemon_key(daemon_id), "{}",
                                px=int(protocol.HEARTBEAT_TTL_S * 1000))
            if beating.wait(protocol.HEARTBEAT_INTERVAL_S / 2):
                return

    threading.Thread(target=beat, daemon=True).start()
    try:
        assert await asyncio.wait_for(alive, timeout=20)
    finally:
        beating.set()
