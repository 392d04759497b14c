"""Every API error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Codes, their HTTP statuses and OpenAI types come from ``wire.errors`` (the one table).
``ApiError`` is a DRF exception: views raise it and ``exception_handler`` (DRF's
``EXCEPTION_HANDLER``) answers it, and every other DRF exception, in that shape; the
websocket sends its ``body()``. Django's own 400/404/500 pages answer in the same shape
under ``settings.API_PREFIX`` (``bad_request``, ``not_found``, ``server_error``).
"""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions
from rest_framework.response import Response

from inference.auth import INVALID_API_KEY, NO_KEY
from wire import errors as codes
from wire import protocol

_REFUSAL_KEYS = {
    "code", "message", "param", "status", "type", "finish_reason", "stop", "usage", "timings",
    "retry_after_s",
}
# DRF exceptions whose own code is not the one clients match on.
_DRF_CODES: dict[type[exceptions.APIException], str] = {
    exceptions.NotAuthenticated: INVALID_API_KEY,
    exceptions.AuthenticationFailed: INVALID_API_KEY,
    exceptions.Throttled: "rate_limited",
}
_DRF_MESSAGES: dict[type[exceptions.APIException], str] = {exceptions.NotAuthenticated: NO_KEY}


class ApiError(exceptions.APIException):
    """An error reply: a code of the table (its HTTP status unless ``status`` says
    otherwise), a message, the field at fault, extra headers and extra details."""

    def __init__(self, code: str, message: str, param: str | None = None, *,
                 status: int | None = None, headers: dict[str, str] | None = None,
                 **details: Any) -> None:
        super().__init__(message, code)
        self.code = code
        self.message = message
        self.param = param
        self.status_code = status or codes.status_of(code)
        self.headers = dict(headers or {})
        self.details = details

    @property
    def status(self) -> int:
        return self.status_code

    def body(self) -> dict[str, Any]:
        """``{"error": {message, type, param, code, ...details}}``."""
        body = codes.error_body(self.message, codes.type_of(self.status), self.code, self.param)
        body["error"].update(self.details)
        return body

    @classmethod
    def from_event(cls, data: dict[str, Any]) -> ApiError:
        """An ``error`` event as an HTTP error: refusals carry their status, failures map."""
        code = data.get("code") or codes.INTERNAL_ERROR
        status = int(data.get("status") or codes.status_of(code))
        headers = {}
        if status in (429, 503):
            headers["Retry-After"] = str(data.get("retry_after_s") or 1)
        details = {k: v for k, v in data.items() if k not in _REFUSAL_KEYS}
        return cls(code, data.get("message") or code, data.get("param"), status=status,
                   headers=headers, **details)


def model_not_found(sent: str, param: str = "model") -> ApiError:
    """404 ``model_not_found``: one message for every model (or adapter) the key cannot use,
    whether nobody has it or another tenant does (no oracle)."""
    return ApiError(codes.MODEL_NOT_FOUND, f"The model '{sent}' does not exist.", param)


def invalid(param: str | None, message: str,
            code: str = codes.INVALID_REQUEST_ERROR) -> ApiError:
    """A 400 naming the field; ``code`` refines ``invalid_request_error`` (and has its
    status: ``unknown_parameter``, ``missing_required_parameter``...)."""
    return ApiError(code, message, param, status=codes.status_of(codes.INVALID_REQUEST_ERROR))


def unavailable(model: str) -> ApiError:
    """503: no live daemon serves ``model``."""
    return ApiError(
        protocol.SCHEDULER_UNAVAILABLE,
        f"No scheduler daemon is serving model {model!r} right now; try again later.",
        headers={"Retry-After": "5"},
    )


# -- DRF ---------------------------------------------------------------------------------------


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler (status, WWW-Authenticate, Retry-After, rollback), with the body in
    OpenAI's shape. Anything that is not an API error is left to Django (a 500)."""
    # Imported here: rest_framework.views imports the authentication and negotiation
    # classes of REST_FRAMEWORK, which import this module.
    from rest_framework.views import exception_handler as drf_exception_handler

    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    error = exc if isinstance(exc, ApiError) else _from_drf(exc, response.status_code)
    response.data = error.body()
    for name, value in error.headers.items():
        response[name] = value
    return response


def _from_drf(exc: exceptions.APIException, status: int) -> ApiError:
    """A DRF exception as an ApiError; its code is the table's (DRF's own when the table
    has it, else the generic code of its status)."""
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_error(exc.detail, exc.get_codes())
    else:
        found = exc.get_codes()
        param, message, code = None, str(exc.detail), found if isinstance(found, str) else ""
    code = _override(_DRF_CODES, exc, code)
    if code not in codes.CODES:
        code = codes.INVALID_REQUEST_ERROR if status < 500 else codes.INTERNAL_ERROR
    return ApiError(code, _override(_DRF_MESSAGES, exc, message), param, status=status)


def _override(table: dict[type, str], exc: Exception, default: str) -> str:
    return next((value for cls, value in table.items() if isinstance(exc, cls)), default)


def _first_error(detail: Any, found: Any, path: str = "") -> tuple[str | None, str, str]:
    """(dotted field name or None, message, code) of the first error in a nested detail."""
    if isinstance(detail, dict):
        field, sub = next(iter(detail.items()))
        if field == "non_field_errors":
            name = path
        elif isinstance(field, int):  # list items' errors are keyed by index
            name = f"{path}[{field}]"
        else:
            name = f"{path}.{field}".lstrip(".")
        return _first_error(sub, found[field], name)
    if isinstance(detail, list):
        index = next((i for i, item in enumerate(detail) if item), 0)
        item = detail[index]
        name = f"{path}[{index}]" if isinstance(item, dict) else path
        return _first_error(item, found[index], name)
    return path or None, str(detail), str(found)


# -- Django's error pages ------------------------------------------------------------------------


def is_api(request: HttpRequest) -> bool:
    """Whether the request is for the API (its path after the root path)."""
    return request.path_info.startswith(settings.API_PREFIX)


def _json(error: ApiError, request: HttpRequest | None = None) -> JsonResponse:
    """The error in the API's shape; under /v1/messages (Anthropic's Messages API: its
    unknown sub-paths too) in Anthropic's."""
    if request is not None and request.path_info.startswith(f"{settings.API_PREFIX}messages"):
        from inference.anthropic_format import api_error_body  # (it imports this module)
        return JsonResponse(api_error_body(error), status=error.status)
    return JsonResponse(error.body(), status=error.status)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 400 (a SuspiciousOperation such as a Host not in ALLOWED_HOSTS)."""
    if is_api(request):
        return _json(ApiError(codes.INVALID_REQUEST_ERROR, "Your request could not be read."),
                     request)
    return defaults.bad_request(request, exception)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404 (and the API's unknown URLs)."""
    if is_api(request):
        return _json(ApiError("not_found", f"Invalid URL ({request.method} {request.path})"),
                     request)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500."""
    if is_api(request):
        return _json(ApiError(codes.INTERNAL_ERROR,
                              "The server had an error processing your request."), request)
    return defaults.server_error(request)
