"""One stream reader per web process (inference/stream_reader.py, issue 15), against a real
Redis: every event of every followed stream arrives in order and exactly once while streams
start and end at different times; a follower that leaves is dropped at once; a follower
joining a blocked read wakes it; the daemon's pipelined flush keeps each stream's order.
Nothing here asserts on time (waits have hang guards only)."""
from __future__ import annotations

import asyncio
import random
import threading
import uuid

import pytest

from inference import broker, stream_reader
from scheduler_daemon.core.state import TokenEvent
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.event_writer import EventWriter
from tests.live_service import redis_conn
from wire import protocol

pytestmark = pytest.mark.asyncio
GUARD_S = 60  # hang guard


@pytest.fixture
def r():
    client = redis_conn()
    made: list[str] = []
    yield client, made
    if made:
        client.delete(*made)


def token(i: int) -> dict[str, str]:
    return protocol.encode_event(protocol.TOKEN, {"text": f"t{i}", "n_tokens": 1})


def done() -> dict[str, str]:
    return protocol.encode_event(protocol.DONE, {"finish_reason": "stop"})


async def follow_to_end(request_id: str, after: str = "0-0") -> list[str]:
    """What ``service.follow`` does: read after the last id until the terminal event."""
    texts = []
    with broker.reader(request_id, after) as follower:
        while True:
            batch = await broker.read_events(request_id, after, 1000, follower=follower)
            for event in batch:
                after = event.entry_id
                if event.is_terminal:
                    return texts
                texts.append(event.data["text"])


async def test_100_interleaved_streams_each_get_every_event_once_in_order(r):
    client, made = r
    rng = random.Random(15)
    ids = [uuid.uuid4().hex for _ in range(100)]
    made += [protocol.events_stream(i) for i in ids]
    lengths = {i: rng.randint(1, 40) for i in ids}
    # a writer thread, as a daemon's flushes: pipelines of events for random live streams;
    # streams start at different times (some before their follower, some after) and end
    # at different times
    started = threading.Event()

    def write() -> None:
        pending = list(ids)
        sent = {i: 0 for i in ids}
        live: list[str] = []
        started.wait(GUARD_S)
        while pending or live:
            while pending and (not live or rng.random() < 0.3):
                live.append(pending.pop())
            pipe = client.pipeline(transaction=False)
            for request_id in rng.sample(live, k=min(len(live), rng.randint(1, 8))):
                if sent[request_id] < lengths[request_id]:
                    pipe.xadd(protocol.events_stream(request_id), token(sent[request_id]))
                    sent[request_id] += 1
                else:
                    pipe.xadd(protocol.events_stream(request_id), done())
                    live.remove(request_id)
            pipe.execute()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()

    async def follower(n: int, request_id: str) -> list[str]:
        await asyncio.sleep(rng.random() * 0.5 if n % 2 else 0)  # joins at different times
        if n == 0:
            started.set()
        return await follow_to_end(request_id)

    results = await asyncio.wait_for(
        asyncio.gather(*(follower(n, i) for n, i in enumerate(ids))), GUARD_S)
    writer.join(GUARD_S)
    for request_id, texts in zip(ids, results, strict=True):
        assert texts == [f"t{k}" for k in range(lengths[request_id])]
    assert broker.stream_reader().streams() == set()  # every follower left


async def test_a_follower_that_leaves_is_dropped_at_once(r):
    client, made = r
    gone, stays = uuid.uuid4().hex, uuid.uuid4().hex
    made += [protocol.events_stream(gone), protocol.events_stream(stays)]
    reader = broker.stream_reader()

    async def read_forever(request_id: str) -> None:
        await follow_to_end(request_id)

    leaving = asyncio.ensure_future(read_forever(gone))
    staying = asyncio.ensure_future(follow_to_end(stays))
    for _ in range(GUARD_S * 10):
        if reader.streams() == {protocol.events_stream(gone), protocol.events_stream(stays)}:
            break
        await asyncio.sleep(0.1)
    leaving.cancel()  # its client went away
    with pytest.raises(asyncio.CancelledError):
        await leaving
    assert reader.streams() == {protocol.events_stream(stays)}  # before any further read
    client.xadd(protocol.events_stream(gone), token(0))  # nobody keeps this one
    client.xadd(protocol.events_stream(stays), token(0))
    client.xadd(protocol.events_stream(stays), done())
    assert await asyncio.wait_for(staying, GUARD_S) == ["t0"]
    assert reader.streams() == set()


async def test_a_follower_joining_a_blocked_read_wakes_it(r, monkeypatch):
    """The shared read blocks far longer than the hang guard: only the wake gets the
    newcomer's events to it."""
    client, made = r
    monkeypatch.setattr(stream_reader, "READ_BLOCK_MS", 600_000)
    monkeypatch.setattr(broker, "SOCKET_TIMEOUT_S", 700)
    first, late = uuid.uuid4().hex, uuid.uuid4().hex
    made += [protocol.events_stream(first), protocol.events_stream(late)]
    reader = broker.stream_reader()
    waiting = asyncio.ensure_future(follow_to_end(first))
    for _ in range(GUARD_S * 10):  # the shared read is blocked on the first stream alone
        if reader._in_flight is not None and protocol.events_stream(first) in reader._in_flight:
            break
        await asyncio.sleep(0.1)
    client.xadd(protocol.events_stream(late), token(0))
    client.xadd(protocol.events_stream(late), done())
    assert await asyncio.wait_for(follow_to_end(late), GUARD_S) == ["t0"]
    client.xadd(protocol.events_stream(first), done())
    assert await asyncio.wait_for(waiting, GUARD_S) == []
    made.append(reader.wake_stream)


async def test_two_followers_of_one_stream_each_get_it_from_their_own_place(r):
    client, made = r
    request_id = uuid.uuid4().hex
    stream = protocol.events_stream(request_id)
    made.append(stream)
    first_id = client.xadd(stream, token(0)).decode()
    client.xadd(stream, token(1))
    # the later place first: the one from the start joins behind the blocked shared read,
    # which would skip the first entry for it
    from_first = asyncio.ensure_future(follow_to_end(request_id, first_id))
    reader = broker.stream_reader()
    for _ in range(GUARD_S * 10):
        if reader._in_flight is not None and stream in reader._in_flight:
            break
        await asyncio.sleep(0.1)
    from_start = asyncio.ensure_future(follow_to_end(request_id))
    for _ in range(GUARD_S * 100):  # it has joined: two followers of the stream
        if len(reader._followers.get(stream, ())) == 2:
            break
        await asyncio.sleep(0.01)
    client.xadd(stream, token(2))
    client.xadd(stream, done())
    assert await asyncio.wait_for(from_start, GUARD_S) == ["t0", "t1", "t2"]
    assert await asyncio.wait_for(from_first, GUARD_S) == ["t1", "t2"]


async def test_the_daemons_pipelined_flush_keeps_each_streams_order(r):
    """Events of many requests buffered in one flush (one pipeline) arrive per stream in the
    order the scheduler emitted them."""
    client, made = r
    ids = [uuid.uuid4().hex for _ in range(10)]
    made += [protocol.events_stream(i) for i in ids]
    writer = EventWriter(DaemonContext(client, "m", "d"), stream_interval_s=10.0)
    for i in ids:
        writer.track(i, "tenant")
    followers = [asyncio.ensure_future(follow_to_end(i)) for i in ids]
    rng = random.Random(3)
    order = [(i, k) for i in ids for k in range(5)]
    rng.shuffle(order)
    sent = {i: 0 for i in ids}
    for i, _ in order:  # per request, the tokens in order; requests interleaved
        k = sent[i]
        sent[i] += 1
        writer.on_event(TokenEvent(request_id=i, text=f"t{k}", n_tokens=1, tokens=(k,)))
    writer.flush()  # one pipeline: tokens of one request coalesce into one event
    for i in ids:
        client.xadd(protocol.events_stream(i), done())
    results = await asyncio.wait_for(asyncio.gather(*followers), GUARD_S)
    for texts in results:
        assert "".join(texts) == "t0t1t2t3t4"


async def test_a_read_that_started_past_a_followers_place_hands_it_nothing():
    """A follower that joined behind a blocked read (it wants entries before the read's
    place) takes nothing from that read's reply: the next read starts at its place. The
    real-Redis case is in test_broker.test_enqueue_and_read_events (a race there)."""
    reader = stream_reader.StreamReader(connect=None, waker=None,
                                        decode=lambda entry_id, fields: entry_id)
    behind = stream_reader.Follower("s", "0-0")
    level = stream_reader.Follower("s", "5-0")
    reader._followers["s"] = {behind, level}
    reader._deliver([(b"s", [(b"6-0", {})])], since={"s": "5-0"})
    assert list(level.buffer) == [("6-0", "6-0")] and level.fetched == "6-0"
    assert not behind.buffer and behind.fetched == "0-0"


async def test_an_unreadable_entry_fails_its_stream_alone(r):
    """A malformed entry (a daemon's bug) ends its own reader with an error; the process's
    other streams carry on (before the shared reader, it was that request's error alone)."""
    client, made = r
    bad, good = uuid.uuid4().hex, uuid.uuid4().hex
    made += [protocol.events_stream(bad), protocol.events_stream(good)]
    failing = asyncio.ensure_future(follow_to_end(bad))
    fine = asyncio.ensure_future(follow_to_end(good))
    reader = broker.stream_reader()
    for _ in range(GUARD_S * 100):  # both are followed
        if reader.streams() == {protocol.events_stream(bad), protocol.events_stream(good)}:
            break
        await asyncio.sleep(0.01)
    client.xadd(protocol.events_stream(bad), {"type": "token", "data": "{not json"})
    client.xadd(protocol.events_stream(good), token(0))
    with pytest.raises(ValueError):
        await asyncio.wait_for(failing, GUARD_S)
    client.xadd(protocol.events_stream(good), done())
    assert await asyncio.wait_for(fine, GUARD_S) == ["t0"]
