"""The web's handling of the wire, over a real daphne, with a stand-in daemon writing the
protocol's events by hand: replies, SSE ids and resume, refusals, dead daemons, cancels,
and tenant isolation. The real daemon's end-to-end tests are in test_api_e2e.py."""
import http.client
import json
import socket
import threading
import time

import pytest

from tests.live_service import WebServer, echo, openai_client, redis_conn, wait_until
from wire import protocol

HELLO = [{"role": "user", "content": "Hi"}]


def chat(web, standin, key=None, **body):
    body = {"model": standin.model, "messages": HELLO, **body}
    return web.request("POST", "/v1/chat/completions", body, key or web.keys["owner"])


def frames(reply):
    """(id, payload) of each SSE event; payload is parsed JSON, or "[DONE]"."""
    return [(i, d if d == "[DONE]" else json.loads(d)) for i, d in reply.sse()]


def row(web, request_id, key=None):
    reply = web.request("GET", f"/v1/requests/{request_id}", key=key or web.keys["owner"])
    return reply.status, reply.json()


def test_non_streaming_chat_collects_the_tokens(web, standin):
    standin.serve(echo)
    reply = chat(web, standin)
    assert reply.status == 200
    body = reply.json()
    request_id = reply.header("X-Request-Id")
    assert body["id"] == f"chatcmpl-{request_id}" and body["object"] == "chat.completion"
    assert body["model"] == standin.model
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": "Hello world"},
                                "finish_reason": "stop", "logprobs": None}]
    assert body["usage"] == protocol.usage(5, 3, 2)  # the daemon's, as it is
    assert (body["usage"]["total_tokens"], body["usage"]["prompt_tokens_details"]["cached_tokens"]
            ) == (7, 3)


def test_streamed_completion_has_ids_usage_and_done(web, standin):
    standin.serve(echo)
    body = {"model": standin.model, "prompt": "Say hi", "stream": True,
            "stream_options": {"include_usage": True}}
    reply = web.request("POST", "/v1/completions", body, web.keys["owner"])
    assert reply.status == 200
    assert reply.header("Content-Type").startswith("text/event-stream")
    events = frames(reply)
    assert events[-1] == (None, "[DONE]")
    chunks = [payload for _, payload in events[:-1]]
    assert all(entry_id and entry_id.count("-") == 1 for entry_id, _ in events[:-1])
    assert [c["choices"][0]["text"] for c in chunks[:2]] == ["Hello", " world"]
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[3]["choices"] == [] and chunks[3]["usage"] == protocol.usage(5, 3, 2)
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks[:3])


def test_streamed_chat_starts_with_the_role(web, standin):
    standin.serve(echo)
    events = frames(chat(web, standin, stream=True))
    deltas = [payload["choices"][0]["delta"] for _, payload in events[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hello"},
                      {"content": " world"}, {}]


@pytest.fixture(scope="module")
def keepalive_web():
    """A web server whose SSE streams send a keep-alive after every idle second."""
    server = WebServer()
    server.env["SSE_KEEPALIVE_S"] = "1"
    server.start()
    yield server
    server.stop()


def pausing(standin, job):
    """One chunk, then silence for several keep-alive intervals (a daemon that paused, or
    one taking a dead one's request over), then the rest."""
    standin.accept(job)
    standin.emit(job.id, protocol.TOKEN, {"text": "Hello", "n_tokens": 1})
    time.sleep(3.5)
    standin.emit(job.id, protocol.TOKEN, {"text": " world", "n_tokens": 1})
    standin.finish(job)


def test_keep_alives_between_chunks_are_lone_comment_lines(keepalive_web, standin):
    standin.serve(pausing)
    body = {"model": standin.model, "prompt": "Say hi", "stream": True}
    reply = keepalive_web.request("POST", "/v1/completions", body, keepalive_web.keys["owner"])
    assert reply.status == 200
    lines = reply.response.read().decode().split("\n")
    reply.conn.close()
    first = next(i for i, line in enumerate(lines) if '"Hello"' in line)
    second = next(i for i, line in enumerate(lines) if '" world"' in line)
    between = lines[first + 1:second]
    assert ": keep-alive" in between  # the pause sent some (one per idle second)
    for i, line in enumerate(lines):
        if line == ": keep-alive":  # never followed by the blank line that ends an event
            assert lines[i + 1] != "", lines[i - 2:i + 3]


def test_the_openai_sdk_reads_a_stream_through_its_keep_alives(keepalive_web, standin):
    standin.serve(pausing)
    stream = openai_client(keepalive_web).completions.create(
        model=standin.model, prompt="Say hi", stream=True)
    chunks = list(stream)  # before: JSONDecodeError at the first keep-alive after a chunk
    assert [c.choices[0].text for c in chunks if c.choices] == ["Hello", " world", ""]
    assert chunks[-1].choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_queue_full_is_503_with_retry_after_even_when_streaming(web, standin, stream):
    def refuse(daemon, job):
        daemon.emit(job.id, protocol.ERROR, {"code": "queue_full", "status": 503,
                                             "message": "The queue is full (2 waiting)."})

    standin.serve(refuse)
    reply = chat(web, standin, stream=stream)
    assert reply.status == 503 and reply.header("Retry-After") == "1"
    assert reply.header("Content-Type") == "application/json"
    assert reply.json()["error"]["code"] == "queue_full"


def test_context_length_exceeded_is_400_with_the_numbers(web, standin):
    def refuse(daemon, job):
        daemon.emit(job.id, protocol.ERROR, {
            "code": "context_length_exceeded", "status": 400, "param": "messages",
            "message": "2100 prompt tokens + 10 max_tokens exceed the 2048-token limit",
            "prompt_tokens": 2100, "max_tokens": 10, "limit": 2048})

    standin.serve(refuse)
    error = chat(web, standin, stream=True).json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert (error["prompt_tokens"], error["max_tokens"], error["limit"]) == (2100, 10, 2048)
    assert error["type"] == "invalid_request_error"


def test_daemon_dying_mid_stream_ends_it_with_inference_interrupted(web, standin):
    def start_then_die(daemon, job):
        daemon.accept(job)
        daemon.emit(job.id, protocol.TOKEN, {"text": "Hel", "n_tokens": 1})
        daemon.die()

    standin.serve(start_then_die)
    reply = chat(web, standin, stream=True)
    request_id = reply.header("X-Request-Id")
    events = frames(reply)
    assert events[-1] == (None, "[DONE]")
    error = events[-2][1]["error"]
    assert error["code"] == "inference_interrupted" and error["type"] == "server_error"
    assert events[-2][0]  # the error is a stream entry too: a resume sees it
    status, body = row(web, request_id)
    assert (body["status"], body["error_code"]) == ("error", "inference_interrupted")
    assert body["finished"]


def test_non_streaming_request_whose_daemon_dies_gets_503(web, standin):
    def start_then_die(daemon, job):
        daemon.accept(job)
        daemon.die()

    standin.serve(start_then_die)
    reply = chat(web, standin)
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "inference_interrupted"


def test_daemon_dying_before_it_answers_is_503(web, standin):
    standin.serve(lambda daemon, job: daemon.die())  # takes the job, never answers
    reply = chat(web, standin, stream=True)
    assert reply.status == 503
    assert reply.json()["error"]["code"] == "scheduler_unavailable"


def test_client_leaving_mid_stream_leaves_its_request_to_the_grace(web, standin):
    finished = threading.Event()

    def slow(daemon, job):
        daemon.accept(job)
        daemon.emit(job.id, protocol.TOKEN, {"text": "Hel", "n_tokens": 1})
        wait_until(lambda: daemon.is_cancelled(job.id) or finished.is_set(), timeout_s=20)
        daemon.finish(job, reason="cancelled")

    standin.serve(slow)
    reply = chat(web, standin, stream=True)
    request_id = reply.header("X-Request-Id")
    stream = reply.sse()
    next(stream), next(stream)  # the role chunk and the first token
    assert redis_conn().exists(protocol.watch_key(request_id))  # watched while read
    reply.close()
    try:
        # no more renewals: the key expires RESUME_GRACE_S later, and a real daemon cancels
        # the request then (tests/chaos/test_resume_grace.py); the web cancels nothing
        wait_until(lambda: not redis_conn().exists(protocol.watch_key(request_id)), 20)
        assert not standin.is_cancelled(request_id)
    finally:
        finished.set()


def test_client_leaving_a_non_streaming_request_leaves_it_to_the_grace(web, standin):
    accepted: list[str] = []

    def accept_only(daemon, job):
        daemon.accept(job)
        accepted.append(job.id)

    standin.serve(accept_only)
    conn = http.client.HTTPConnection("127.0.0.1", web.port, timeout=10)
    conn.request("POST", "/v1/chat/completions",
                 json.dumps({"model": standin.model, "messages": HELLO}),
                 {"Authorization": f"Bearer {web.keys['owner']}"})
    wait_until(lambda: accepted, timeout_s=5)
    # the view is waiting for tokens: its reader watches the request
    wait_until(lambda: redis_conn().exists(protocol.watch_key(accepted[0])), timeout_s=5)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    wait_until(lambda: not redis_conn().exists(protocol.watch_key(accepted[0])), 20)
    assert not standin.is_cancelled(accepted[0])


def test_resume_after_last_event_id_without_duplicates(web, standin):
    standin.serve(echo)
    reply = chat(web, standin, stream=True)
    request_id = reply.header("X-Request-Id")
    first = frames(reply)
    ids = [entry_id for entry_id, _ in first[:-1]]
    path = f"/v1/requests/{request_id}/events"
    resumed = frames(web.request("GET", path, key=web.keys["member"],
                                 headers={"Last-Event-ID": ids[1]}))
    assert resumed == first[2:]
    by_query = frames(web.request("GET", f"{path}?last_event_id={ids[0]}", key=web.keys["owner"]))
    assert by_query == first[1:]
    assert frames(web.request("GET", path, key=web.keys["owner"])) == first
    at_end = frames(web.request("GET", path, key=web.keys["owner"],
                                headers={"Last-Event-ID": ids[-1]}))
    assert at_end == [(None, "[DONE]")]


def test_resume_follows_a_request_still_running(web, standin):
    go_on = threading.Event()

    def two_parts(daemon, job):
        daemon.accept(job)
        daemon.emit(job.id, protocol.TOKEN, {"text": "one", "n_tokens": 1})
        go_on.wait(10)
        daemon.emit(job.id, protocol.TOKEN, {"text": " two", "n_tokens": 1})
        daemon.finish(job)

    standin.serve(two_parts)
    reply = chat(web, standin, stream=True)
    request_id = reply.header("X-Request-Id")
    stream = reply.sse()
    next(stream)
    token_id, _ = next(stream)
    resumed = web.request("GET", f"/v1/requests/{request_id}/events", key=web.keys["owner"],
                          headers={"Last-Event-ID": token_id})
    go_on.set()
    texts = [p["choices"][0]["delta"].get("content") for _, p in frames(resumed)[:-1]]
    assert texts == [" two", None]
    list(stream)


def test_other_tenant_cannot_read_resume_or_cancel(web, standin):
    standin.serve(echo)
    reply = chat(web, standin)
    request_id = reply.header("X-Request-Id")
    reply.json()
    outsider = web.keys["outsider"]
    for method, path in (("GET", f"/v1/requests/{request_id}"),
                         ("GET", f"/v1/requests/{request_id}/events"),
                         ("POST", f"/v1/requests/{request_id}/cancel")):
        answer = web.request(method, path, key=outsider)
        assert answer.status == 404, path
        assert answer.json()["error"]["code"] == "not_found"
    assert not standin.is_cancelled(request_id)


def test_explicit_cancel_by_the_owner(web, standin):
    standin.serve(lambda daemon, job: daemon.accept(job))
    reply = chat(web, standin, stream=True)
    request_id = reply.header("X-Request-Id")
    answer = web.request("POST", f"/v1/requests/{request_id}/cancel", key=web.keys["member"])
    assert answer.status == 200
    assert answer.json()["cancel_requested"] is True
    assert standin.is_cancelled(request_id)
    reply.close()


def test_health_and_models_show_live_daemons(web, standin):
    public = web.request("GET", "/v1/health").json()  # anyone: which models are up
    assert public["status"] == "ok" and public["model_status"][standin.model] == "up"
    assert standin.daemon_id not in json.dumps(public) and "daemons" not in public
    health = web.request("GET", "/v1/health", key=web.keys["member"]).json()
    assert health["status"] == "ok" and health["scheduler"] == "ok"
    mine = next(d for d in health["daemons"] if d["daemon_id"] == standin.daemon_id)
    assert mine["slots_total"] == 1 and mine["queue_depth"] == 0
    assert "request_id" not in json.dumps(health) and "cache_scope" not in json.dumps(health)
    models = web.request("GET", "/v1/models", key=web.keys["owner"]).json()
    assert standin.model in [m["id"] for m in models["data"]]
    one = web.request("GET", f"/v1/models/{standin.model}", key=web.keys["owner"]).json()
    assert one["id"] == standin.model and one["object"] == "model"
    assert web.request("GET", "/v1/models").status == 401


def test_curl_style_form_content_type_is_read_as_json(web, standin):
    """curl -d sends application/x-www-form-urlencoded; the body is JSON all the same."""
    standin.serve(echo)
    reply = web.request("POST", "/v1/chat/completions",
                        {"model": standin.model, "messages": HELLO}, web.keys["owner"],
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert reply.status == 200
    assert reply.json()["choices"][0]["message"]["content"] == "Hello world"
