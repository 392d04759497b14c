"""Middleware without thread hops, and the lean handler the key-authenticated API runs on.

Under ASGI, Django runs every hook of a ``MiddlewareMixin`` middleware on a thread
(``sync_to_async``): Django's seven default middlewares cost ~13 thread hops per request,
and the first one starts a thread for the request. On a 2-core machine that CPU comes out of
llama.cpp's share (bench/web_cpu.py measures it).

- ``SecurityMiddleware``, ``CommonMiddleware``, ``XFrameOptionsMiddleware``: Django's, with
  their hooks run on the event loop (they do no I/O). Used everywhere.
- ``ApiHandler``: Django's ASGI handler with ``settings.API_MIDDLEWARE`` (async-capable
  middleware only) instead of ``MIDDLEWARE``. config/asgi.py routes ``API_PREFIX`` to it.
  The API authenticates by key, so sessions, CSRF, ``request.user`` and messages have
  nothing to do there; the security headers are the same as the site's.
"""
from __future__ import annotations

from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.handlers.asgi import ASGIHandler
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, common, security
from django.utils.module_loading import import_string

API_PREFIX = "/v1/"  # every URL under it authenticates by API key (inference/urls.py)


class InlineHooks:
    """For a ``MiddlewareMixin`` whose ``process_request``/``process_response`` do no I/O:
    under ASGI, run them on the event loop instead of on a thread."""

    get_response: Any

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = None
        if hasattr(self, "process_request"):
            response = self.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self, "process_response"):
            response = self.process_response(request, response)
        return response


class SecurityMiddleware(InlineHooks, security.SecurityMiddleware):
    """Django's SecurityMiddleware (SSL redirect, HSTS, nosniff, referrer and COOP headers)."""


class CommonMiddleware(InlineHooks, common.CommonMiddleware):
    """Django's CommonMiddleware (user-agent ban, slash redirects, Content-Length)."""


class XFrameOptionsMiddleware(InlineHooks, clickjacking.XFrameOptionsMiddleware):
    """Django's XFrameOptionsMiddleware."""


class ApiHandler(ASGIHandler):
    """Django's ASGI handler with the middleware of ``settings.API_MIDDLEWARE``."""

    def load_middleware(self, is_async: bool = False) -> None:
        self._view_middleware: list = []
        self._template_response_middleware: list = []
        self._exception_middleware: list = []
        handler = convert_exception_to_response(self._get_response_async)
        for path in reversed(settings.API_MIDDLEWARE):
            middleware = import_string(path)
            if not getattr(middleware, "async_capable", False) or not issubclass(
                middleware, InlineHooks
            ):
                raise ImproperlyConfigured(
                    f"API_MIDDLEWARE holds {path}: only config.middleware's inline "
                    "middleware runs there (no hooks on threads, no view hooks)."
                )
            handler = convert_exception_to_response(middleware(handler))
        self._middleware_chain = handler
