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
  nothing to do there; the security headers are the same as the site's. Its async views
  (completions, chat, the events stream) do every database call on inference/db.py's
  thread, so for them it also skips Django's per-request thread (see ``_handle_on_loop``);
  its sync views (DRF: history, health, models, usage) are handled as Django does.
"""
from __future__ import annotations

import asyncio
import functools
from typing import Any

from asgiref.sync import iscoroutinefunction
from django.conf import settings
from django.core import signals
from django.core.exceptions import ImproperlyConfigured, RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponseBase
from django.middleware import clickjacking, common, security
from django.urls import Resolver404, get_resolver, set_script_prefix
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
            if not (isinstance(middleware, type) and issubclass(middleware, InlineHooks)):
                raise ImproperlyConfigured(
                    f"API_MIDDLEWARE holds {path}: only config.middleware's inline "
                    "middleware runs there (no hooks on threads, no view hooks)."
                )
            handler = convert_exception_to_response(middleware(handler))
        self._middleware_chain = handler

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and _async_view(scope["path"], scope.get("root_path", "")):
            await self._handle_on_loop(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)

    async def _handle_on_loop(self, scope: dict, receive: Any, send: Any) -> None:
        """Django's ``handle`` (5.2) for an async view that never uses the ORM on the
        request's thread: without a ``ThreadSensitiveContext``, and with the request signals
        sent and the response closed on the event loop. Django would start a thread for the
        request and hop to it three times, only for ``close_old_connections`` to find no
        connection there. Here it runs on the loop thread, which has none either (Django
        refuses ORM calls on it)."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            error_response.close()
            return

        async def process_request() -> HttpResponseBase:
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client went away while it was sent
            return response

        # As Django: a disconnect while the view runs cancels it (the view's
        # CancelIfAbandoned then cancels the inference request).
        listener = asyncio.create_task(self.listen_for_disconnect(receive))
        worker = asyncio.create_task(process_request())
        await asyncio.wait([listener, worker], return_when=asyncio.FIRST_COMPLETED)
        for task in (listener, worker):
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = worker.result()
        except asyncio.CancelledError:
            signals.request_finished.send(sender=self.__class__)
        else:
            response.close()  # sends request_finished
        body_file.close()


@functools.lru_cache(maxsize=1024)
def _async_view(path: str, root_path: str) -> bool:
    """Whether ``path`` resolves to an async view (which ``_handle_on_loop`` may serve)."""
    try:
        match = get_resolver().resolve(path.removeprefix(root_path) or "/")
    except Resolver404:
        return False
    return iscoroutinefunction(match.func)
