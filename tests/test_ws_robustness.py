"""Websocket robustness (issue 12), in-process with a stand-in daemon: malformed messages
are answered and the socket carries on; an unauthenticated socket is closed after the auth
timeout; an exception in the consumer closes the socket and cancels its requests; a key
revoked (or its tenant deactivated) while its socket is open closes it and cancels its
requests; a resume of expired events is a 404 at once; resumes hold concurrency slots.

Timeouts here are hang guards only: nothing passes or fails on how fast it ran."""
import asyncio
import json
import threading
from datetime import timedelta

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.utils import timezone

from accounts.models import Tenant
from config.asgi import application
from inference import consumers
from inference.models import InferenceRequest
from tests.live_service import StandIn, echo, redis_conn, wait_until
from wire import limits as wire_limits
from wire import protocol

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]
PATH = "/ws/v1/stream"
HELLO = [{"role": "user", "content": "Hi"}]
GUARD_S = 20  # hang guard


def socket_for(key: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return WebsocketCommunicator(application, PATH, headers=headers)


def hold_until_cancelled(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    daemon.emit(job.id, protocol.TOKEN, {"text": "x", "n_tokens": 1})
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=GUARD_S)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


async def start_held(ws: WebsocketCommunicator, standin: StandIn, client_id) -> str:
    """A request the stand-in holds until it is cancelled or released: its request id."""
    await ws.send_json_to({"type": "chat.completions", "id": client_id, "model": standin.model,
                           "messages": HELLO})
    while True:
        message = await ws.receive_json_from(timeout=GUARD_S)
        if message.get("id") == client_id and message["type"] == "token":
            return message["request_id"]


async def until_done(ws: WebsocketCommunicator, client_id) -> list[dict]:
    out = []
    while True:
        message = await ws.receive_json_from(timeout=GUARD_S)
        if message.get("id") == client_id:
            out.append(message)
            if message["type"] in ("done", "error"):
                return out


async def closed_with(ws: WebsocketCommunicator) -> tuple[list[dict], int]:
    """The messages up to the server's close, and the close code."""
    messages = []
    while True:
        output = await ws.receive_output(timeout=GUARD_S)
        if output["type"] == "websocket.close":
            return messages, output.get("code")
        messages.append(json.loads(output["text"]))


DEEP = "[" * 5000 + "]" * 5000
MALFORMED = [
    ('{"type": ["x"]}', "type"),
    ('{"type": {"a": 1}, "id": 1}', "type"),
    ('{"type": "completions", "id": [1], "prompt": "Hi"}', "id"),
    ('{"type": "chat.completions", "id": {"a": 1}, "messages": []}', "id"),
    ('{"type": "cancel", "id": [1, 2]}', "id"),
    ('{"type": "resume", "id": true, "request_id": "x"}', "id"),
    ('{"type": "completions", "id": "' + "x" * 5000 + '", "prompt": "Hi"}', "id"),
    (DEEP, None),
    ('{"type": "completions", "id": 1, "prompt": ' + DEEP + "}", None),
    ('{"type": "completions", "id": 1, "x": ' + "[" * 100 + "]" * 100 + "}", None),
    ("[1, 2]", None),
    ('"just a string"', None),
    ("null", None),
    ("17", None),
    ("not json {", None),
    (" ", None),
]


async def test_malformed_messages_are_answered_and_the_socket_carries_on(parties, standin):
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    assert (await ws.connect())[0]
    await start_held(ws, standin, "held")
    try:
        for raw, param in MALFORMED:
            await ws.send_to(text_data=raw)
            reply = await ws.receive_json_from(timeout=GUARD_S)
            assert reply["type"] == "error", raw[:80]
            assert reply["error"]["message"], raw[:80]
            assert reply["error"]["param"] == param, raw[:80]
            assert reply["id"] in (None, 1), raw[:80]  # never the malformed id echoed back
        await ws.send_to(bytes_data=b"\xff\xfe not utf-8")
        assert (await ws.receive_json_from(timeout=GUARD_S))["type"] == "error"
    finally:
        release.set()
    held = await until_done(ws, "held")  # the running request was never disturbed
    assert held[-1]["type"] == "done" and held[-1]["finish_reason"] == "stop"
    standin.serve(echo)  # and the socket still takes requests
    await ws.send_json_to({"type": "completions", "id": "after", "model": standin.model,
                           "prompt": "Hi"})
    assert (await until_done(ws, "after"))[-1]["type"] == "done"
    await ws.disconnect()


async def test_an_unauthenticated_socket_is_closed_after_the_auth_timeout(parties, settings):
    settings.WS_AUTH_TIMEOUT_S = 0.3
    ws = socket_for(None)
    assert (await ws.connect())[0]
    messages, code = await closed_with(ws)
    assert code == consumers.CLOSE_UNAUTHENTICATED
    assert messages[-1]["error"]["code"] == "invalid_api_key"


async def test_auth_in_time_is_not_closed_by_the_timeout(parties, settings, standin):
    settings.WS_AUTH_TIMEOUT_S = 0.3
    ws = socket_for(None)
    await ws.connect()
    await ws.send_json_to({"type": "auth", "api_key": parties.owner})
    assert (await ws.receive_json_from(timeout=GUARD_S))["type"] == "authenticated"
    await asyncio.sleep(2 * settings.WS_AUTH_TIMEOUT_S)  # past the timeout: still open
    standin.serve(echo)
    await ws.send_json_to({"type": "completions", "id": 1, "model": standin.model,
                           "prompt": "Hi"})
    assert (await until_done(ws, 1))[-1]["type"] == "done"
    await ws.disconnect()


async def test_an_exception_in_the_consumer_closes_the_socket_and_cancels_its_requests(
        parties, standin, monkeypatch):
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    request_id = await start_held(ws, standin, "held")

    async def broken(self, client_id):
        raise RuntimeError("a bug in the consumer")

    monkeypatch.setattr(consumers.StreamConsumer, "_cancel", broken)
    try:
        await ws.send_json_to({"type": "cancel", "id": "other"})
        messages, code = await closed_with(ws)
        assert code == consumers.CLOSE_INTERNAL_ERROR
        assert messages[-1]["error"]["code"] == "internal_error"
        assert standin.is_cancelled(request_id)  # published before the close
    finally:
        release.set()


def _revoke_key(parties) -> None:
    parties.owner_key.revoke()


def _deactivate_tenant(parties) -> None:
    Tenant.objects.filter(pk=parties.a.pk).update(is_active=False)  # no signals: a bulk update


@pytest.mark.parametrize("how", [_revoke_key, _deactivate_tenant])
async def test_revoking_closes_open_sockets_and_cancels_their_requests(parties, standin, how,
                                                                       settings):
    settings.WS_REVOCATION_CHECK_S = 0.2
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    other = socket_for(parties.outsider)  # another tenant's socket stays open
    await other.connect()
    request_id = await start_held(ws, standin, "held")
    try:
        await database_sync_to_async(how)(parties)
        messages, code = await closed_with(ws)
        assert code == consumers.CLOSE_UNAUTHENTICATED
        assert messages[-1]["error"]["code"] == "invalid_api_key"
        assert standin.is_cancelled(request_id)
    finally:
        release.set()
    await other.send_json_to({"type": "auth", "api_key": parties.outsider})
    assert (await other.receive_json_from(timeout=GUARD_S))["type"] == "authenticated"
    await other.disconnect()


@database_sync_to_async
def _row(tenant, model: str, **fields) -> str:
    return str(InferenceRequest.objects.create(tenant=tenant, kind="completion", model=model,
                                               **fields).id)


@pytest.mark.parametrize("fields", [
    {"status": "done", "finished_offset_s": 0},  # ended, events expired
    {"status": "queued", "created_offset_s": -3600},  # never accepted, nobody will
], ids=["expired", "never-existed"])
async def test_resume_of_events_that_are_gone_is_404_at_once(parties, standin, fields):
    now = timezone.now()
    row = {"status": fields["status"]}
    if "finished_offset_s" in fields:
        row["finished"] = now
    if "created_offset_s" in fields:
        row["created"] = now + timedelta(seconds=fields["created_offset_s"])
    request_id = await _row(parties.a, standin.model, **row)
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "resume", "id": "r", "request_id": request_id})
    error = await ws.receive_json_from(timeout=GUARD_S)
    assert (error["type"], error["id"], error["status"]) == ("error", "r", 404)
    assert error["error"]["code"] == "events_expired"
    await ws.disconnect()


@database_sync_to_async
def _limit(tenant, **limits) -> None:
    Tenant.objects.filter(pk=tenant.pk).update(**limits)


async def test_resumes_hold_concurrency_slots_and_free_them(parties, standin):
    await _limit(parties.a, max_concurrent=2)
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    request_id = await start_held(ws, standin, "held")  # slot 1
    await ws.send_json_to({"type": "resume", "id": "r1", "request_id": request_id})
    first = await ws.receive_json_from(timeout=GUARD_S)  # slot 2, while it follows
    assert first["id"] == "r1" and first["type"] == "accepted"
    await ws.send_json_to({"type": "resume", "id": "r2", "request_id": request_id})
    while True:
        refused = await ws.receive_json_from(timeout=GUARD_S)
        if refused["id"] == "r2":
            break
    assert (refused["type"], refused.get("status")) == ("error", 429), refused
    assert refused["error"]["code"] == "concurrency_limited"
    release.set()
    await until_done(ws, "held")
    inflight = wire_limits.inflight_key(str(parties.a.pk))
    r = redis_conn()
    resume = wire_limits.RESUME_SLOT_PREFIX.encode()
    await asyncio.to_thread(wait_until, lambda: not any(
        m.startswith(resume) for m in r.zrange(inflight, 0, -1)), GUARD_S)
    await ws.disconnect()


async def test_too_many_resumes_on_closed_sockets_leave_no_slots(parties, standin, settings):
    """The issue's attack, small: a tenant with max_concurrent=1 opens resumes of its own
    finished request on several sockets: each is served or refused with
    concurrency_limited, and no slot is left behind. (A request's readers in the process
    are not limited here: tests/test_stream_shares.py has that cap.)"""
    settings.WEB_READERS_PER_REQUEST = 100
    await _limit(parties.a, max_concurrent=1)
    standin.serve(echo)
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "completions", "id": 0, "model": standin.model,
                           "prompt": "Hi"})
    request_id = (await until_done(ws, 0))[0]["request_id"]
    redis_conn().zrem(wire_limits.inflight_key(str(parties.a.pk)), request_id)  # as a daemon would
    sockets = [socket_for(parties.owner) for _ in range(3)]
    for s in sockets:
        await s.connect()
    for s in sockets:
        for i in range(4):
            await s.send_json_to({"type": "resume", "id": i, "request_id": request_id})
    outcomes = []
    for s in sockets:
        ended: dict[int, dict] = {}
        while len(ended) < 4:
            message = await s.receive_json_from(timeout=GUARD_S)
            if message["type"] in ("done", "error"):
                ended[message["id"]] = message
        outcomes.extend(ended.values())
    assert all(o["type"] in ("done", "error") for o in outcomes)
    assert all(o["error"]["code"] == "concurrency_limited"
               for o in outcomes if o["type"] == "error")
    for s in sockets:
        await s.disconnect()
    inflight = wire_limits.inflight_key(str(parties.a.pk))
    await asyncio.to_thread(wait_until, lambda: redis_conn().zcard(inflight) == 0, GUARD_S)
    await ws.disconnect()
