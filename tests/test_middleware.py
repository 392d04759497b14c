"""The API's lean handler (config/middleware.py) over a real daphne: the /v1/ API runs
without sessions, CSRF or messages but keeps the site's security headers; the rest of the
site keeps Django's full middleware."""
import asyncio
import threading

import pytest
from django.core import signals
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from django.utils.deprecation import MiddlewareMixin

from config.middleware import ApiHandler, InlineHooks, SecurityMiddleware
from tests.live_service import echo

SECURITY_HEADERS = {
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def assert_security_headers(reply):
    for name, value in SECURITY_HEADERS.items():
        assert reply.header(name) == value, name


def test_api_replies_carry_the_security_headers_and_no_cookies(web, standin):
    standin.serve(echo)
    reply = web.request("POST", "/v1/completions", {"model": standin.model, "prompt": "Hi"},
                        web.keys["owner"])
    assert reply.status == 200
    assert_security_headers(reply)
    assert reply.header("Set-Cookie") is None
    assert reply.header("Content-Length") == str(len(reply.response.read()))  # CommonMiddleware


def test_api_errors_and_streams_carry_the_security_headers(web, standin):
    missing = web.request("GET", "/v1/no-such-thing", key=web.keys["owner"])
    assert missing.status == 404 and missing.json()["error"]["code"] == "not_found"
    assert_security_headers(missing)
    standin.serve(echo)
    stream = web.request("POST", "/v1/completions",
                         {"model": standin.model, "prompt": "Hi", "stream": True},
                         web.keys["owner"])
    assert stream.status == 200
    assert_security_headers(stream)
    assert [data for _id, data in stream.sse()][-1] == "[DONE]"


def test_site_pages_keep_sessions_and_csrf(web):
    """The admin's login form still gets its CSRF cookie (the site's full middleware)."""
    reply = web.request("GET", "/admin/login/")
    assert reply.status == 200
    assert_security_headers(reply)
    assert "csrftoken=" in (reply.header("Set-Cookie") or "")


def test_the_api_handler_takes_only_inline_middleware():
    """A middleware that would hop to a thread (or needs view hooks) is refused at start."""
    with override_settings(API_MIDDLEWARE=["django.contrib.sessions.middleware."
                                           "SessionMiddleware"]):
        with pytest.raises(ImproperlyConfigured, match="SessionMiddleware"):
            ApiHandler()
    with override_settings(API_MIDDLEWARE=["config.middleware.SecurityMiddleware"]):
        handler = ApiHandler()
    assert isinstance(handler._middleware_chain.__wrapped__, SecurityMiddleware)


def test_inline_hooks_run_on_the_event_loop_thread():
    """Django's own MiddlewareMixin runs these hooks on another thread under ASGI."""
    threads = []

    class Probe(InlineHooks, MiddlewareMixin):
        def process_request(self, request):
            threads.append(threading.get_ident())

        def process_response(self, request, response):
            threads.append(threading.get_ident())
            response["X-Probe"] = "seen"
            return response

    async def view(request):
        return HttpResponse("ok")

    async def call():
        response = await Probe(view)(RequestFactory().get("/v1/health"))
        return threading.get_ident(), response

    loop_thread, response = asyncio.run(call())
    assert response["X-Probe"] == "seen"
    assert threads == [loop_thread, loop_thread]


async def _asgi(app, method, path):
    """One request straight to an ASGI app; the reply's messages."""
    sent, pending = [], [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        if pending:
            return pending.pop()
        await asyncio.Event().wait()  # the client never leaves

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "headers": [(b"host", b"127.0.0.1")],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 80)}
    await app(scope, receive, send)
    return sent


@pytest.mark.django_db(transaction=True)
def test_async_api_views_run_without_a_request_thread():
    """The completion endpoints are served on the event loop: the request signals fire on
    its thread; a DRF view still gets Django's thread for the request."""
    seen = []

    def started(**kwargs):
        seen.append(threading.get_ident())

    signals.request_started.connect(started)
    try:
        async def both():
            completions = await _asgi(ApiHandler(), "POST", "/v1/completions")
            loop_thread = threading.get_ident()
            health = await _asgi(ApiHandler(), "GET", "/v1/health")
            return loop_thread, completions, health

        loop_thread, completions, health = asyncio.run(both())
    finally:
        signals.request_started.disconnect(started)
    assert completions[0]["status"] == 401  # no key: answered, in the API's shape
    assert b"invalid_api_key" in completions[1]["body"]
    assert health[0]["status"] == 200
    assert seen[0] == loop_thread and seen[1] != loop_thread
