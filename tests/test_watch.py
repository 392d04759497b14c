"""The resume grace's two halves against a real Redis, no daemon, no web server: the web's
watch keys (inference/watch.py, ``service.CancelIfAbandoned``) and the daemon's check of
them (scheduler_daemon/service/watch.py). End to end: tests/chaos/test_resume_grace.py."""
import asyncio
import uuid

import pytest
import redis

from inference import service, watch
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.watch import CONFIRM_S, Watch
from tests.live_service import redis_conn
from wire import protocol

GUARD_S = 10  # hang guard


@pytest.fixture
def r():
    return redis_conn()


@pytest.fixture
def request_id(r):
    rid = str(uuid.uuid4())
    yield rid
    r.delete(protocol.watch_key(rid), protocol.cancel_key(rid))


async def _until(check, timeout_s: float = GUARD_S) -> None:
    async with asyncio.timeout(timeout_s):
        while not check():
            await asyncio.sleep(0.02)


async def _lives_on(r, key: str, graces: float = 2.5) -> None:
    """Check the key at every step for ``graces`` graces: each written key lives one grace,
    so only renewals keep it that long."""
    loop = asyncio.get_running_loop()
    until = loop.time() + graces * watch.grace_s()
    while loop.time() < until:
        assert r.exists(key), "the key expired while a reader held it"
        await asyncio.sleep(0.02)


# -- the web: readers keep the key alive ------------------------------------------------------


@pytest.mark.asyncio
async def test_a_reader_writes_the_key_at_once_renews_it_and_leaves_it_to_expire(
        r, request_id, settings):
    settings.RESUME_GRACE_S = 0.6
    key = protocol.watch_key(request_id)
    async with watch.Watching(request_id):
        assert 0 < r.pttl(key) <= 600  # written before the reader goes on, for one grace
        await _lives_on(r, key)  # over two graces: only renewals keep it
    assert r.exists(key)  # leaving writes nothing: the key lives on for the grace...
    await _until(lambda: not r.exists(key))  # ...and then expires, never renewed again


@pytest.mark.asyncio
async def test_a_reader_whose_key_was_written_for_it_writes_nothing_then_renews_it(
        r, request_id, settings):
    settings.RESUME_GRACE_S = 0.6
    key = protocol.watch_key(request_id)
    async with watch.Watching(request_id, written=True):
        assert not r.exists(key)  # the enqueue script writes it (here nobody did)
        await _until(lambda: r.exists(key))  # the renewals start at once all the same
        assert 0 < r.pttl(key) <= 600


@pytest.mark.asyncio
async def test_the_key_lives_while_any_reader_holds_it(r, request_id, settings):
    settings.RESUME_GRACE_S = 0.6
    key = protocol.watch_key(request_id)
    async with watch.Watching(request_id):
        async with watch.Watching(request_id):
            pass
        await _lives_on(r, key)
    await _until(lambda: not r.exists(key))


@pytest.mark.asyncio
async def test_no_grace_no_key(r, request_id, settings):
    settings.RESUME_GRACE_S = 0
    async with watch.Watching(request_id):
        assert not r.exists(protocol.watch_key(request_id))


async def _abandoned_reader(request_id: str, **kwargs) -> None:
    entered = asyncio.Event()

    async def reader() -> None:
        async with service.CancelIfAbandoned(request_id, **kwargs):
            entered.set()
            await asyncio.sleep(30)  # a reader waiting for events, until it is cancelled

    task = asyncio.create_task(reader())
    await asyncio.wait_for(entered.wait(), GUARD_S)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.asyncio
async def test_an_abandoned_reader_leaves_its_request_to_the_grace(r, request_id, settings):
    settings.RESUME_GRACE_S = 5
    await _abandoned_reader(request_id)
    assert not r.exists(protocol.cancel_key(request_id))
    assert 0 < r.pttl(protocol.watch_key(request_id)) <= 5000


@pytest.mark.asyncio
async def test_an_abandoned_reader_cancels_at_once_without_grace(r, request_id, settings):
    # (``at_once``: tests/test_broker.py)
    settings.RESUME_GRACE_S = 0
    await _abandoned_reader(request_id)
    assert r.exists(protocol.cancel_key(request_id))


# -- the daemon: requests whose key is gone are cancelled ------------------------------------


class Daemon:
    """What the watch needs of a daemon: which requests are live, and cancelling one."""

    def __init__(self) -> None:
        self.live: set[str] = set()
        self.cancelled: list[str] = []

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    def watch(self, client: redis.Redis) -> Watch:
        return Watch(DaemonContext(client, "m", "d"), self.cancel, self.live.__contains__)


def job(request_id: str, watched: bool = True) -> protocol.Job:
    return protocol.Job(id=request_id, kind="completion", model="m", tenant_id="1",
                        cache_scope="1", prompt="hi", watched=watched)


def test_a_watched_request_is_cancelled_once_its_key_stays_gone(r, request_id):
    daemon = Daemon()
    w = daemon.watch(r)
    daemon.live.add(request_id)
    w.started(job(request_id))
    r.set(protocol.watch_key(request_id), 1)
    assert w.check(now=0) == []
    r.delete(protocol.watch_key(request_id))
    assert w.check(now=1) == []  # missing once: not yet
    assert w.check(now=1 + CONFIRM_S) == [request_id]
    assert daemon.cancelled == [request_id]
    assert w.watched() == [] and w.check(now=10) == []  # cancelled once


def test_a_key_back_before_the_confirmation_cancels_nothing(r, request_id):
    daemon = Daemon()
    w = daemon.watch(r)
    daemon.live.add(request_id)
    w.started(job(request_id))
    assert w.check(now=0) == []  # missing
    r.set(protocol.watch_key(request_id), 1)  # a resume (or the web after a Redis restart)
    assert w.check(now=1) == []
    r.delete(protocol.watch_key(request_id))
    assert w.check(now=2) == []  # missing again: counted afresh
    assert w.check(now=2 + CONFIRM_S) == [request_id]


def test_unwatched_and_ended_requests_are_never_cancelled(r, request_id):
    daemon = Daemon()
    w = daemon.watch(r)
    other = str(uuid.uuid4())
    daemon.live.update({request_id, other})
    w.started(job(request_id, watched=False))  # e.g. a job XADDed by hand
    w.started(job(other))
    daemon.live.discard(other)  # it ended here
    assert w.check(now=0) == [] and w.check(now=10) == []
    assert daemon.cancelled == [] and w.watched() == []


class FlakyRedis:
    """MGET answers from a script: a list of replies, or an exception to raise."""

    def __init__(self, *replies) -> None:
        self.replies = list(replies)

    def mget(self, keys):
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


def test_a_failed_check_cancels_nothing_and_restarts_the_confirmation(request_id):
    daemon = Daemon()
    w = daemon.watch(FlakyRedis([None], redis.ConnectionError("down"), [None], [None]))
    daemon.live.add(request_id)
    w.started(job(request_id))
    assert w.check_safely(now=0) == []  # missing
    assert w.check_safely(now=1 + CONFIRM_S) == []  # Redis away: not a second miss
    assert w.check_safely(now=5) == []  # missing: counted from here
    assert w.check_safely(now=5 + CONFIRM_S) == [request_id]
