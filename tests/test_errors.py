"""Every DRF error leaves in OpenAI's shape."""

from rest_framework import exceptions, serializers

from config.errors import exception_handler


def handle(exc: Exception):
    response = exception_handler(exc, {})
    assert set(response.data) == {"error"}
    assert set(response.data["error"]) == {"message", "type", "param", "code"}
    return response


def test_validation_error_names_the_field():
    response = handle(exceptions.ValidationError({"max_tokens": ["Must be positive."]}))
    assert response.status_code == 400
    assert response.data["error"] == {
        "message": "Must be positive.",
        "type": "invalid_request_error",
        "param": "max_tokens",
        "code": "invalid",
    }


def test_validation_error_keeps_a_custom_code_and_nested_field():
    class Message(serializers.Serializer):
        content = serializers.CharField()

    class Chat(serializers.Serializer):
        messages = Message(many=True)

    chat = Chat(data={"messages": [{"content": "hi"}, {}]})
    assert not chat.is_valid()
    error = handle(exceptions.ValidationError(chat.errors)).data["error"]
    assert error["param"] == "messages[1].content"
    assert error["code"] == "required"

    detail = {"prompt": [exceptions.ErrorDetail("too long", code="context_length_exceeded")]}
    error = handle(exceptions.ValidationError(detail)).data["error"]
    assert error["code"] == "context_length_exceeded"


def test_parse_error_is_400():
    response = handle(exceptions.ParseError("JSON parse error"))
    assert response.status_code == 400
    assert response.data["error"]["code"] == "parse_error"


def test_throttled_is_429_with_retry_after():
    response = handle(exceptions.Throttled(wait=3))
    assert response.status_code == 429
    assert response["Retry-After"] == "3"
    assert response.data["error"]["type"] == "rate_limit_error"
    assert response.data["error"]["code"] == "rate_limited"


def test_non_api_exception_is_left_to_django():
    assert exception_handler(ValueError("boom"), {}) is None
