"""Every API error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

API_PREFIX = "/v1/"

# Codes clients match on; anything else keeps DRF's own code ("not_found", "parse_error", ...).
_CODES = {
    exceptions.NotAuthenticated: "invalid_api_key",
    exceptions.AuthenticationFailed: "invalid_api_key",
    exceptions.Throttled: "rate_limited",
}
_MESSAGES = {
    exceptions.NotAuthenticated: (
        "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
    ),
}


def error_body(
    message: str, type: str, code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    """The OpenAI error document."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_type(status_code: int) -> str:
    if status_code == status.HTTP_429_TOO_MANY_REQUESTS:
        return "rate_limit_error"
    if status_code >= 500:
        return "server_error"
    return "invalid_request_error"


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF's handler (status, headers, rollback), with the body rewritten."""
    if isinstance(exc, Http404):
        exc = exceptions.NotFound()
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_error(exc.detail, exc.get_codes())
    else:
        codes = exc.get_codes()
        param, message, code = None, str(exc.detail), codes if isinstance(codes, str) else None
    message, code = _override(_MESSAGES, exc, message), _override(_CODES, exc, code)
    response.data = error_body(message, error_type(response.status_code), code, param)
    return response


def _override(table: dict[type, str], exc: Exception, default: str | None) -> str | None:
    return next((value for cls, value in table.items() if isinstance(exc, cls)), default)


def _first_error(detail: Any, codes: Any, path: str = "") -> tuple[str | None, str, str]:
    """(dotted field name or None, message, code) of the first error in a nested detail."""
    if isinstance(detail, dict):
        field, sub = next(iter(detail.items()))
        if field == "non_field_errors":
            name = path
        elif isinstance(field, int):  # list items' errors are keyed by index
            name = f"{path}[{field}]"
        else:
            name = f"{path}.{field}".lstrip(".")
        return _first_error(sub, codes[field], name)
    if isinstance(detail, list):
        index = next((i for i, item in enumerate(detail) if item), 0)
        item = detail[index]
        name = f"{path}[{index}]" if isinstance(item, dict) else path
        return _first_error(item, codes[index], name)
    return path or None, str(detail), str(codes)


def bad_request(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 400 (a SuspiciousOperation: a Host not in ALLOWED_HOSTS, a body over
    DATA_UPLOAD_MAX_MEMORY_SIZE read outside the API's own checks): JSON under /v1/."""
    if request.path_info.startswith(API_PREFIX):
        body = error_body("Your request could not be read.", "invalid_request_error",
                          "bad_request")
        return JsonResponse(body, status=400)
    return defaults.bad_request(request, exception)


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """Django's 404: JSON under /v1/, the usual page elsewhere."""
    if request.path_info.startswith(API_PREFIX):
        body = error_body(
            f"Invalid URL ({request.method} {request.path})", "invalid_request_error", "not_found"
        )
        return JsonResponse(body, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """Django's 500: JSON under /v1/, the usual page elsewhere."""
    if request.path_info.startswith(API_PREFIX):
        body = error_body(
            "The server had an error processing your request.", "server_error", "internal_error"
        )
        return JsonResponse(body, status=500)
    return defaults.server_error(request)
