"""Input the web refuses, in the API's error shape, before it can hurt anything (issue #12):
text that is not valid Unicode, NUL characters bound for the database, prompts over
MAX_PROMPT_BYTES, bodies too big / too deep / not UTF-8, dates at the end of the calendar,
malformed Last-Event-IDs, a client-sent Daphne-Root-Path, bad ids in admin actions.

Run against SQLite by default; run with DATABASE_URL=postgres://... for the NUL cases'
real target (PostgreSQL text cannot hold NUL): those tests commit (``transaction=True``),
so the async views' database thread sees their tenants on PostgreSQL too.
"""
import json
import time
import uuid

import pytest
from asgiref.testing import ApplicationCommunicator
from django.contrib.auth.models import User
from django.test import Client
from django.utils import timezone

from accounts.authentication import authenticate_key
from inference import service
from inference.models import InferenceRequest
from tests.conftest import bearer
from tests.live_service import StandIn
from wire import protocol
from wire.errors import InvalidParameter
from wire.messages import parse_messages
from wire.sampling import SamplingParams

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]
LONE = "hi \ud800 there"  # json.dumps writes it as the escape "\ud800", as a client would


def post(api, path, body, key, raw=False, **extra):
    data = body if raw else json.dumps(body)
    return api.generic("POST", path, data, content_type="application/json", **bearer(key),
                       **extra)


def error_of(response, status=400):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.fixture
def standin():
    """A live stand-in daemon: its model is served, so a request gets as far as the
    database row and the queue (it never answers)."""
    daemon = StandIn().start()
    yield daemon
    daemon.stop()


# -- 1. text is valid Unicode; no NUL where the database stores it; prompt size ----------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, {"prompt": LONE}, "prompt"),
        (COMPLETIONS, {"prompt": [LONE]}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": LONE}]}, "messages[0].content"),
        (CHAT, {"messages": [*HELLO, {"role": "user", "content": [
            {"type": "text", "text": "fine"}, {"type": "text", "text": LONE}]}]},
         "messages[1].content[1].text"),
        (CHAT, {"messages": HELLO, "stop": LONE}, "stop"),
        (CHAT, {"messages": HELLO, "stop": ["ok", LONE]}, "stop"),
        (COMPLETIONS, {"prompt": "x", "stop": "\udc00"}, "stop"),
        (CHAT, {"messages": HELLO, "session": LONE}, "session"),
        (CHAT, {"messages": HELLO, "user": LONE}, "user"),
        (CHAT, {"messages": HELLO, "session": "s", "user": LONE}, "user"),
        (CHAT, {"messages": HELLO, "model": LONE}, "model"),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(api, parties, standin, path, body, param):
    body = {"model": standin.model, **body}
    error = error_of(post(api, path, body, parties.owner))
    assert (error["param"], error["code"]) == (param, "invalid_request_error")
    assert "Unicode" in error["message"]
    assert not InferenceRequest.objects.exists()


def test_the_daemons_own_checks_refuse_surrogates_too():
    """The daemon runs the same checks (sampling, chat) on what it takes from Redis."""
    with pytest.raises(InvalidParameter) as refused:
        SamplingParams.from_dict({"stop": ["a", "\ud800"]})
    assert refused.value.param == "stop"
    with pytest.raises(InvalidParameter) as refused:
        parse_messages([{"role": "user", "content": "\udfff"}])
    assert refused.value.param == "messages[0].content"
    with pytest.raises(InvalidParameter) as refused:
        parse_messages([{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}])
    assert refused.value.param == "messages[0].content[0].text"
    # whole surrogate pairs arrive as one character: real emoji are fine
    assert parse_messages([{"role": "user", "content": "\U0001f600"}]) == [
        ("user", "\U0001f600")]
    assert SamplingParams.from_dict({"stop": "\U0001f600"}).stop == ("\U0001f600",)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("field", ["session", "user"])
def test_nul_in_session_or_user_is_400_not_a_database_error(api, parties, standin, field,
                                                             settings):
    settings.ACCEPT_TIMEOUT_S = 0.2  # a request that passes would wait for the stand-in
    body = {"model": standin.model, "messages": HELLO, field: "ab\x00cd"}
    error = error_of(post(api, CHAT, body, parties.owner))
    assert (error["param"], error["code"]) == (field, "invalid_request_error")
    assert not InferenceRequest.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_nul_in_an_api_key_prefix_is_401_not_a_database_error(api, parties):
    prefix, secret = parties.owner.removeprefix("sk-").split(".", 1)
    for key in ("sk-" + "\x00" * 10 + ".secret", "sk-abc\x00defghi.secret",
                "sk-" + "²" * 10 + ".secret", f"sk-{prefix}.{secret}\x00"):
        assert authenticate_key(key) is None
        response = api.get("/v1/requests", **bearer(key))
        assert error_of(response, 401)["code"] == "invalid_api_key"
    # over a websocket the key arrives as JSON text: a surrogate has no bytes to hash
    for key in (f"sk-{prefix}.{secret}\ud800", ["sk-"], None):
        assert authenticate_key(key) is None
    assert authenticate_key(parties.owner) is not None


def test_a_prompt_over_max_prompt_bytes_is_refused_before_the_queue(api, parties, standin,
                                                                     settings):
    settings.MAX_PROMPT_BYTES = 100
    settings.ACCEPT_TIMEOUT_S = 0.2
    over = "é" * 51  # 51 characters, 102 bytes: the limit counts UTF-8 bytes
    for path, body, param in (
        (COMPLETIONS, {"prompt": over}, "prompt"),
        (COMPLETIONS, {"prompt": [over]}, "prompt"),
        (CHAT, {"messages": [{"role": "system", "content": "a" * 60},
                             {"role": "user", "content": [{"type": "text", "text": "b" * 41}]}]},
         "messages"),
    ):
        error = error_of(post(api, path, {"model": standin.model, **body}, parties.owner))
        assert (error["param"], error["code"]) == (param, "context_length_exceeded")
        assert error["max_prompt_bytes"] == 100 and error["prompt_bytes"] > 100
        assert "100 bytes" in error["message"]
    assert not InferenceRequest.objects.exists()
    # at the limit: accepted (queued; the stand-in never answers, so 503 after the wait)
    response = post(api, COMPLETIONS, {"model": standin.model, "prompt": "é" * 50},
                    parties.owner)
    assert error_of(response, 503)["code"] == "scheduler_unavailable"


# -- 2. every body error is a 400 in the API's shape ---------------------------------------------


def test_a_body_over_the_upload_limit_is_a_json_400(api, parties, settings):
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 1000
    body = json.dumps({"prompt": "x" * 2000})
    error = error_of(post(api, COMPLETIONS, body, parties.owner, raw=True))
    assert error["code"] == "request_too_large" and "1000 bytes" in error["message"]


@pytest.mark.parametrize(
    "raw",
    [
        b"[" * 5000 + b"]" * 5000,  # RecursionError inside json
        ('{"messages": [{"role": "user", "content": "hi"}], "metadata": '
         + '{"a": ' * 80 + "1" + "}" * 80 + "}").encode(),  # parses, but deeper than allowed
        b'{"prompt": "caf\xe9"}',  # Latin-1, not UTF-8
        b'{"prompt": "\xed\xa0\x80"}',  # a surrogate encoded as bytes: not UTF-8 either
        b'{"prompt": "x", "metadata": NaN}',  # not JSON
        b'{"prompt": "x", "temperature": Infinity}',
        b"",
    ],
    ids=["5000-deep", "80-deep", "latin-1", "utf-8-surrogate", "nan", "infinity", "empty"],
)
def test_bodies_that_are_not_acceptable_json_are_parse_errors(api, parties, raw):
    for path in (CHAT, COMPLETIONS):
        error = error_of(post(api, path, raw, parties.owner, raw=True))
        assert error["code"] in ("parse_error", "invalid_request_error")
        if raw:
            assert error["code"] == "parse_error"


@pytest.mark.parametrize(
    "query, param",
    [
        ("start=9999-12-31", "start"),
        ("start=9999-11-01&end=9999-12-31", "end"),
        ("end=9999-12-31", "end"),
        ("start=2024-02-30", "start"),
        ("start=2024-13-01", "start"),
        ("start=0000-01-01", "start"),
        ("start=yesterday", "start"),
        ("start=2024-01-01%00", "start"),
        ("start=", "start"),
    ],
)
def test_bad_usage_dates_are_400_naming_them(api, parties, query, param):
    error = error_of(api.get(f"/v1/usage?{query}", **bearer(parties.owner)))
    assert error["param"] == param


def test_the_first_and_last_usable_days_answer(api, parties):
    for query in ("start=0001-01-01", "start=9999-10-31&end=9999-11-30"):
        response = api.get(f"/v1/usage?{query}", **bearer(parties.owner))
        assert response.status_code == 200, response.content


# -- 3. Last-Event-ID -------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0-0", "1-0", "1712345678901-12", "18446744073709551615-0",
                                   "0-18446744073709551615"])
def test_event_ids_that_are_stream_ids(value):
    assert service.is_event_id(value)


@pytest.mark.parametrize("value", [
    "1-0\n", "\n1-0", "1-0 ", "1 -0", "-1-0", "1-", "-0", "1", "1-0-0", "",
    "\u0661-\u0660",  # Arabic-Indic digits: str.isdigit and re's \d take them
    "\uff11-\uff10",  # fullwidth digits
    "1" * 21 + "-0", "0-" + "1" * 21,  # longer than 20 digits
    "18446744073709551616-0",  # 2**64
    None, 1, ["1-0"],
])
def test_event_ids_that_are_not(value):
    assert not service.is_event_id(value)


@pytest.fixture
def finished_row(parties):
    """A finished request of tenant A whose events have expired (its stream is gone)."""
    return InferenceRequest.objects.create(
        tenant=parties.a, kind=InferenceRequest.Kind.CHAT, model="m",
        status=InferenceRequest.Status.DONE, finished=timezone.now())


@pytest.mark.parametrize("query, header", [
    ("?last_event_id=1-0%0A", None),
    ("?last_event_id=%D9%A1-%D9%A0", None),
    ("?last_event_id=" + "9" * 25 + "-0", None),
    ("", "1-0\n"),
    ("", "\uff11-0"),
])
def test_bad_last_event_ids_are_400_before_anything_is_read(api, parties, finished_row,
                                                            query, header):
    extra = {"HTTP_LAST_EVENT_ID": header} if header else {}
    response = api.get(f"/v1/requests/{finished_row.id}/events{query}",
                       **bearer(parties.owner), **extra)
    error = error_of(response)
    assert (error["param"], error["code"]) == ("last_event_id", "invalid_request_error")
    # a good id gets as far as the stream: long gone here
    response = api.get(f"/v1/requests/{finished_row.id}/events?last_event_id=1-0",
                       **bearer(parties.owner))
    assert error_of(response, 404)["code"] == "events_expired"


# -- 4. Daphne-Root-Path from a client is ignored -----------------------------------------------


async def asgi_get(path: str, root_path: str, headers=()) -> tuple[int, bytes]:
    """One GET through config.asgi.application with the scope daphne would build."""
    from config.asgi import application

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
        "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": root_path,
        "query_string": b"", "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
    }
    app = ApplicationCommunicator(application, scope)
    await app.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await app.receive_output(timeout=20)
    body = b""
    while True:
        message = await app.receive_output(timeout=20)
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    await app.wait(timeout=5)
    return start["status"], body


@pytest.mark.asyncio
async def test_a_root_path_from_the_client_is_ignored():
    """daphne puts a client's Daphne-Root-Path header in the scope's root_path: with it,
    /v1/admin/ reached the admin through the API's handler (a 500)."""
    status, body = await asgi_get("/v1/admin/", "/v1")
    assert status == 404, body[:300]
    assert json.loads(body)["error"]["code"] == "not_found"
    status, body = await asgi_get("/v1/health", "/v1")
    assert status == 200 and json.loads(body)["status"]


@pytest.mark.asyncio
async def test_root_path_setting_and_a_trusted_proxy(settings):
    settings.ROOT_PATH = "/llm"
    status, body = await asgi_get("/llm/v1/health", "/client-chosen")
    assert status == 200 and json.loads(body)["status"]
    status, body = await asgi_get("/llm/v1/nowhere", "")
    assert status == 404 and json.loads(body)["error"]["code"] == "not_found"
    settings.ROOT_PATH, settings.TRUST_ROOT_PATH_HEADER = "", True
    status, body = await asgi_get("/proxy/v1/health", "/proxy")
    assert status == 200 and json.loads(body)["status"]


@pytest.mark.slow
def test_real_daphne_ignores_a_client_root_path_header(web):
    """(Through the door, which also drops the header: a key gets the request to daphne.)"""
    reply = web.request("GET", "/v1/admin/", key=web.keys["owner"],
                        headers={"Daphne-Root-Path": "/v1"})
    assert reply.status == 404, web.log_tail()
    assert reply.json()["error"]["code"] == "not_found"
    reply = web.request("GET", "/v1/models", key=web.keys["owner"],
                        headers={"Daphne-Root-Path": "/v1"})
    assert reply.status == 200, web.log_tail()


# -- 5. admin actions validate ids -----------------------------------------------------------------


@pytest.fixture
def staff(db) -> Client:
    client = Client()
    client.force_login(User.objects.create_superuser("ops-hardening", "ops@example.com", "pw"))
    return client


@pytest.mark.parametrize("tenant_id", ["²", "١", "1\x00", "-1", "1.0", " 1", "9" * 40, ""])
def test_evict_with_a_malformed_tenant_id_is_refused(staff, standin, redis_client, parties,
                                                     tenant_id):
    response = staff.post("/admin/live/action", {
        "action": "evict_scope", "daemon_id": standin.daemon_id, "tenant_id": tenant_id})
    assert response.status_code == 400, response.content[:300]
    assert response.json()["ok"] is False
    assert not redis_client.exists(protocol.control_stream(standin.daemon_id))
    response = staff.post("/admin/live/action", {
        "action": "evict_scope", "daemon_id": standin.daemon_id, "tenant_id": str(parties.a.pk)})
    assert response.status_code == 200 and response.json()["ok"] is True
    redis_client.delete(protocol.control_stream(standin.daemon_id))


@pytest.mark.parametrize("request_id", ["\u0661" * 32, "\x00", "{" + "0" * 32])
def test_cancel_with_a_malformed_request_id_is_refused(staff, standin, request_id):
    response = staff.post("/admin/live/action", {"action": "cancel", "request_id": request_id})
    assert response.status_code == 400 and response.json()["ok"] is False


def test_live_state_skips_scopes_that_are_not_tenant_ids(staff, redis_client, parties):
    daemon_id, now = f"hardening-{uuid.uuid4().hex[:6]}", time.time()
    snap = {"daemon_id": daemon_id, "model": "m", "heartbeat_at": now, "started_at": now,
            "slots": [{"id": 0, "state": "idle", "cache_scope": "²"}],
            "queue": [{"request_id": str(uuid.uuid4()), "cache_scope": str(parties.a.pk)}]}
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: now})
    try:
        response = staff.get("/admin/live/state.json")
        assert response.status_code == 200, response.content[:300]
        state = response.json()
    finally:
        redis_client.delete(protocol.daemon_key(daemon_id))
        redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)
    assert [s["tenant"] for s in state["slots"] if s["daemon_id"] == daemon_id] == ["²"]
    assert [q["tenant"] for q in state["queue"] if q["daemon_id"] == daemon_id] == ["Alpha"]


# -- other query strings and headers -----------------------------------------------------------


def test_a_forged_history_cursor_is_404_not_500(api, parties):
    import base64

    for position in ("not-a-date", "2024-13-45 00:00:00", "\x00"):
        token = base64.b64encode(f"p={position}".encode()).decode()
        response = api.get("/v1/requests", {"cursor": token}, **bearer(parties.owner))
        assert error_of(response, 404)["code"] == "not_found"


def test_a_disallowed_host_under_v1_is_a_json_400(api, settings):
    settings.ALLOWED_HOSTS = ["testserver"]
    response = api.get("/v1/health", HTTP_HOST="evil.example")
    assert error_of(response)["code"] == "invalid_request_error"


@pytest.mark.asyncio
async def test_static_files_are_served_with_debug_off(settings):
    """DEBUG is off by default now: daphne still serves the admin's CSS (SERVE_STATIC)."""
    assert settings.DEBUG is False  # pytest-django's default, and the setting's
    status, body = await asgi_get("/static/admin/css/base.css", "")
    assert status == 200 and b"{" in body
