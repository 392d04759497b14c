"""Every API error leaves in OpenAI's shape, with a code of the one table (wire.errors)."""

import pytest
from django.http import Http404
from rest_framework import exceptions, serializers

from inference.errors import ApiError, exception_handler, invalid
from wire.errors import CODES


def handle(exc: Exception):
    response = exception_handler(exc, {})
    assert set(response.data) == {"error"}
    assert {"message", "type", "param", "code"} <= set(response.data["error"])
    assert response.data["error"]["code"] in CODES
    return response


def test_validation_error_names_the_field():
    response = handle(exceptions.ValidationError({"max_tokens": ["Must be positive."]}))
    assert response.status_code == 400
    assert response.data["error"] == {
        "message": "Must be positive.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "invalid_request_error",
    }


def test_validation_error_keeps_a_code_of_the_table_and_a_nested_field():
    class Message(serializers.Serializer):
        content = serializers.CharField()

    class Chat(serializers.Serializer):
        messages = Message(many=True)

    chat = Chat(data={"messages": [{"content": "hi"}, {}]})
    assert not chat.is_valid()
    error = handle(exceptions.ValidationError(chat.errors)).data["error"]
    assert error["param"] == "messages[1].content"
    assert error["code"] == "invalid_request_error"  # DRF's "required" is not a client code

    detail = {"prompt": [exceptions.ErrorDetail("too long", code="context_length_exceeded")]}
    error = handle(exceptions.ValidationError(detail)).data["error"]
    assert error["code"] == "context_length_exceeded"


def test_drf_errors_take_the_tables_codes():
    assert handle(exceptions.ParseError("JSON parse error")).data["error"]["code"] == "parse_error"
    assert handle(exceptions.NotFound()).status_code == 404
    assert handle(Http404()).data["error"]["code"] == "not_found"
    refused = handle(exceptions.NotAuthenticated())
    assert refused.status_code == 401 and refused.data["error"]["code"] == "invalid_api_key"
    assert handle(exceptions.MethodNotAllowed("GET")).data["error"]["code"] == "method_not_allowed"
    odd = handle(exceptions.UnsupportedMediaType("text/csv"))  # DRF's code is not a client code
    assert (odd.status_code, odd.data["error"]["code"]) == (415, "invalid_request_error")


def test_throttled_is_429_with_retry_after():
    response = handle(exceptions.Throttled(wait=3))
    assert response.status_code == 429
    assert response["Retry-After"] == "3"
    assert response.data["error"]["type"] == "rate_limit_error"
    assert response.data["error"]["code"] == "rate_limited"


def test_an_api_error_has_its_codes_status_type_headers_and_details():
    error = ApiError("queue_full", "Full.", headers={"Retry-After": "2"}, queue_depth=64)
    response = handle(error)
    assert response.status_code == CODES["queue_full"].status == error.status
    assert response["Retry-After"] == "2"
    assert response.data["error"] == {"message": "Full.", "type": "server_error", "param": None,
                                      "code": "queue_full", "queue_depth": 64}
    unknown = invalid("frobnicate", "Unrecognized.", "unknown_parameter")  # a 400 refinement
    assert (unknown.status, unknown.body()["error"]["type"]) == (400, "invalid_request_error")


@pytest.mark.parametrize("data, status, code", [
    ({"code": "queue_full", "message": "m", "retry_after_s": 3}, 503, "queue_full"),
    ({"code": "context_length_exceeded", "message": "m", "prompt_tokens": 9}, 400,
     "context_length_exceeded"),
    ({"code": "tenant_queue_full", "message": "m", "status": 429}, 429, "tenant_queue_full"),
    ({"message": "?"}, 500, "internal_error"),
])
def test_an_error_event_becomes_its_codes_http_error(data, status, code):
    error = ApiError.from_event(data)
    assert (error.status, error.code) == (status, code)
    if status in (429, 503):
        assert error.headers["Retry-After"] == str(data.get("retry_after_s", 1))
    assert "retry_after_s" not in error.body()["error"]
    if "prompt_tokens" in data:
        assert error.body()["error"]["prompt_tokens"] == 9


def test_non_api_exception_is_left_to_django():
    assert exception_handler(ValueError("boom"), {}) is None


@pytest.mark.django_db
def test_an_unexpected_error_in_a_view_is_a_json_500(parties, monkeypatch):
    """Django's handler500 answers in the API's shape (DEBUG off: the default)."""
    from django.test import Client

    from inference import service

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(service, "submit", broken)
    reply = Client(raise_request_exception=False).post(
        "/v1/completions", {"prompt": "x"}, content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {parties.owner}")
    assert reply.status_code == 500
    assert reply.json()["error"]["code"] == "internal_error"
    assert reply.json()["error"]["type"] == "server_error"


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/v1/messages/batches", "/v1/messages/",
                                  "/v1/messages/count_tokens/x"])
def test_an_unknown_path_under_messages_is_a_404_in_anthropics_shape(parties, path):
    from django.test import Client
    reply = Client().post(path, {}, content_type="application/json",
                          HTTP_X_API_KEY=parties.owner)
    assert reply.status_code == 404
    assert reply.json()["type"] == "error"
    assert (reply.json()["error"]["type"], reply.json()["error"]["code"]) == (
        "not_found_error", "not_found")
    assert Client().post("/v1/nothing", {}).json()["error"]["type"] == "invalid_request_error"


def test_the_docs_error_table_names_codes_of_the_table_with_their_statuses():
    """docs/api.md's error table and wire.errors.CODES agree: every code a row names is in
    the table, answered with the row's status (streamed errors arrive as events instead)."""
    import re
    from pathlib import Path

    text = Path(__file__).resolve().parent.parent.joinpath("docs", "api.md").read_text()
    table = text.split("| case | HTTP | `code` |", 1)[1].split("\n\n", 1)[0]
    rows = ["header"] + [line for line in table.splitlines() if line.startswith("| ")]
    checked = 0
    for row in rows[1:]:
        _, status_cell, code_cell = (cell.strip() for cell in row.strip("|").rsplit("|", 2))
        statuses = [int(s) for s in re.findall(r"\b([1-5]\d\d)\b", status_cell)]
        named = re.sub(r"\(.*?\)", "", code_cell).split("param")[0]  # not details or params
        for code in re.findall(r"`([a-z_]+)`", named):
            assert code in CODES, f"docs/api.md names {code!r}, which wire/errors.py lacks"
            assert CODES[code].status in statuses, (code, CODES[code].status, statuses)
            checked += 1
    assert checked >= 20  # the table has ~25 rows: a parse that finds none fails


def test_a_one_answer_request_cancelled_before_its_answer_is_a_typed_409():
    from inference import service
    from inference.broker import StreamEvent
    from inference.errors import ApiError

    cancelled = StreamEvent("1-0", "done", {"finish_reason": "cancelled", "usage": {}})
    with pytest.raises(ApiError) as caught:
        service.vocab_answer(cancelled)
    assert (caught.value.code, caught.value.status) == ("request_cancelled", 409)
    answered = StreamEvent("1-0", "done", {"finish_reason": "stop", "result": {"tokens": [1]}})
    assert service.vocab_answer(answered) == {"tokens": [1]}
