"""The web's side of deadlines and idempotent retries, in process (no model): the ``timeout``
field and the ``Idempotency-Key`` header are checked like every byte a client sends, the
job carries its deadline (capped by REQUEST_TIMEOUT_S), a request that never ran gives its
key back, and the OpenAPI schema shows both. The real-daemon cases are in tests/chaos/."""
import hashlib
import json
import time

import pytest
from django.test import Client

from inference import idempotency
from inference.models import InferenceRequest
from tests.conftest import bearer
from tests.live_service import redis_conn
from wire import protocol

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]


def post(api, path, body, key, raw=False, **headers):
    data = body if raw else json.dumps(body)
    return api.generic("POST", path, data, content_type="application/json", **bearer(key),
                       **headers)


def error_of(response, status=400):
    assert response.status_code == status, response.content
    return response.json()["error"]


def redis_key(tenant_id, key: str) -> str:
    return protocol.idempotency_key(str(tenant_id), hashlib.sha256(key.encode()).hexdigest())


@pytest.mark.parametrize("value", [0, -1, "5", True, [1], {"s": 1}, -0.0])
def test_a_bad_timeout_is_400_naming_it(api, parties, value):
    error = error_of(post(api, CHAT, {"messages": HELLO, "timeout": value}, parties.owner))
    assert (error["param"], error["code"]) == ("timeout", "invalid_request_error")
    assert not InferenceRequest.objects.exists()


def test_an_infinite_or_huge_timeout_is_refused_or_capped_never_a_500(api, parties):
    body = b'{"messages": [{"role": "user", "content": "Hi"}], "timeout": 1e999}'  # inf
    assert error_of(post(api, CHAT, body, parties.owner, raw=True))["param"] == "timeout"


def test_the_job_carries_the_deadline_capped_by_the_server(api, parties, standin, settings):
    settings.ACCEPT_TIMEOUT_S = 0.3  # the stand-in never answers: 503 after the wait
    settings.REQUEST_TIMEOUT_S = 100.0
    for timeout, expected in ((5, 5), (2.5, 2.5), (10**400, 100), (None, 100)):
        body = {"model": standin.model, "prompt": "x"}
        if timeout is not None:
            body["timeout"] = timeout
        before = time.time()
        assert post(api, COMPLETIONS, body, parties.owner).status_code == 503
        job = standin.next_job(timeout_s=2)
        assert before + expected <= job.deadline <= time.time() + expected
        assert job.retention_s == settings.STREAM_RETENTION_S  # no Idempotency-Key: the default


@pytest.mark.parametrize("value", ["", " a", "a ", "x" * 256, "a\tb", "\x7f", "\u00e9t\u00e9",
                                   "a\x00b"])
def test_a_bad_idempotency_key_is_400_and_nothing_runs(api, parties, standin, value):
    body = {"model": standin.model, "messages": HELLO}
    response = post(api, CHAT, body, parties.owner, HTTP_IDEMPOTENCY_KEY=value)
    error = error_of(response)
    assert (error["param"], error["code"]) == ("Idempotency-Key", "invalid_request_error")
    assert not InferenceRequest.objects.exists()


def test_a_request_that_never_ran_gives_its_key_back(api, parties, standin, settings):
    settings.ACCEPT_TIMEOUT_S = 0.3
    key = "order-42 " + "x" * 246  # 255 characters, an inner space: valid
    body = {"model": standin.model, "messages": HELLO}
    response = post(api, CHAT, body, parties.owner, HTTP_IDEMPOTENCY_KEY=key)
    assert error_of(response, 503)["code"] == "scheduler_unavailable"  # queued, never taken
    job = standin.next_job(timeout_s=2)
    assert job.retention_s == protocol.IDEMPOTENCY_TTL_S  # kept as long as the key
    assert not redis_conn().exists(redis_key(parties.a.id, key))
    # so the key is free: another body under it runs (here: is queued) instead of a 409
    other = {**body, "max_tokens": 3}
    response = post(api, CHAT, other, parties.owner, HTTP_IDEMPOTENCY_KEY=key)
    assert error_of(response, 503)["code"] == "scheduler_unavailable"
    assert standin.next_job(timeout_s=2).id != job.id


def test_a_held_key_with_another_body_is_409_and_with_the_same_body_waits_for_it(
        api, parties, standin, settings):
    """The key of a request another web process is running (its claim written by hand)."""
    settings.ACCEPT_TIMEOUT_S = 0.3
    key = "k-409"
    body = {"model": standin.model, "messages": HELLO}
    record = json.dumps({"request_id": "00000000-0000-4000-8000-000000000000",
                         "body": idempotency.body_digest("chat", body)})
    r = redis_conn()
    r.set(redis_key(parties.a.id, key), record, ex=60)
    try:
        response = post(api, CHAT, {**body, "max_tokens": 3}, parties.owner,
                        HTTP_IDEMPOTENCY_KEY=key)
        error = error_of(response, 409)
        assert (error["code"], error["param"]) == ("idempotency_key_reused", "Idempotency-Key")
        response = post(api, COMPLETIONS, {"model": standin.model, "prompt": "Hi"},
                        parties.owner, HTTP_IDEMPOTENCY_KEY=key)  # another endpoint: another body
        assert error_of(response, 409)["code"] == "idempotency_key_reused"
        # another tenant's same key is its own
        response = post(api, CHAT, {**body, "max_tokens": 3}, parties.outsider,
                        HTTP_IDEMPOTENCY_KEY=key)
        assert error_of(response, 503)["code"] == "scheduler_unavailable"
        # the same body: a replay of a request that never records a row is a stale claim,
        # given up after ACCEPT_TIMEOUT_S: this request then runs under the key itself
        response = post(api, CHAT, body, parties.owner, HTTP_IDEMPOTENCY_KEY=key)
        assert error_of(response, 503)["code"] == "scheduler_unavailable"
        assert r.get(redis_key(parties.a.id, key)) is None  # and gave it back, never ran
    finally:
        r.delete(redis_key(parties.a.id, key))
    assert not InferenceRequest.objects.filter(id="00000000-0000-4000-8000-000000000000").exists()


def test_the_body_digest_ignores_spelling_not_content():
    a = idempotency.body_digest("chat", json.loads('{"a": 1, "b": [1, 2]}'))
    assert a == idempotency.body_digest("chat", json.loads('{"b":[1,2],"a":1}'))
    assert a != idempotency.body_digest("completion", {"a": 1, "b": [1, 2]})
    assert a != idempotency.body_digest("chat", {"a": 1, "b": [2, 1]})


@pytest.mark.django_db
def test_the_schema_shows_the_header_the_409_and_the_timeout():
    schema = Client().get("/v1/openapi.json").json()
    for path, body in (("/v1/completions", "CompletionRequest"),
                       ("/v1/chat/completions", "ChatCompletionRequest")):
        op = schema["paths"][path]["post"]
        header = next(p for p in op["parameters"] if p["name"] == "Idempotency-Key")
        assert header["in"] == "header"
        assert header["schema"]["maxLength"] == idempotency.MAX_KEY_CHARS
        assert "409" in op["responses"] and "504" in op["responses"]
        timeout = schema["components"]["schemas"][body]["properties"]["timeout"]
        assert timeout["type"] == "number" and timeout["exclusiveMinimum"] is True
