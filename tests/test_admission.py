"""``service.Admission``: what an admitted request holds (its slot, token reservation and the
gate's place in the model's queue) is given back exactly once on every way out before its
job is queued, and never after: a refusal holds nothing, a row already made is closed
(cancelled, or failed ``service_unavailable`` when Redis refused the job), and every error
reaches the caller with the code it had. Redis, the database and the queue are stand-ins
here: this holds the rollback's logic, the live tests hold the rest."""

from __future__ import annotations

import asyncio
import datetime
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from inference import broker, db, history, service
from inference.errors import ApiError
from wire.errors import SERVICE_UNAVAILABLE

REQUEST_ID = "r-1"


class World:
    """The stand-ins, and what was done to them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.given_back: list[str] = []
        self.rows: list[tuple[str, ...]] = []
        self.admit_error: BaseException | None = None
        self.record_error: BaseException | None = None
        self.record_gate: asyncio.Event | None = None  # holds the row's creation until set
        self.enqueue_error: BaseException | None = None
        self.enqueued = False
        monkeypatch.setattr(service.limits, "admit_key", self.admit_key)
        monkeypatch.setattr(service.limits, "release_soon", self.release_soon)
        monkeypatch.setattr(broker, "unadmit", self.unadmit)
        monkeypatch.setattr(broker, "enqueue", self.enqueue)
        monkeypatch.setattr(db, "run", self.run)
        monkeypatch.setattr(service, "_reservation", lambda parsed: 0)
        monkeypatch.setattr(service, "CancelIfAbandoned", Nothing)

    async def admit_key(self, api_key: Any, request_id: str, **kwargs: Any) -> None:
        if self.admit_error is not None:
            raise self.admit_error

    async def release_soon(self, tenant_id: Any, request_id: str) -> None:
        self.given_back.append(f"slot {request_id}")

    async def unadmit(self, model: str, tenant_id: str, request_id: str) -> None:
        self.given_back.append(f"place {request_id}")

    async def enqueue(self, job: Any, watch_ms: int = 0) -> None:
        if self.enqueue_error is not None:
            raise self.enqueue_error
        self.enqueued = True

    async def run(self, fn: Any, *args: Any) -> Any:
        if fn is service._record:
            if self.record_gate is not None:
                await self.record_gate.wait()
            if self.record_error is not None:
                raise self.record_error
            self.rows.append(("created", args[2]))
            return SimpleNamespace(created=datetime.datetime.now(datetime.UTC))
        if fn is history.abandon:
            self.rows.append(("cancelled", *args))
        elif fn is history.close_failed:
            self.rows.append(("failed", *args))
        return None


class Nothing:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def __aenter__(self) -> Nothing:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        return None


def _enqueue() -> Any:
    api_key = SimpleNamespace(tenant_id=7, tenant=SimpleNamespace(max_queued=None))
    parsed = SimpleNamespace(kind="completion", model="m", session_id=None,
                             job=lambda *args: SimpleNamespace(deadline=None))
    return service._enqueue(api_key, parsed, REQUEST_ID, None)


GIVEN_BACK = [f"slot {REQUEST_ID}", f"place {REQUEST_ID}"]


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> World:
    return World(monkeypatch)


@pytest.mark.asyncio
async def test_a_queued_request_gives_nothing_back(world):
    queued = await _enqueue()
    assert queued.request_id == REQUEST_ID and world.enqueued
    assert world.given_back == [] and world.rows == [("created", REQUEST_ID)]


@pytest.mark.asyncio
async def test_a_refusal_holds_nothing_to_give_back(world):
    world.admit_error = ApiError("rpm_exceeded", "over", headers={"Retry-After": "3"})
    with pytest.raises(ApiError) as refused:
        await _enqueue()
    assert refused.value is world.admit_error
    assert world.given_back == [] and world.rows == []


@pytest.mark.asyncio
async def test_a_lost_admission_reply_gives_back_once_as_a_503(world):
    world.admit_error = redis.ConnectionError("gone")
    with pytest.raises(broker.RedisDown) as down:
        await _enqueue()
    assert down.value.status == 503 and down.value.code == SERVICE_UNAVAILABLE
    assert world.given_back == GIVEN_BACK and world.rows == []


@pytest.mark.asyncio
async def test_a_cancelled_admission_gives_back_once(world):
    world.admit_error = asyncio.CancelledError()
    with pytest.raises(asyncio.CancelledError):
        await _enqueue()
    assert world.given_back == GIVEN_BACK and world.rows == []


@pytest.mark.asyncio
async def test_a_row_that_could_not_be_made_gives_back_once(world):
    world.record_error = RuntimeError("database away")
    with pytest.raises(RuntimeError):
        await _enqueue()
    assert world.given_back == GIVEN_BACK and world.rows == []


@pytest.mark.asyncio
async def test_a_caller_gone_while_its_row_is_made_cancels_the_row_and_gives_back_once(world):
    world.record_gate = asyncio.Event()
    task = asyncio.ensure_future(_enqueue())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    world.record_gate.set()  # the database thread finishes the row anyway
    with pytest.raises(asyncio.CancelledError):
        await task
    assert world.rows == [("created", REQUEST_ID), ("cancelled", REQUEST_ID)]
    assert world.given_back == GIVEN_BACK and not world.enqueued


@pytest.mark.asyncio
async def test_a_job_redis_refused_fails_its_row_and_gives_back_once_as_a_503(world):
    world.enqueue_error = redis.ResponseError("OOM command not allowed")
    with pytest.raises(broker.RedisDown) as down:
        await _enqueue()
    assert down.value.status == 503
    assert world.rows == [("created", REQUEST_ID), ("failed", REQUEST_ID, SERVICE_UNAVAILABLE)]
    assert world.given_back == GIVEN_BACK


@pytest.mark.asyncio
async def test_a_full_jobs_stream_cancels_its_row_and_keeps_its_error(world):
    world.enqueue_error = ApiError("service_unavailable", "full",
                                   headers={"Retry-After": "1"})
    with pytest.raises(ApiError) as full:
        await _enqueue()
    assert full.value is world.enqueue_error
    assert world.rows == [("created", REQUEST_ID), ("cancelled", REQUEST_ID)]
    assert world.given_back == GIVEN_BACK


@pytest.mark.asyncio
async def test_a_block_left_without_its_job_queued_gives_back_once(world):
    api_key = SimpleNamespace(tenant_id=7, tenant=SimpleNamespace(max_queued=None))
    parsed = SimpleNamespace(kind="completion", model="m", session_id=None)
    async with service.Admission(api_key, parsed, REQUEST_ID) as admitted:
        await admitted.record()
    assert world.given_back == GIVEN_BACK
    assert world.rows == [("created", REQUEST_ID), ("cancelled", REQUEST_ID)]
