"""Sessions that continue, end to end: real daphne, a real daemon (Gemma), real Redis. A
client sends only its new turn; the model sees the whole conversation (a code word said in
the first turn only comes back in the last); the session is its tenant's; a busy, deleted
or unknown session is refused in the API's shapes; the websocket and SSE carry the id; a
restarted daemon continues the conversation."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import websockets

from tests.live_service import RealDaemon, redis_conn, wait_until

pytestmark = pytest.mark.slow

FIRST = ("Remember this. The secret code word is ZEBRAFIX. The weather report says the "
         "morning will be cool and the afternoon warm. ")


def ws_turn(web, key: str, request: dict) -> list[dict]:
    """One request over a real websocket to daphne: its messages to its end."""
    async def run() -> list[dict]:
        async with websockets.connect(web.ws_url) as ws:
            await ws.send(json.dumps({"type": "auth", "api_key": key}))
            assert json.loads(await ws.recv())["type"] == "authenticated"
            await ws.send(json.dumps(request))
            messages: list[dict] = []
            while not messages or messages[-1]["type"] not in ("done", "error"):
                messages.append(json.loads(await asyncio.wait_for(ws.recv(), 120)))
            return messages

    return asyncio.run(run())


def complete(web, model, key, prompt, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, **extra}
    return web.request("POST", "/v1/completions", body, key, timeout=300)


def test_four_turns_sent_as_suffixes_keep_the_conversation(web, daemon):
    owner = web.keys["owner"]
    reply = complete(web, daemon.model, owner, FIRST, session_id="new")
    assert reply.status == 200
    first = reply.json()
    sid = first["session_id"]
    assert sid.startswith("sess_") and len(sid) > 40
    held = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    for turn in ("Farmers are harvesting apples this week. ",
                 "The river is high after the rain. "):
        reply = complete(web, daemon.model, owner, turn, session_id=sid, **{"continue": True})
        assert reply.status == 200, reply.json()
        body = reply.json()
        assert body["session_id"] == sid
        usage = body["usage"]
        assert usage["prompt_tokens"] > held  # the conversation so far, then the new text
        details = usage["prompt_tokens_details"]
        assert details["cached_tokens"] >= held - 1 and details["cache_hit"] == "session"
        held = usage["prompt_tokens"] + usage["completion_tokens"]
    last = complete(web, daemon.model, owner, "Repeat: the secret code word is",
                    session_id=sid, max_tokens=8, **{"continue": True}).json()
    assert "ZEBRA" in last["choices"][0]["text"]  # only the first turn said it
    info = web.request("GET", f"/v1/sessions/{sid}", key=owner).json()
    assert (info["turns"], info["model"], info["busy"]) == (4, daemon.model, False)
    assert info["tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]


def test_another_tenant_a_busy_turn_a_deleted_or_unknown_session(web, daemon):
    owner, outsider = web.keys["owner"], web.keys["outsider"]
    sid = complete(web, daemon.model, owner, FIRST, session_id="new").json()["session_id"]
    theirs = complete(web, daemon.model, outsider, "Hi", session_id=sid, **{"continue": True})
    assert theirs.status == 404 and theirs.json()["error"]["code"] == "no_session"
    assert web.request("GET", f"/v1/sessions/{sid}", key=outsider).status == 404
    assert web.request("DELETE", f"/v1/sessions/{sid}", key=outsider).status == 404

    long_turn = {}

    def run_long() -> None:
        long_turn["reply"] = complete(web, daemon.model, owner, " And then,", session_id=sid,
                                      max_tokens=300, ignore_eos=True, **{"continue": True})

    thread = threading.Thread(target=run_long)
    thread.start()
    wait_until(lambda: web.request("GET", f"/v1/sessions/{sid}", key=owner).json()["busy"],
               timeout_s=60)
    busy = complete(web, daemon.model, owner, "Hi", session_id=sid, **{"continue": True})
    assert busy.status == 409 and busy.json()["error"]["code"] == "session_busy"
    thread.join(300)
    assert long_turn["reply"].status == 200
    long_turn["reply"].json()  # read to its end
    again = complete(web, daemon.model, owner, " Next.", session_id=sid, **{"continue": True})
    assert again.status == 200  # the turn's end freed it
    again.json()

    assert web.request("DELETE", f"/v1/sessions/{sid}", key=owner).json()["deleted"] is True
    gone = complete(web, daemon.model, owner, "Hi", session_id=sid, **{"continue": True})
    assert gone.status == 404 and gone.json()["error"]["code"] == "no_session"
    unknown = complete(web, daemon.model, owner, "Hi", session_id="sess_" + "A" * 43,
                       **{"continue": True})
    assert unknown.status == 404
    bad = complete(web, daemon.model, owner, "Hi", **{"continue": True})
    assert bad.status == 400 and bad.json()["error"]["param"] == "continue"


def test_sse_and_the_websocket_name_the_session(web, daemon):
    owner = web.keys["owner"]
    reply = web.request("POST", "/v1/chat/completions", {
        "model": daemon.model, "messages": [{"role": "user", "content": FIRST}],
        "max_tokens": 4, "temperature": 0, "stream": True, "session_id": "new"}, owner)
    chunks = [json.loads(data) for _id, data in reply.sse() if data != "[DONE]"]
    sid = chunks[0]["session_id"]
    assert all(c["session_id"] == sid for c in chunks)
    messages = ws_turn(web, owner, {"type": "chat.completions", "id": "c", "model":
                                       daemon.model, "session_id": sid, "continue": True,
                                       "messages": [{"role": "user", "content": "Hi again."}],
                                       "max_tokens": 4})
    assert messages[0]["type"] == "accepted" and messages[0]["session_id"] == sid
    assert messages[-1]["type"] == "done" and messages[-1]["session_id"] == sid


def test_a_session_continues_after_its_daemon_restarts(web):
    daemon = RealDaemon(web, "gemma-sessions-restart", PROMPT_CACHE_DISK_MIN_TOKENS="16")
    owner = web.keys["owner"]
    daemon.start()
    try:
        sid = complete(web, daemon.model, owner, FIRST, session_id="new").json()["session_id"]
    finally:
        daemon.stop()
    daemon.start()
    try:
        reply = complete(web, daemon.model, owner, "Repeat: the secret code word is",
                         session_id=sid, max_tokens=8, **{"continue": True})
        status, last = reply.status, reply.json()
    finally:
        daemon.stop()
    assert status == 200, last
    assert "ZEBRA" in last["choices"][0]["text"]
    assert last["usage"]["prompt_tokens_details"]["cache_tier"] == "disk"


def test_a_retried_new_session_names_the_session_its_first_run_made(web, daemon):
    owner = web.keys["owner"]
    body = {"model": daemon.model, "prompt": FIRST, "max_tokens": 4, "temperature": 0,
            "session_id": "new"}
    headers = {"Idempotency-Key": f"session-retry-{threading.get_ident()}-{id(body)}"}
    first = web.request("POST", "/v1/completions", body, owner, headers=headers).json()
    retry = web.request("POST", "/v1/completions", body, owner, headers=headers).json()
    assert retry["id"] == first["id"] and retry["session_id"] == first["session_id"]
    turn = complete(web, daemon.model, owner, " More.", session_id=first["session_id"],
                    **{"continue": True})
    assert turn.status == 200 and turn.json()["session_id"] == first["session_id"]


def test_a_new_session_refused_by_the_tenants_limits_is_not_kept(web, daemon):
    from tests.test_limits_http import make_tenant
    from wire import sessions

    tenant_id, key = make_tenant(web, requests_per_minute=1)
    r = redis_conn()
    r.delete(sessions.tenant_key(str(tenant_id)))
    assert complete(web, daemon.model, key, "Hi").status == 200
    refused = complete(web, daemon.model, key, FIRST, session_id="new")
    assert refused.status == 429 and refused.json()["error"]["code"] == "rpm_exceeded"
    assert r.zcard(sessions.tenant_key(str(tenant_id))) == 0  # no place under the cap
