"""What a key may do, enforced (issue 38), end to end: a real daphne behind the door, the
real SmolLM2 daemon. An expired key authenticates nowhere (REST through the door, the
door's key check, the websocket, and an open websocket is closed when its key expires or
is revoked); a key's allow-list (403 ``model_not_allowed``) and ``/v1/models``; a
read-only key (403 ``key_read_only`` on inference and changes, 200 on reads)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from datetime import timedelta

import pytest
import websockets
from django.utils import timezone

from accounts.models import ApiKey, Tenant
from config.models import GEMMA, SMOLLM2
from inference import auth
from tests.test_limits_http import shell

pytestmark = pytest.mark.slow
HELLO = [{"role": "user", "content": "Hi"}]
CLOSE_UNAUTHENTICATED = 4401


def make_key(web, **fields) -> str:
    """A new tenant and key in the web's database, the key's fields set: its plaintext.
    ``expires_in_s``: its ``expires_at`` that many seconds from now (negative: past)."""
    expires_in_s = fields.pop("expires_in_s", None)
    expiry = "" if expires_in_s is None else (
        "from datetime import timedelta; from django.utils import timezone; "
        f"k.expires_at = timezone.now() + timedelta(seconds={expires_in_s}); ")
    out = shell(web, (
        "import json; from accounts.models import ApiKey, Tenant; "
        f"t = Tenant.objects.create(slug='scope-{uuid.uuid4().hex[:8]}', name='Scope'); "
        "k, raw = ApiKey.issue(t, 'scoped'); "
        f"[setattr(k, f, v) for f, v in {fields!r}.items()]; {expiry}"
        "k.save(); print(json.dumps(raw))"))
    return json.loads(out)


def revoke(web, raw: str) -> None:
    prefix = raw.split(".")[0].removeprefix("sk-")
    shell(web, "from accounts.models import ApiKey; "
               f"[k.revoke() for k in ApiKey.objects.filter(prefix={prefix!r})]")


def chat(web, key: str, model: str = SMOLLM2, **body):
    return web.request("POST", "/v1/chat/completions",
                       {"model": model, "messages": HELLO, "max_tokens": 2, **body}, key)


def error_of(reply) -> dict:
    return reply.json()["error"]


async def ws_messages_until_closed(ws, timeout_s: float = 30) -> list[dict]:
    """Every message the server sends until it closes the socket."""
    messages = []
    with pytest.raises(websockets.ConnectionClosed):
        while True:
            messages.append(json.loads(await asyncio.wait_for(ws.recv(), timeout_s)))
    return messages


# -- expiry ------------------------------------------------------------------------------------


def test_an_expired_key_is_refused_everywhere(web):
    key = make_key(web, expires_in_s=-1)
    reply = web.request("GET", "/v1/models", key=key)  # the door asks the key check first
    assert reply.status == 401 and error_of(reply)["code"] == "invalid_api_key"
    reply = chat(web, key)
    assert reply.status == 401 and error_of(reply)["code"] == "invalid_api_key"
    check = web.request_to(0, "GET", "/v1/internal/key-check", key=key)
    assert check.status == 401 and check.header("X-Refusal") == "invalid_api_key"
    fresh = make_key(web)
    assert web.request_to(0, "GET", "/v1/internal/key-check", key=fresh).status == 204

    async def over_the_socket() -> list[dict]:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            return await ws_messages_until_closed(ws)

    [refused] = asyncio.run(over_the_socket())
    assert refused["type"] == "error" and refused["error"]["code"] == "invalid_api_key"


@pytest.mark.django_db
def test_a_cached_key_past_its_expiry_fails_at_once():
    """The process's key cache trusts a key for KEY_CACHE_S: not past its expires_at."""
    tenant = Tenant.objects.create(slug=f"exp-{uuid.uuid4().hex[:8]}", name="E")
    api_key, raw = ApiKey.issue(tenant, "soon")
    api_key.expires_at = timezone.now() + timedelta(seconds=30)
    api_key.save()
    assert auth.lookup(raw) is not None  # cached now
    cached = auth.keys.get(raw)
    assert cached and cached.pk == api_key.pk
    cached.expires_at = timezone.now() - timedelta(microseconds=1)  # it expires in the cache
    assert auth.keys.get(raw) is None
    assert not auth.keys.known(raw)  # forgotten: the next use asks the database
    auth.keys.forget()


def test_an_open_websocket_is_closed_when_its_key_expires(web, chat_daemon):
    key = make_key(web, expires_in_s=10)

    async def run() -> tuple[dict, list[dict], int | None]:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            authenticated = json.loads(await asyncio.wait_for(ws.recv(), 30))
            await ws.send(json.dumps({"type": "chat.completions", "id": 1, "model": SMOLLM2,
                                      "messages": HELLO, "max_tokens": 2}))
            rest = await ws_messages_until_closed(ws)  # served, then closed at the expiry
            return authenticated, rest, ws.close_code

    authenticated, rest, code = asyncio.run(run())
    assert authenticated["type"] == "authenticated"  # before its expiry
    assert [m["type"] for m in rest[:1]] == ["accepted"] and rest[-2]["type"] == "done"
    assert rest[-1]["type"] == "error" and rest[-1]["error"]["code"] == "invalid_api_key"
    assert "expired" in rest[-1]["error"]["message"]
    assert code == CLOSE_UNAUTHENTICATED
    reply = web.request("GET", "/v1/requests", key=key)
    assert reply.status == 401 and error_of(reply)["code"] == "invalid_api_key"


def test_revoking_a_key_closes_its_open_websocket(web):
    key = make_key(web)

    async def run() -> tuple[list[dict], int | None]:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "authenticated"
            await asyncio.to_thread(revoke, web, key)
            return await ws_messages_until_closed(ws), ws.close_code

    messages, code = asyncio.run(run())
    assert messages[-1]["error"]["code"] == "invalid_api_key" and code == CLOSE_UNAUTHENTICATED


# -- the allow-list ------------------------------------------------------------------------------


def test_an_allow_listed_model_works_and_another_is_403(web, chat_daemon):
    key = make_key(web, allowed_models=[SMOLLM2])
    assert chat(web, key).status == 200
    refused = chat(web, key, GEMMA)
    assert refused.status == 403
    error = error_of(refused)
    assert error["code"] == "model_not_allowed" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"
    # without the allow-list the same request gets past the scope (to the model's state)
    assert chat(web, make_key(web), GEMMA).status != 403
    # every endpoint that names a model
    for path, body in [
        ("/v1/completions", {"model": GEMMA, "prompt": "Hi", "max_tokens": 1}),
        ("/v1/embeddings", {"model": GEMMA, "input": "Hi"}),
        ("/v1/tokenize", {"model": GEMMA, "content": "Hi"}),
        ("/v1/detokenize", {"model": GEMMA, "tokens": [1, 2]}),
        ("/v1/responses", {"model": GEMMA, "input": "Hi", "max_output_tokens": 16}),
        ("/v1/chat/completions", {"model": f"{GEMMA}:an-adapter", "messages": HELLO}),
    ]:
        reply = web.request("POST", path, body, key)
        assert reply.status == 403 and error_of(reply)["code"] == "model_not_allowed", path
    for path, extra in (("/v1/messages", {"max_tokens": 4}), ("/v1/messages/count_tokens", {})):
        reply = web.request("POST", path, {"model": GEMMA, "messages": HELLO, **extra}, key)
        body = reply.json()
        assert reply.status == 403 and body["type"] == "error", path
        assert body["error"]["type"] == "permission_error"
        assert body["error"]["code"] == "model_not_allowed"
    # an Idempotency-Key's retry is held to the allow-list too (no replay of another key's)
    reply = web.request("POST", "/v1/chat/completions", {"model": GEMMA, "messages": HELLO},
                        key, headers={"Idempotency-Key": uuid.uuid4().hex})
    assert reply.status == 403 and error_of(reply)["code"] == "model_not_allowed"

    async def over_the_socket() -> dict:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            await asyncio.wait_for(ws.recv(), 30)
            await ws.send(json.dumps({"type": "chat.completions", "id": "x", "model": GEMMA,
                                      "messages": HELLO}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    message = asyncio.run(over_the_socket())
    assert message["type"] == "error" and message["status"] == 403
    assert message["error"]["code"] == "model_not_allowed"


def test_models_lists_only_the_keys_models(web, chat_daemon):
    everything = {m["id"] for m in web.request("GET", "/v1/models", key=make_key(web)).json()[
        "data"]}
    assert SMOLLM2 in everything
    allowed = make_key(web, allowed_models=[SMOLLM2])
    assert [m["id"] for m in web.request("GET", "/v1/models", key=allowed).json()["data"]] \
        == [SMOLLM2]
    other = make_key(web, allowed_models=[GEMMA])
    assert SMOLLM2 not in {m["id"] for m in web.request("GET", "/v1/models",
                                                        key=other).json()["data"]}
    reply = web.request("GET", f"/v1/models/{SMOLLM2}", key=other)
    assert reply.status == 404 and error_of(reply)["code"] == "model_not_found"


# -- read-only -------------------------------------------------------------------------------------


def test_a_read_only_key_reads_and_runs_nothing(web, chat_daemon):
    key = make_key(web, read_only=True)
    refused = chat(web, key)
    assert refused.status == 403 and error_of(refused)["code"] == "key_read_only"
    for method, path, body in [
        ("POST", "/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 1}),
        ("POST", "/v1/embeddings", {"model": SMOLLM2, "input": "Hi"}),
        ("POST", "/v1/tokenize", {"model": SMOLLM2, "content": "Hi"}),
        ("POST", "/v1/responses", {"model": SMOLLM2, "input": "Hi"}),
        ("DELETE", "/v1/responses/resp_0123", None),
        ("POST", f"/v1/requests/{uuid.uuid4()}/cancel", None),
        ("DELETE", "/v1/sessions/sess_0123", None),
    ]:
        reply = web.request(method, path, body, key)
        assert reply.status == 403 and error_of(reply)["code"] == "key_read_only", path
    reply = web.request("POST", "/v1/messages", {"model": SMOLLM2, "max_tokens": 4,
                                                 "messages": HELLO}, key)
    error = reply.json()["error"]
    assert reply.status == 403 and error["type"] == "permission_error"
    assert error["code"] == "key_read_only"
    for path in ("/v1/requests", "/v1/usage", "/v1/models", f"/v1/models/{SMOLLM2}"):
        reply = web.request("GET", path, key=key)
        assert reply.status == 200, path
        reply.json()
    assert web.request("GET", "/v1/responses/resp_0123", key=key).status == 404  # a read

    async def over_the_socket() -> dict:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            await asyncio.wait_for(ws.recv(), 30)
            await ws.send(json.dumps({"type": "chat.completions", "id": "x", "model": SMOLLM2,
                                      "messages": HELLO}))
            return json.loads(await asyncio.wait_for(ws.recv(), 30))

    message = asyncio.run(over_the_socket())
    assert message["type"] == "error" and message["error"]["code"] == "key_read_only"
    # its history is its tenant's: nothing ran
    assert web.request("GET", "/v1/requests", key=key).json()["results"] == []


def test_a_scope_changed_while_a_websocket_is_open_applies_to_its_next_request(web, chat_daemon):
    key = make_key(web)
    prefix = key.split(".")[0].removeprefix("sk-")

    async def run() -> tuple[dict, dict]:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            await asyncio.wait_for(ws.recv(), 30)
            request = {"type": "chat.completions", "model": SMOLLM2, "messages": HELLO,
                       "max_tokens": 2}
            await ws.send(json.dumps({**request, "id": 1}))
            first = {}
            while first.get("type") not in ("done", "error"):
                first = json.loads(await asyncio.wait_for(ws.recv(), 60))
            await asyncio.to_thread(shell, web, (
                "from accounts.models import ApiKey; "
                f"ApiKey.objects.filter(prefix={prefix!r}).update(read_only=True)"))
            deadline = time.monotonic() + 30
            while True:  # the watcher brings the change within WS_REVOCATION_CHECK_S
                await ws.send(json.dumps({**request, "id": uuid.uuid4().hex}))
                second = {}
                while second.get("type") not in ("done", "error"):
                    second = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if second["type"] == "error" or time.monotonic() > deadline:
                    return first, second
                await asyncio.sleep(0.3)

    first, second = asyncio.run(run())
    assert first["type"] == "done"
    assert second["type"] == "error" and second["error"]["code"] == "key_read_only"
