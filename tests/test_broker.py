"""inference.broker and the stream follower against a real Redis (no daemon, no web server)."""
import asyncio
import time
import uuid

import pytest

from inference import broker, service
from inference.errors import ApiError
from tests.live_service import StandIn, redis_conn
from wire import ownership, protocol

pytestmark = pytest.mark.asyncio


@pytest.fixture
def r():
    return redis_conn()


@pytest.fixture
def request_id(r):
    rid = str(uuid.uuid4())
    yield rid
    r.delete(protocol.events_stream(rid), protocol.cancel_key(rid), protocol.owner_key(rid))


async def test_live_daemons_skips_expired_snapshots(r):
    alive, dead = StandIn().start(), StandIn()
    r.zadd(protocol.DAEMONS_ZSET, {dead.daemon_id: time.time()})  # listed, but no key
    try:
        models = await broker.live_models()
        assert alive.model in models and dead.model not in models
        assert await broker.daemon_alive(alive.daemon_id)
        assert not await broker.daemon_alive(dead.daemon_id)
        assert alive.daemon_id in {d["daemon_id"] for d in broker.live_daemons_sync()}
    finally:
        alive.stop()
        r.zrem(protocol.DAEMONS_ZSET, dead.daemon_id)


async def test_is_served_reuses_only_a_recent_yes():
    daemon = StandIn().start()
    try:
        assert await broker.is_served(daemon.model, max_age_s=60)
    finally:
        daemon.stop()
    assert await broker.is_served(daemon.model, max_age_s=60)  # seen served a moment ago
    assert not await broker.is_served(daemon.model)  # asked afresh: gone
    assert not await broker.is_served(f"never-{uuid.uuid4().hex}", max_age_s=60)


async def test_publish_cancel_sets_the_flag_and_notifies(r, request_id):
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(protocol.CANCEL_CHANNEL)
    await broker.publish_cancel(request_id)
    assert 0 < r.ttl(protocol.cancel_key(request_id)) <= protocol.CANCEL_TTL_S
    deadline, seen = time.monotonic() + 3, []
    while request_id not in seen and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.5)  # None for the subscribe confirmation
        if message:
            seen.append(message["data"].decode())  # other tests may cancel too
    pubsub.close()
    assert request_id in seen


async def test_giving_up_is_written_once_and_only_while_the_dead_owner_owns_it(r, request_id):
    r.set(protocol.owner_key(request_id), "daemon-dead")
    assert not await broker.give_up(request_id, "daemon-other", "not its owner")
    assert await broker.give_up(request_id, "daemon-dead", "gone")
    assert not await broker.give_up(request_id, "daemon-dead", "gone again")
    assert await broker.owner_of(request_id) == "web"
    entries = r.xrange(protocol.events_stream(request_id))
    assert len(entries) == 1
    kind, data = protocol.decode_event(entries[0][1])
    assert (kind, data["code"]) == ("error", "inference_interrupted")
    assert 0 < r.ttl(protocol.events_stream(request_id)) <= protocol.STREAM_RETENTION_S


async def test_a_daemon_that_took_the_request_over_wins_against_giving_up(r, request_id):
    r.set(protocol.owner_key(request_id), "daemon-dead")
    take = r.register_script(ownership.TAKE)
    assert take(*ownership.take_args(request_id, "daemon-new", "daemon-dead", ""))
    assert not await broker.give_up(request_id, "daemon-dead", "gone")
    assert await broker.owner_of(request_id) == "daemon-new"
    assert r.xlen(protocol.events_stream(request_id)) == 0


async def test_no_giving_up_on_an_ended_request(r, request_id):
    r.xadd(protocol.events_stream(request_id), protocol.encode_event("done", {}))
    assert not await broker.give_up(request_id, "daemon-dead", "gone")
    assert r.xlen(protocol.events_stream(request_id)) == 1


async def test_enqueue_and_read_events(r, request_id):
    job = protocol.Job(id=request_id, kind="completion", model=f"m-{uuid.uuid4().hex[:6]}",
                       tenant_id="1", cache_scope="1", prompt="hi")
    await broker.enqueue(job)
    entries = r.xrange(protocol.jobs_stream(job.model))
    assert protocol.Job.decode(entries[0][1]) == job
    r.delete(protocol.jobs_stream(job.model))
    standin = StandIn()
    first = standin.accept(job)
    assert await broker.read_events(request_id, first, block_ms=10) == []
    token = standin.emit(request_id, "token", {"text": "a", "n_tokens": 1})
    events = await broker.read_events(request_id, "0-0", block_ms=10)
    assert [(e.entry_id, e.kind) for e in events] == [(first, "accepted"), (token, "token")]
    assert (await broker.first_event(request_id)).entry_id == first
    assert (await broker.last_event(request_id)).entry_id == token


@pytest.mark.django_db(transaction=True)
async def test_follow_ends_with_interrupted_when_the_daemon_dies(r, request_id):
    standin = StandIn().start()
    job = protocol.Job(id=request_id, kind="completion", model=standin.model, tenant_id="1",
                       cache_scope="1", prompt="hi")
    accepted = standin.accept(job)
    standin.emit(request_id, "token", {"text": "a", "n_tokens": 1})
    standin.die()
    try:
        seen = [e async for e in service.follow(request_id, accepted, standin.model) if e]
    finally:
        standin.stop()
    assert [e.kind for e in seen] == ["token", "error"]
    assert seen[-1].data["code"] == "inference_interrupted" and seen[-1].entry_id


async def test_follow_from_a_finished_point_returns_at_once(r, request_id):
    standin = StandIn()
    job = protocol.Job(id=request_id, kind="completion", model="m", tenant_id="1",
                       cache_scope="1", prompt="hi")
    standin.accept(job)
    done = standin.finish(job)
    # nothing after the terminal event: it returns without reading (the guard only stops a hang)
    assert await asyncio.wait_for(_collect(service.follow(request_id, done, "m")), 30) == []


async def test_cancel_if_abandoned_at_once_publishes_when_the_reader_is_cancelled(r, request_id):
    entered = asyncio.Event()

    async def reader() -> None:  # (without at_once: the resume grace, tests/test_watch.py)
        async with service.CancelIfAbandoned(request_id, at_once=True):
            entered.set()
            await asyncio.sleep(30)  # a reader waiting for events, until it is cancelled

    task = asyncio.create_task(reader())
    await asyncio.wait_for(entered.wait(), 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert r.exists(protocol.cancel_key(request_id))



async def _collect(stream) -> list:
    return [e async for e in stream]


async def test_enqueue_writes_the_watch_key_with_the_job_and_never_without_it(r, request_id,
                                                                              monkeypatch):
    model = f"m-{uuid.uuid4().hex[:6]}"
    jobs = [protocol.Job(id=f"{request_id}-{i}", kind="completion", model=model, tenant_id="1",
                         cache_scope="1", prompt="hi") for i in range(3)]  # one id each
    keys = [protocol.watch_key(job.id) for job in jobs]
    try:
        await broker.enqueue(jobs[0], watch_ms=5000)
        assert r.xlen(protocol.jobs_stream(model)) == 1
        assert 4000 < r.pttl(keys[0]) <= 5000  # one script: the key came with the job
        monkeypatch.setattr(protocol, "JOBS_MAX_PENDING", 1)
        with pytest.raises(ApiError):
            await broker.enqueue(jobs[1], watch_ms=5000)
        assert not r.exists(keys[1])  # refused: no job, so no key either
        monkeypatch.setattr(protocol, "JOBS_MAX_PENDING", 10)
        await broker.enqueue(jobs[2])  # watch_ms 0 (no grace): no key
        assert not r.exists(keys[2]) and r.xlen(protocol.jobs_stream(model)) == 2
    finally:
        r.delete(protocol.jobs_stream(model), *keys)


async def test_a_full_jobs_stream_refuses_the_enqueue_with_503(r, request_id, monkeypatch):
    """Nothing trims the jobs stream (an entry is a request not yet ended): a backlog past
    JOBS_MAX_PENDING is refused instead."""
    monkeypatch.setattr(protocol, "JOBS_MAX_PENDING", 2)
    model = f"m-{uuid.uuid4().hex[:6]}"
    jobs = [protocol.Job(id=f"{request_id}-{i}", kind="completion", model=model,
                         tenant_id="1", cache_scope="1", prompt="hi") for i in range(3)]
    try:
        await broker.enqueue(jobs[0])
        await broker.enqueue(jobs[1])
        with pytest.raises(ApiError) as refused:
            await broker.enqueue(jobs[2])
        assert refused.value.code == "service_unavailable" and refused.value.status_code == 503
        assert refused.value.headers["Retry-After"]
        assert r.xlen(protocol.jobs_stream(model)) == 2
    finally:
        r.delete(protocol.jobs_stream(model))
