"""Errors the async API answers with, in OpenAI's shape (``config.errors.error_body``)."""
from __future__ import annotations

from typing import Any

from django.http import JsonResponse

from config.errors import error_body, error_type
from wire import errors, protocol

_REFUSAL_KEYS = {
    "code", "message", "param", "status", "type", "finish_reason", "stop", "usage", "timings",
    "retry_after_s",
}


class ApiError(Exception):
    """An error reply: HTTP status, OpenAI error fields, extra headers, extra details."""

    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None,
                 **details: Any) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.details = details

    def body(self) -> dict[str, Any]:
        """``{"error": {message, type, param, code, ...details}}``."""
        body = error_body(self.message, error_type(self.status), self.code, self.param)
        body["error"].update(self.details)
        return body

    def response(self) -> JsonResponse:
        response = JsonResponse(self.body(), status=self.status)
        for name, value in self.headers.items():
            response[name] = value
        return response

    @classmethod
    def from_event(cls, data: dict[str, Any]) -> ApiError:
        """An ``error`` event as an HTTP error: refusals carry their status, failures map."""
        code = data.get("code") or "internal_error"
        status = int(data.get("status") or errors.status_of(code))
        headers = {}
        if status in (429, 503):
            headers["Retry-After"] = str(data.get("retry_after_s") or 1)
        details = {k: v for k, v in data.items() if k not in _REFUSAL_KEYS}
        message = data.get("message") or code
        return cls(status, message, code, data.get("param"), headers, **details)


def invalid(param: str | None, message: str, code: str = "invalid_request_error") -> ApiError:
    """400 naming the field."""
    return ApiError(400, message, code, param)


def unavailable(model: str) -> ApiError:
    return ApiError(
        503, f"No scheduler daemon is serving model {model!r} right now; try again later.",
        protocol.SCHEDULER_UNAVAILABLE, headers={"Retry-After": "5"},
    )
