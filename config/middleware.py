"""The one entry of ``MIDDLEWARE``: the site's middleware, of which the API runs a lean share.

Outside ``settings.API_PREFIX`` (admin, playground) ``SiteOrApiMiddleware`` runs
``settings.SITE_MIDDLEWARE`` (Django's defaults) through their public protocol: each is
instantiated with the next as ``get_response`` and called, and their ``process_view`` hooks
(CSRF's) run for the view, as Django would run them.

Under the prefix (the API: keys, not sessions) sessions, CSRF, users and messages have
nothing to do. Only ``settings.API_MIDDLEWARE`` runs there (security headers, Host and
Content-Length, X-Frame-Options: the same headers as the site), and since those three do
no I/O, their ``process_request``/``process_response`` hooks are called here, on the event
loop, in the order ``MiddlewareMixin`` calls them. Django's ASGI handler would run each hook
on a thread: five thread hops per API request, ~1 ms of CPU on a 2-core machine, taken
from llama.cpp's threads.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpRequest, HttpResponseBase
from django.utils.module_loading import import_string

from inference.errors import is_api

Handler = Callable[[HttpRequest], Any]
UNSUPPORTED_HOOKS = ("process_exception", "process_template_response")


class SiteOrApiMiddleware:
    """``SITE_MIDDLEWARE`` for the site, ``API_MIDDLEWARE``'s hooks for the API."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Handler) -> None:
        self.get_response = get_response
        self.is_async = iscoroutinefunction(get_response)
        self.site = get_response
        site_middleware = []
        for path in reversed(settings.SITE_MIDDLEWARE):
            middleware = import_string(path)(self.site)
            _refuse_unsupported_hooks(path, middleware)
            site_middleware.insert(0, middleware)
            self.site = middleware
        self.view_hooks = [m.process_view for m in site_middleware
                           if hasattr(m, "process_view")]
        self.api = [import_string(path)(get_response) for path in settings.API_MIDDLEWARE]
        for path, middleware in zip(settings.API_MIDDLEWARE, self.api, strict=True):
            _refuse_unsupported_hooks(path, middleware)
            if hasattr(middleware, "process_view"):
                raise ImproperlyConfigured(f"API_MIDDLEWARE holds {path}, which has view hooks")
        if self.is_async:
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> HttpResponseBase | Awaitable[HttpResponseBase]:
        if self.is_async:
            return self._acall(request)
        if not is_api(request):
            return self.site(request)
        early, ran = self._api_requests(request)
        response = self.get_response(request) if early is None else early
        return self._api_responses(request, response, ran)

    async def _acall(self, request: HttpRequest) -> HttpResponseBase:
        if not is_api(request):
            return await self.site(request)
        early, ran = self._api_requests(request)
        response = await self.get_response(request) if early is None else early
        return self._api_responses(request, response, ran)

    async def process_view(self, request: HttpRequest, view: Handler, args: tuple,
                           kwargs: dict[str, Any]) -> HttpResponseBase | None:
        """The site middleware's view hooks (CSRF's check); none for the API."""
        if is_api(request):
            return None
        for hook in self.view_hooks:
            response = await sync_to_async(hook)(request, view, args, kwargs)
            if response is not None:
                return response
        return None

    def _api_requests(self, request: HttpRequest) -> tuple[HttpResponseBase | None, list]:
        """API_MIDDLEWARE's request hooks in order, up to the first that answers."""
        ran = []
        for middleware in self.api:
            ran.append(middleware)
            hook = getattr(middleware, "process_request", None)
            response = hook(request) if hook else None
            if response is not None:
                return response, ran
        return None, ran

    @staticmethod
    def _api_responses(request: HttpRequest, response: HttpResponseBase,
                       ran: list) -> HttpResponseBase:
        """The response hooks of those that ran, innermost first."""
        for middleware in reversed(ran):
            hook = getattr(middleware, "process_response", None)
            if hook:
                response = hook(request, response)
        return response


def _refuse_unsupported_hooks(path: str, middleware: Any) -> None:
    for hook in UNSUPPORTED_HOOKS:
        if hasattr(middleware, hook):
            raise ImproperlyConfigured(f"{path} has {hook}, which SiteOrApiMiddleware "
                                       "does not run")
