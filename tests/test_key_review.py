"""A hostile review of what a key may do (issue 38): each test here failed before its fix.

- A read-only key reads a request's events on the websocket (a resume) but changes nothing:
  its ``cancel`` is refused 403 ``key_read_only`` and closing its socket cancels nothing
  (before: a resume, then a cancel or a normal close, cancelled another key's request); nor
  does its reader's going away with ``RESUME_GRACE_S`` 0, on the socket or SSE.
- A model whose own name holds ':' (``<name>:<tag>``, served as a base: inference/adapters.py)
  is not an adapter of ``<name>``: a key allowed ``<name>`` may not run it, nor see it in
  /v1/models (before: the allow-list read it as ``<name>``'s adapter and let it run).
- Documented, not a bug: an SSE stream runs to its end past its key's expiry.
"""
from __future__ import annotations

import asyncio
import json
import threading
import uuid

import pytest
from channels.testing import WebsocketCommunicator
from django.db import connections

from accounts.models import ApiKey
from config.asgi import application
from tests.conftest import bearer
from tests.live_service import StandIn, echo, wait_until
from tests.test_adapters_api import env, rows  # noqa: F401 (fixtures)
from wire import protocol

PATH = "/ws/v1/stream"
HELLO = [{"role": "user", "content": "Hi"}]


def socket_for(key: str) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, PATH,
                                 headers=[(b"authorization", f"Bearer {key}".encode())])


def hold_until_cancelled(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    daemon.emit(job.id, protocol.TOKEN, {"text": "x", "n_tokens": 1})
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=20)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


async def orm(fn, *args):
    """``fn(*args)`` on a worker thread, that thread's connection closed after: a pooled
    PostgreSQL connection kept by a worker thread is never given back, and a few such
    threads drain the pool (every later database call then waits 30 s: the whole
    PostgreSQL run failed so)."""
    def unit():
        try:
            return fn(*args)
        finally:
            connections.close_all()

    return await asyncio.to_thread(unit)


# -- a read-only key on the websocket ------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("how", ["cancel", "close", "drop without a grace"])
async def test_a_read_only_keys_resume_on_the_socket_cancels_nothing(parties, standin, settings,
                                                                      how):
    if how == "drop without a grace":  # a reader that goes away cancels at once
        settings.RESUME_GRACE_S = 0
    reader, raw_reader = await orm(ApiKey.issue, parties.a, "reader")
    reader.read_only = True
    await orm(reader.save)
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    owner = socket_for(parties.owner)
    await owner.connect()
    await owner.send_json_to({"type": "chat.completions", "id": 1, "model": standin.model,
                              "messages": HELLO})
    request_id = (await owner.receive_json_from(timeout=10))["request_id"]
    ws = socket_for(raw_reader)
    try:
        assert (await ws.connect())[0]
        await ws.send_json_to({"type": "resume", "id": "r", "request_id": request_id})
        resumed = await ws.receive_json_from(timeout=10)  # it reads: its events come
        assert resumed["type"] == "accepted" and resumed["request_id"] == request_id
        assert (await ws.receive_json_from(timeout=10))["type"] == "token"
        if how == "cancel":
            await ws.send_json_to({"type": "cancel", "id": "r"})
            refused = await ws.receive_json_from(timeout=10)
            assert refused["type"] == "error" and refused["status"] == 403
            assert refused["error"]["code"] == "key_read_only"
        # a normal close cancels a key's own requests; a dropped one without a grace too
        await ws.disconnect(code=1006 if how == "drop without a grace" else 1000)
        await asyncio.sleep(0.5)  # a cancel would be published by now (before the close)
        assert not standin.is_cancelled(request_id)
    finally:
        release.set()
        await owner.disconnect()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_a_read_only_keys_sse_resume_cancels_nothing_when_it_goes(parties, standin,
                                                                        settings):
    """GET /v1/requests/<id>/events with a read-only key, the reader gone (its response
    closed) with no grace: the request runs on (another key's reader goes: cancelled)."""
    from django.test import AsyncClient

    settings.RESUME_GRACE_S = 0
    reader, raw_reader = await orm(ApiKey.issue, parties.a, "reader")
    reader.read_only = True
    await orm(reader.save)
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release), jobs=2)
    owner = socket_for(parties.owner)
    await owner.connect()
    try:
        for key, cancelled in ((raw_reader, False), (parties.member, True)):
            await owner.send_json_to({"type": "chat.completions", "id": key,
                                      "model": standin.model, "messages": HELLO})
            request_id = (await owner.receive_json_from(timeout=10))["request_id"]
            response = await AsyncClient().get(f"/v1/requests/{request_id}/events",
                                               headers={"Authorization": f"Bearer {key}"})
            assert response.status_code == 200
            got = asyncio.Queue()

            async def read(content=response.streaming_content, got=got) -> None:
                async for frame in content:
                    await got.put(frame)

            reading = asyncio.create_task(read())
            while b"data:" not in await asyncio.wait_for(got.get(), 10):
                pass
            reading.cancel()  # the client went away (ASGI cancels the response's task)
            with pytest.raises(asyncio.CancelledError):
                await reading
            await asyncio.sleep(0.3)
            assert standin.is_cancelled(request_id) is cancelled, key
    finally:
        release.set()
        await owner.disconnect()


# -- the allow-list and model names holding ':' --------------------------------------------------


def scoped(tenant, allowed: list[str]) -> str:
    api_key, raw = ApiKey.issue(tenant, "scoped")
    api_key.allowed_models = allowed
    api_key.save()
    return raw


def chat_with(api, key: str, model: str, **extra):
    return api.generic("POST", "/v1/chat/completions", json.dumps(
        {"model": model, "messages": HELLO, "max_tokens": 2, **extra}),
        content_type="application/json", **bearer(key))


@pytest.mark.django_db
def test_a_base_model_named_with_a_colon_is_not_an_adapter_of_the_allowed_model(api, parties,
                                                                              settings):
    name = f"standin-{uuid.uuid4().hex[:8]}"
    big = StandIn(model=f"{name}:big").start()  # a base model of its own, "<name>:big"
    try:
        big.serve(echo)  # the one request it may run
        key = scoped(parties.a, [name])
        refused = chat_with(api, key, big.model)
        assert refused.status_code == 403, refused.content
        assert refused.json()["error"]["code"] == "model_not_allowed"
        listed = api.get("/v1/models", **bearer(key)).json()["data"]
        assert big.model not in {m["id"] for m in listed}
        assert api.get(f"/v1/models/{big.model}", **bearer(key)).status_code == 404
        # listed by its own name it runs, and its reply names it once
        reply = chat_with(api, scoped(parties.a, [big.model]), big.model)
        assert reply.status_code == 200, reply.content
        assert reply.json()["model"] == big.model
    finally:
        big.stop()


@pytest.mark.django_db
@pytest.mark.usefixtures("rows")  # alpha's adapter "support" of the stand-in's model
def test_an_allowed_base_allows_its_adapters_and_a_listed_adapter_only_itself(api, parties,
                                                                            standin):
    standin.serve(echo, jobs=3)
    adapter = f"{standin.model}:support"
    for allowed in ([standin.model], [adapter]):
        key = scoped(parties.a, allowed)
        reply = chat_with(api, key, adapter)
        assert reply.status_code == 200, (allowed, reply.content)
        assert reply.json()["model"] == adapter
    only_adapter = scoped(parties.a, [adapter])
    reply = chat_with(api, only_adapter, standin.model, lora={"name": "support"})
    assert reply.status_code == 200, reply.content
    refused = chat_with(api, only_adapter, standin.model)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    listed = {m["id"] for m in api.get("/v1/models", **bearer(only_adapter)).json()["data"]}
    assert listed == {adapter}


# -- expiry mid-stream (documented, docs/api.md "What a key may do") -------------------------------


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_an_sse_stream_runs_to_its_end_past_its_keys_expiry(parties, standin):
    """The key is checked when a request comes in: its stream goes on to its end after the
    key expires; a resume after the expiry is 401."""
    from datetime import timedelta

    from django.test import AsyncClient
    from django.utils import timezone

    api_key, raw = await orm(ApiKey.issue, parties.a, "expiring")
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    response = await AsyncClient().post(
        "/v1/chat/completions", {"model": standin.model, "messages": HELLO, "stream": True},
        content_type="application/json", headers={"Authorization": f"Bearer {raw}"})
    assert response.status_code == 200
    frames = aiter(response.streaming_content)
    while b'"x"' not in await asyncio.wait_for(anext(frames), 10):
        pass
    api_key.expires_at = timezone.now() - timedelta(seconds=1)
    await orm(api_key.save)
    release.set()
    rest = b"".join([frame async for frame in frames])
    assert b'"stop"' in rest and rest.endswith(b"data: [DONE]\n\n")
    request_id = response["X-Request-Id"]
    resumed = await AsyncClient().get(f"/v1/requests/{request_id}/events",
                                      headers={"Authorization": f"Bearer {raw}"})
    assert resumed.status_code == 401
