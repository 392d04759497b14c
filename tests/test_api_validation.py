"""The completion endpoints refuse bad requests before anything is queued (no daemon needed).

Every refusal is OpenAI's error shape; a bad field is a 400 naming it.
"""
import json
import uuid

import pytest

from inference.models import InferenceRequest
from tests.conftest import bearer
from tests.live_service import StandIn, redis_conn
from wire import protocol

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "Hi"}]


def post(api, path, body, key, raw=False):
    data = body if raw else json.dumps(body)
    return api.generic("POST", path, data, content_type="application/json", **bearer(key))


def error_of(response, status=400):
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.fixture
def standin():
    """A live stand-in daemon, so the model is known; it never answers (no job is sent)."""
    daemon = StandIn().start()
    yield daemon
    daemon.stop()


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"messages": HELLO, "temperature": "hot"}, "temperature", "invalid_request_error"),
        ({"messages": HELLO, "temperature": 9}, "temperature", "invalid_request_error"),
        ({"messages": HELLO, "top_p": 2}, "top_p", "invalid_request_error"),
        ({"messages": HELLO, "max_tokens": 0}, "max_tokens", "invalid_request_error"),
        ({"messages": HELLO, "max_completion_tokens": "x"}, "max_completion_tokens",
         "invalid_request_error"),
        ({"messages": HELLO, "stop": [1]}, "stop", "invalid_request_error"),
        ({"messages": HELLO, "logit_bias": {"x": 1}}, "logit_bias", "invalid_request_error"),
        ({"messages": HELLO, "seed": -1}, "seed", "invalid_request_error"),
        ({"messages": HELLO, "stream": "yes"}, "stream", "invalid_request_error"),
        ({"messages": HELLO, "n": 9}, "n", "invalid_request_error"),
        ({"messages": HELLO, "cache_prompt": 1}, "cache_prompt", "invalid_request_error"),
        ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format",
         "invalid_request_error"),
        ({"messages": HELLO, "frobnicate": True}, "frobnicate", "unknown_parameter"),
        ({"messages": HELLO, "logprobs": 3}, "logprobs", "invalid_request_error"),
        ({"messages": HELLO, "top_logprobs": 2}, "top_logprobs", "invalid_request_error"),
        ({"messages": HELLO, "tools": [{"type": "function"}]}, "tools[0].function",
         "invalid_request_error"),
        ({"messages": HELLO, "functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
        ({"messages": []}, "messages", "invalid_request_error"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "invalid_request_error"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
         "invalid_request_error"),
        ({}, "messages", "missing_required_parameter"),
        ({"messages": HELLO, "model": 7}, "model", "invalid_request_error"),
        ({"messages": HELLO, "prompt": "x"}, "prompt", "unknown_parameter"),
    ],
)
def test_chat_bad_fields_name_the_field(api, parties, body, param, code):
    error = error_of(post(api, CHAT, body, parties.owner))
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error")


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"prompt": ""}, "prompt", "empty_prompt"),
        ({"prompt": []}, "prompt", "empty_prompt"),
        ({"prompt": ["a", 7]}, "prompt", "invalid_request_error"),
        ({"prompt": ["a", ""]}, "prompt[1]", "invalid_request_error"),
        ({"prompt": [1, -2]}, "prompt", "invalid_request_error"),
        ({"prompt": None}, "prompt", "missing_required_parameter"),
        ({"prompt": "x", "echo": 1}, "echo", "invalid_request_error"),
        ({"prompt": "x", "echo": True, "logprobs": 2}, "echo", "unsupported_parameter"),
        ({"prompt": "x", "messages": HELLO}, "messages", "unknown_parameter"),
        ({"prompt": "x", "min_p": -1}, "min_p", "invalid_request_error"),
        ({"prompt": "x", "grammar": "root ::= x", "json_schema": {}}, "grammar",
         "invalid_request_error"),
    ],
)
def test_completion_bad_fields_name_the_field(api, parties, body, param, code):
    error = error_of(post(api, COMPLETIONS, body, parties.owner))
    assert (error["param"], error["code"]) == (param, code)


def test_bad_json_and_non_object_body(api, parties):
    error = error_of(post(api, CHAT, b"{not json", parties.owner, raw=True))
    assert error["code"] == "parse_error"
    error = error_of(post(api, CHAT, [1, 2], parties.owner))
    assert error["param"] is None


def test_no_key_and_bad_key_are_401(api, parties):
    response = api.post(CHAT, {"messages": HELLO}, format="json")
    assert error_of(response, 401)["code"] == "invalid_api_key"
    response = post(api, CHAT, {"messages": HELLO}, "sk-nope.nope")
    assert error_of(response, 401)["code"] == "invalid_api_key"


def test_wrong_method_is_405(api, parties):
    response = api.get(CHAT, **bearer(parties.owner))
    assert error_of(response, 405)["code"] == "method_not_allowed"


def test_unknown_model_is_404_naming_model(api, parties, standin):
    """OpenAI answers an unknown model 404 ``model_not_found``."""
    error = error_of(post(api, CHAT, {"model": "gpt-9", "messages": HELLO}, parties.owner), 404)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert error["message"] == "The model 'gpt-9' does not exist."


def test_no_live_daemon_is_503_and_nothing_is_queued(api, parties, settings):
    model = f"nobody-serves-{uuid.uuid4().hex[:6]}"
    settings.MODELS = [model]
    for path, body in ((CHAT, {"messages": HELLO}), (COMPLETIONS, {"prompt": "x"})):
        response = post(api, path, {"model": model, **body}, parties.owner)
        assert error_of(response, 503)["code"] == "scheduler_unavailable"
        assert response["Retry-After"]
    assert not redis_conn().exists(protocol.jobs_stream(model))
    assert not InferenceRequest.objects.exists()


def test_valid_request_is_queued_with_the_tenant_as_cache_scope(api, parties, standin, settings):
    """Checked at the web, then queued as documented; a client-sent cache_scope is ignored."""
    settings.ACCEPT_TIMEOUT_S = 0.5  # the stand-in never answers: 503 after the wait
    body = {
        "model": standin.model, "messages": HELLO, "cache_scope": "someone-else", "user": "u-1",
        "max_completion_tokens": 5, "logprobs": False, "stream_options": {"include_usage": True},
        "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
        "top_k": 3, "min_p": 0.1, "repeat_penalty": 1.1, "ignore_eos": True, "seed": 4,
        "stop": "\n", "logit_bias": {"5": -1}, "cache_prompt": False,
    }
    response = post(api, CHAT, body, parties.owner)
    assert error_of(response, 503)["code"] == "scheduler_unavailable"
    job = standin.next_job(timeout_s=2)
    assert job.kind == "chat" and job.model == standin.model
    assert job.cache_scope == job.tenant_id == str(parties.a.id)
    assert job.session == "u-1" and job.cache_prompt is False
    assert job.messages == HELLO
    assert job.params == {"max_tokens": 5, "json_schema": {"type": "object"}, "top_k": 3,
                          "min_p": 0.1, "repeat_penalty": 1.1, "ignore_eos": True, "seed": 4,
                          "stop": "\n", "logit_bias": {"5": -1}}
    row = InferenceRequest.objects.get(id=job.id)
    assert (row.tenant, row.api_key, row.kind, row.session) == (parties.a, parties.owner_key,
                                                                "chat", "u-1")
    assert (row.status, row.error_code) == ("error", "scheduler_unavailable")
    assert standin.is_cancelled(job.id)  # a daemon that comes later must not run it
