"""The websocket API in-process (channels' WebsocketCommunicator) with a stand-in daemon:
auth, several requests on one socket, cancel, disconnect, resume, tenant isolation."""
import asyncio
import threading

import pytest
from channels.testing import WebsocketCommunicator

from config.asgi import application
from tests.live_service import StandIn, echo, redis_conn, wait_until
from wire import protocol

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True)]
PATH = "/ws/v1/stream"
HELLO = [{"role": "user", "content": "Hi"}]


def socket_for(key: str | None) -> WebsocketCommunicator:
    headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
    return WebsocketCommunicator(application, PATH, headers=headers)


async def until_done(ws: WebsocketCommunicator, client_id, timeout: float = 10) -> list[dict]:
    """Messages for ``client_id`` up to its done or error."""
    out = []
    while True:
        message = await ws.receive_json_from(timeout=timeout)
        if message.get("id") == client_id:
            out.append(message)
            if message["type"] in ("done", "error"):
                return out


async def test_header_auth_and_a_streamed_chat(parties, standin):
    standin.serve(echo)
    ws = socket_for(parties.owner)
    assert (await ws.connect())[0]
    await ws.send_json_to({"type": "chat.completions", "id": "a", "model": standin.model,
                           "messages": HELLO})
    messages = await until_done(ws, "a")
    assert [m["type"] for m in messages] == ["accepted", "token", "token", "done"]
    assert "".join(m.get("text", "") for m in messages) == "Hello world"
    assert all(m["event_id"] and m["request_id"] == messages[0]["request_id"] for m in messages)
    assert messages[-1]["usage"] == protocol.usage(5, 3, 2)  # the daemon's, as it is
    assert messages[-1]["finish_reason"] == "stop"
    await ws.disconnect()


async def test_first_message_auth(parties, standin):
    standin.serve(echo)
    ws = socket_for(None)
    await ws.connect()
    await ws.send_json_to({"type": "auth", "api_key": parties.member})
    assert (await ws.receive_json_from())["type"] == "authenticated"
    await ws.send_json_to({"type": "completions", "id": 7, "model": standin.model,
                           "prompt": "Hi"})
    assert (await until_done(ws, 7))[-1]["type"] == "done"
    await ws.disconnect()


@pytest.mark.parametrize("key, first", [("sk-bad.key", None),
                                        (None, {"type": "completions", "id": 1}),
                                        (None, {"type": "auth", "api_key": "sk-x.y"})])
async def test_bad_or_missing_key_closes_the_socket(parties, key, first):
    ws = socket_for(key)
    await ws.connect()
    if first:
        await ws.send_json_to(first)
    error = await ws.receive_json_from()
    assert error["type"] == "error" and error["error"]["code"] == "invalid_api_key"
    assert (await ws.receive_output())["code"] == 4401


async def test_bad_request_is_an_error_naming_the_field(parties, standin):
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "chat.completions", "id": "x", "model": standin.model,
                           "messages": HELLO, "temperature": -1})
    error = await ws.receive_json_from()
    assert (error["type"], error["id"], error["status"]) == ("error", "x", 400)
    assert error["error"]["param"] == "temperature"
    await ws.send_to(text_data="not json")
    assert (await ws.receive_json_from())["error"]["code"] == "invalid_message"
    await ws.send_json_to({"type": "dance", "id": 1})
    assert (await ws.receive_json_from())["error"]["param"] == "type"
    await ws.disconnect()


def hold_until_cancelled(daemon: StandIn, job: protocol.Job, release: threading.Event) -> None:
    daemon.accept(job)
    daemon.emit(job.id, protocol.TOKEN, {"text": "x", "n_tokens": 1})
    wait_until(lambda: daemon.is_cancelled(job.id) or release.is_set(), timeout_s=20)
    daemon.finish(job, reason="cancelled" if daemon.is_cancelled(job.id) else "stop")


async def test_cancel_one_request_while_another_continues(parties, standin):
    release = threading.Event()
    for _ in range(2):
        standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    for client_id in ("keep", "stop"):
        await ws.send_json_to({"type": "chat.completions", "id": client_id,
                               "model": standin.model, "messages": HELLO})
    seen: dict[str, list[str]] = {"keep": [], "stop": []}
    while len(seen["stop"]) < 2 or len(seen["keep"]) < 2:  # accepted + first token each
        message = await ws.receive_json_from(timeout=10)
        seen[message["id"]].append(message["type"])
    await ws.send_json_to({"type": "cancel", "id": "stop"})
    stopped = await until_done(ws, "stop")
    assert stopped[-1]["type"] == "done" and stopped[-1]["finish_reason"] == "cancelled"
    release.set()
    kept = await until_done(ws, "keep")
    assert kept[-1]["finish_reason"] == "stop"
    await ws.disconnect()


@pytest.mark.parametrize("code", [1000, 1001])  # the client's own close: cancel at once
async def test_closing_the_socket_cancels_its_requests(parties, standin, code):
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "chat.completions", "id": 1, "model": standin.model,
                           "messages": HELLO})
    accepted = await ws.receive_json_from(timeout=10)
    await ws.disconnect(code=code)
    try:
        await asyncio.to_thread(wait_until, lambda: standin.is_cancelled(accepted["request_id"]),
                                5)
    finally:
        release.set()


@pytest.mark.parametrize("code", [1006, 4000])  # dropped; a close that asks for the grace
async def test_a_dropped_socket_leaves_its_requests_to_the_grace(parties, standin, settings,
                                                                 code):
    settings.RESUME_GRACE_S = 1
    release = threading.Event()
    standin.serve(lambda d, j: hold_until_cancelled(d, j, release))
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "chat.completions", "id": 1, "model": standin.model,
                           "messages": HELLO})
    request_id = (await ws.receive_json_from(timeout=10))["request_id"]
    key, r = protocol.watch_key(request_id), redis_conn()
    assert r.exists(key)
    await ws.disconnect(code=code)
    try:
        # not renewed any more: it expires a grace later (then the daemon cancels the
        # request: tests/chaos/test_resume_grace.py); the web cancels nothing
        await asyncio.to_thread(wait_until, lambda: not r.exists(key), 10)
        assert not standin.is_cancelled(request_id)
    finally:
        release.set()


async def test_resume_on_a_socket_and_other_tenants_get_404(parties, standin):
    standin.serve(echo)
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "completions", "id": 1, "model": standin.model,
                           "prompt": "Hi"})
    original = await until_done(ws, 1)
    request_id = original[0]["request_id"]
    await ws.send_json_to({"type": "resume", "id": 2, "request_id": request_id,
                           "last_event_id": original[1]["event_id"]})
    resumed = await until_done(ws, 2)
    assert [m["event_id"] for m in resumed] == [m["event_id"] for m in original[2:]]
    await ws.disconnect()

    other = socket_for(parties.outsider)
    await other.connect()
    await other.send_json_to({"type": "resume", "id": 3, "request_id": request_id})
    error = await other.receive_json_from()
    assert (error["status"], error["error"]["code"]) == (404, "not_found")
    await other.send_json_to({"type": "cancel", "id": 3})
    assert (await other.receive_json_from())["error"]["code"] == "not_found"
    await other.disconnect()
    assert not standin.is_cancelled(request_id)


async def test_refusal_carries_the_http_status(parties, standin):
    standin.serve(lambda d, job: d.emit(job.id, protocol.ERROR, {
        "code": "queue_full", "status": 503, "message": "The queue is full."}))
    ws = socket_for(parties.owner)
    await ws.connect()
    await ws.send_json_to({"type": "completions", "id": "q", "model": standin.model,
                           "prompt": "Hi"})
    error = await ws.receive_json_from(timeout=10)
    assert (error["type"], error["id"], error["status"]) == ("error", "q", 503)
    assert error["error"]["code"] == "queue_full" and error["request_id"]
    await ws.disconnect()
