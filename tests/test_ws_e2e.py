"""Websockets end to end with the real daemon (Gemma): in-process through channels'
WebsocketCommunicator, and over a real socket to daphne with the websockets library."""
import asyncio
import json

import pytest
import websockets
from channels.testing import WebsocketCommunicator

from config.asgi import application
from tests.live_service import redis_conn
from wire import protocol

pytestmark = [
    pytest.mark.slow,
    pytest.mark.asyncio,
]
HELLO = [{"role": "user", "content": "Tell me a long story."}]


@pytest.mark.django_db(transaction=True)
async def test_cancel_one_request_while_the_other_continues(parties, daemon):
    ws = WebsocketCommunicator(application, "/ws/v1/stream",
                               headers=[(b"authorization", f"Bearer {parties.owner}".encode())])
    assert (await ws.connect())[0]
    long = {"type": "chat.completions", "model": daemon.model, "messages": HELLO,
            "temperature": 0, "ignore_eos": True}
    await ws.send_json_to({**long, "id": "stop", "max_tokens": 400})
    await ws.send_json_to({**long, "id": "keep", "max_tokens": 24})
    tokens = {"stop": 0, "keep": 0}
    while tokens["stop"] < 2:
        message = await ws.receive_json_from(timeout=60)
        tokens[message["id"]] += message["type"] == "token"
    await ws.send_json_to({"type": "cancel", "id": "stop"})
    finals = {}
    while len(finals) < 2:
        message = await ws.receive_json_from(timeout=60)
        assert message["type"] != "error", message
        if message["type"] == "done":
            finals[message["id"]] = message
    assert finals["stop"]["finish_reason"] == "cancelled"
    assert finals["stop"]["usage"]["completion_tokens"] < 400
    assert finals["keep"]["finish_reason"] == "length"
    assert finals["keep"]["usage"]["completion_tokens"] == 24
    await ws.disconnect()


async def test_real_socket_client_streams_a_reply(web, daemon):
    async with websockets.connect(web.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": web.keys["owner"]}))
        assert json.loads(await ws.recv())["type"] == "authenticated"
        await ws.send(json.dumps({"type": "completions", "id": 1, "model": daemon.model,
                                  "prompt": "The capital of France is", "temperature": 0,
                                  "max_tokens": 8}))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    assert messages[0]["type"] == "accepted" and messages[0]["prompt_tokens"] == 6
    assert messages[-1]["type"] == "done"
    text = "".join(m.get("text", "") for m in messages)
    assert text and messages[-1]["usage"]["completion_tokens"] == sum(
        m.get("n_tokens", 0) for m in messages)
    row = web.request("GET", f"/v1/requests/{messages[0]['request_id']}",
                      key=web.keys["owner"]).json()
    assert row["status"] == "done"


async def test_real_socket_with_header_auth_and_close_cancels(web, daemon):
    headers = {"Authorization": f"Bearer {web.keys['owner']}"}
    async with websockets.connect(web.ws_url, additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "chat.completions", "id": "a", "model": daemon.model,
                                  "messages": HELLO, "max_tokens": 400, "ignore_eos": True}))
        accepted = json.loads(await asyncio.wait_for(ws.recv(), 60))
        assert accepted["type"] == "accepted"
        json.loads(await asyncio.wait_for(ws.recv(), 60))  # a first token
    for _ in range(100):
        row = web.request("GET", f"/v1/requests/{accepted['request_id']}",
                          key=web.keys["owner"]).json()
        if row["finished"]:
            break
        await asyncio.sleep(0.1)
    assert row["status"] == "cancelled"
    # the web published its cancel as the socket closed (the resume grace's cancel, the
    # daemon's, publishes none)
    assert redis_conn().exists(protocol.cancel_key(accepted["request_id"]))


async def test_real_socket_token_messages_carry_logprobs_when_asked(web, daemon):
    async with websockets.connect(web.ws_url) as ws:
        await ws.send(json.dumps({"type": "auth", "api_key": web.keys["owner"]}))
        assert json.loads(await ws.recv())["type"] == "authenticated"
        await ws.send(json.dumps({"type": "completions", "id": 1, "model": daemon.model,
                                  "prompt": "The capital of France is", "temperature": 0,
                                  "max_tokens": 6, "logprobs": 2}))
        messages = []
        while not messages or messages[-1]["type"] not in ("done", "error"):
            messages.append(json.loads(await asyncio.wait_for(ws.recv(), 60)))
    tokens = [m for m in messages if m["type"] == "token"]
    entries = [e for m in tokens for e in m["logprobs"]]
    assert len(entries) == messages[-1]["usage"]["completion_tokens"] == 6
    assert "".join(e["token"] for e in entries) == "".join(m["text"] for m in tokens)
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0 for e in entries)
