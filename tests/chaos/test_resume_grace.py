"""Resume after a dropped connection (issue #14): a daphne of this module's own (killed with
SIGKILL and started again here), a real daemon with Gemma, the test Redis.

A client that drops (SSE: the TCP connection; websocket: no close frame) or whose web
process is killed leaves its request running for RESUME_GRACE_S: a resume within it gets
the rest, each event once; without one the daemon cancels the request. A deliberate close
or a ``cancel`` still cancels at once. Requests are long (ignore_eos) so that they outlive
the drop, the grace and its confirmation; every wait is a hang guard, never the verdict.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
import uuid

import pytest
import websockets

from tests.live_service import ROOT, RealDaemon, WebServer, redis_conn, wait_until
from wire import protocol

pytestmark = [pytest.mark.slow]

# Long enough for a daphne killed here to be started again on a busy machine (about 1 s
# idle) and resumed through, short enough to wait out when nobody resumes.
GRACE_S = 5
GUARD_S = 120  # hang guard
# Tokens: a request outlives the drop, the grace and its confirmation (so a resume that
# did not keep it watched would see it cancelled). At most 1024 with the prompt (N_CTX 2048
# over N_PARALLEL 2).
LONG = 1000
STORY = [{"role": "user", "content": "Tell me a long story."}]


class RestartableWeb(WebServer):
    """The shared ``WebServer``, with a grace of GRACE_S and a daphne that can be killed
    and started again on the same port and database."""

    def __init__(self) -> None:
        super().__init__()
        self.env["RESUME_GRACE_S"] = str(GRACE_S)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no cancel, no last renewal."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def relaunch(self) -> None:
        log = (self.tmp / "daphne.log").open("ab")
        self.proc = subprocess.Popen(self.daphne_argv(), cwd=ROOT, env=self.env, stdout=log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + GUARD_S
        while True:
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/health", timeout=2):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"daphne did not start again:\n{self.log_tail()}") from None
                time.sleep(0.05)


@pytest.fixture(scope="module")
def web():
    server = RestartableWeb().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def daemon(web):
    started = RealDaemon(web, f"gemma-grace-{uuid.uuid4().hex[:6]}").start()
    yield started
    started.stop()


# -- helpers -----------------------------------------------------------------------------------


def stream(web, daemon, max_tokens: int):
    body = {"model": daemon.model, "messages": STORY, "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "ignore_eos": True}
    reply = web.request("POST", "/v1/chat/completions", body, web.keys["owner"],
                        timeout=GUARD_S)
    assert reply.status == 200, reply.json()
    return reply, reply.header("X-Request-Id")


def first_frames(reply, n: int) -> list[tuple[str | None, str]]:
    frames = reply.sse()
    return [next(frames) for _ in range(n)]


def resume_sse(web, request_id: str, after: str) -> list[tuple[str | None, str]]:
    reply = web.request("GET", f"/v1/requests/{request_id}/events?include_usage=true",
                        key=web.keys["owner"], headers={"Last-Event-ID": after},
                        timeout=GUARD_S)
    assert reply.status == 200, reply.json()
    return list(reply.sse())


def stored_events(request_id: str) -> list[tuple[str, str, dict]]:
    """The request's events stream as Redis holds it: (entry id, type, data)."""
    entries = redis_conn().xrange(protocol.events_stream(request_id))
    return [(entry_id.decode(), *protocol.decode_event(fields)) for entry_id, fields in entries]


def ended(request_id: str) -> tuple[str, dict] | None:
    events = stored_events(request_id)
    if events and events[-1][1] in protocol.TERMINAL:
        return events[-1][1], events[-1][2]
    return None


def assert_sse_once(request_id: str, frames: list[tuple[str | None, str]], max_tokens: int):
    """``frames`` (the first connection's, then the resume's) are the whole stream: every
    event of the request exactly once, in order, its whole text, ended by ``length``."""
    assert frames[-1] == (None, "[DONE]")
    payloads = [(entry_id, json.loads(data)) for entry_id, data in frames[:-1]]
    ids = [entry_id for entry_id, _ in payloads]
    seen = [entry_id for i, entry_id in enumerate(ids) if i == 0 or ids[i - 1] != entry_id]
    events = stored_events(request_id)
    sent = [entry_id for entry_id, kind, data in events
            if kind != protocol.TOKEN or data.get("text")]  # an empty token has no chunk
    assert seen == sent  # contiguous, no duplicate, nothing missing
    text = "".join(p["choices"][0]["delta"].get("content") or ""
                   for _, p in payloads if p.get("choices"))
    assert text == "".join(data["text"] for _, kind, data in events if kind == protocol.TOKEN)
    reasons = [p["choices"][0]["finish_reason"] for _, p in payloads if p.get("choices")]
    assert reasons[-1] == "length"  # ran to the end: never cancelled
    assert payloads[-1][1]["usage"]["completion_tokens"] == max_tokens


def assert_cancelled_by_the_grace(web, request_id: str) -> None:
    """Nobody resumed: the daemon cancelled the request; its row says so."""
    kind, data = wait_until(lambda: ended(request_id), GUARD_S)
    assert (kind, data["finish_reason"]) == (protocol.DONE, "cancelled")
    assert data["usage"]["completion_tokens"] < LONG
    row = web.request("GET", f"/v1/requests/{request_id}", key=web.keys["owner"]).json()
    assert (row["status"], row["finish_reason"]) == ("cancelled", "cancelled")
    assert not published_cancel(request_id)  # the daemon's watch did it, not the web


def published_cancel(request_id: str) -> bool:
    """Whether a web process published the request's cancel (the daemon's watch cancels
    without one): a cancel at once, not the grace's."""
    return bool(redis_conn().exists(protocol.cancel_key(request_id)))


# -- SSE -------------------------------------------------------------------------------------


def test_sse_drop_then_resume_within_the_grace_gets_the_rest_once(web, daemon):
    reply, request_id = stream(web, daemon, LONG)
    before = first_frames(reply, 3)  # the role chunk and two tokens
    reply.close()
    after = resume_sse(web, request_id, before[-1][0])
    assert_sse_once(request_id, before + after, LONG)


def test_sse_drop_without_a_resume_is_cancelled_after_the_grace(web, daemon):
    reply, request_id = stream(web, daemon, LONG)
    first_frames(reply, 3)
    reply.close()
    assert_cancelled_by_the_grace(web, request_id)


def test_sse_cancel_endpoint_still_cancels_at_once(web, daemon):
    reply, request_id = stream(web, daemon, LONG)
    first_frames(reply, 3)
    answer = web.request("POST", f"/v1/requests/{request_id}/cancel", key=web.keys["owner"])
    assert answer.status == 200
    frames = list(reply.sse())  # the stream goes on to its end: cancelled
    assert json.loads(frames[-2][1])["choices"][0]["finish_reason"] == "cancelled"
    assert published_cancel(request_id)


# -- websocket -------------------------------------------------------------------------------


async def ws_open(web):
    headers = {"Authorization": f"Bearer {web.keys['owner']}"}
    return await websockets.connect(web.ws_url, additional_headers=headers)


async def ws_until(ws, count: int | None = None) -> list[dict]:
    """Messages up to the first ``count`` (or the terminal one)."""
    out: list[dict] = []
    while (count is None or len(out) < count) and not (
            out and out[-1]["type"] in ("done", "error")):
        out.append(json.loads(await asyncio.wait_for(ws.recv(), GUARD_S)))
    return out


async def ws_start(web, daemon, max_tokens: int):
    ws = await ws_open(web)
    await ws.send(json.dumps({"type": "chat.completions", "id": "a", "model": daemon.model,
                              "messages": STORY, "temperature": 0, "max_tokens": max_tokens,
                              "ignore_eos": True}))
    before = await ws_until(ws, 3)  # accepted and two tokens
    assert [m["type"] for m in before] == ["accepted", "token", "token"], before
    return ws, before


@pytest.mark.asyncio
async def test_ws_drop_then_resume_on_a_new_socket_gets_the_rest_once(web, daemon):
    ws, before = await ws_start(web, daemon, LONG)
    request_id = before[0]["request_id"]
    ws.transport.abort()  # no close frame: the connection dropped (1006)
    again = await ws_open(web)
    await again.send(json.dumps({"type": "resume", "id": "b", "request_id": request_id,
                                 "last_event_id": before[-1]["event_id"]}))
    after = await ws_until(again)
    await again.close()
    messages = before + after
    assert messages[-1]["type"] == "done" and messages[-1]["finish_reason"] == "length"
    assert messages[-1]["usage"]["completion_tokens"] == LONG
    events = stored_events(request_id)
    assert [m["event_id"] for m in messages] == [entry_id for entry_id, _, _ in events]
    assert "".join(m.get("text", "") for m in messages) == "".join(
        data["text"] for _, kind, data in events if kind == protocol.TOKEN)


@pytest.mark.asyncio
async def test_ws_drop_without_a_resume_is_cancelled_after_the_grace(web, daemon):
    ws, before = await ws_start(web, daemon, LONG)
    ws.transport.abort()
    await asyncio.to_thread(assert_cancelled_by_the_grace, web, before[0]["request_id"])


@pytest.mark.asyncio
async def test_ws_cancel_message_still_cancels_at_once(web, daemon):
    ws, before = await ws_start(web, daemon, LONG)
    await ws.send(json.dumps({"type": "cancel", "id": "a"}))
    done = (await ws_until(ws))[-1]
    await ws.close()
    assert (done["type"], done["finish_reason"]) == ("done", "cancelled")
    assert published_cancel(before[0]["request_id"])


@pytest.mark.asyncio
async def test_ws_deliberate_close_still_cancels_at_once(web, daemon):
    ws, before = await ws_start(web, daemon, LONG)
    request_id = before[0]["request_id"]
    await ws.close()  # code 1000
    kind, data = await asyncio.to_thread(wait_until, lambda: ended(request_id), GUARD_S)
    assert (kind, data["finish_reason"]) == (protocol.DONE, "cancelled")
    assert published_cancel(request_id)  # as the socket closed, not after the grace


# -- the web process killed --------------------------------------------------------------------


def test_daphne_killed_mid_stream_then_started_again_resume_gets_the_rest_once(web, daemon):
    reply, request_id = stream(web, daemon, LONG)
    before = first_frames(reply, 3)
    web.kill()
    reply.conn.close()
    web.relaunch()
    after = resume_sse(web, request_id, before[-1][0])
    assert_sse_once(request_id, before + after, LONG)


def test_daphne_killed_mid_stream_without_a_resume_is_cancelled_after_the_grace(web, daemon):
    reply, request_id = stream(web, daemon, LONG)
    first_frames(reply, 3)
    web.kill()
    reply.conn.close()
    web.relaunch()  # back, but nobody resumes
    assert_cancelled_by_the_grace(web, request_id)
