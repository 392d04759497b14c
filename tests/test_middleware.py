"""config/middleware.py: the /v1/ API runs without sessions, CSRF or messages but keeps the
site's security headers (over a real daphne), with its middleware hooks on the event loop;
the rest of the site keeps Django's full middleware, CSRF checks included."""
import asyncio
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import Client, RequestFactory, override_settings
from django.utils.deprecation import MiddlewareMixin

from config.middleware import SiteOrApiMiddleware
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


PROBE = "tests.test_middleware.Probe"
SEEN: list[tuple[str, str, int]] = []  # (hook, path, thread)


class Probe(MiddlewareMixin):
    """Records where its hooks run."""

    def process_request(self, request):
        SEEN.append(("request", request.path, threading.get_ident()))

    def process_response(self, request, response):
        SEEN.append(("response", request.path, threading.get_ident()))
        response["X-Probe"] = "seen"
        return response


class Answer(MiddlewareMixin):
    """Answers every request itself (as SecurityMiddleware's SSL redirect does)."""

    def process_request(self, request):
        return HttpResponse("early", status=301)


class Catches(MiddlewareMixin):
    def process_exception(self, request, exception):
        return HttpResponse("caught")


async def view(request):
    return HttpResponse("ok")


def run_async(middleware, path):
    async def call():
        return threading.get_ident(), await middleware(RequestFactory().get(path))

    return asyncio.run(call())


def test_api_hooks_run_on_the_event_loop_and_skip_the_site_middleware():
    """MiddlewareMixin would run each hook on another thread under ASGI."""
    SEEN.clear()
    with override_settings(API_MIDDLEWARE=[PROBE], SITE_MIDDLEWARE=[]):
        middleware = SiteOrApiMiddleware(view)
    loop_thread, response = run_async(middleware, "/v1/health")
    assert response["X-Probe"] == "seen"
    assert SEEN == [("request", "/v1/health", loop_thread), ("response", "/v1/health", loop_thread)]

    SEEN.clear()
    _thread, response = run_async(middleware, "/admin/")  # the site: SITE_MIDDLEWARE only
    assert SEEN == [] and not response.has_header("X-Probe")


def test_the_site_runs_the_site_middleware():
    SEEN.clear()
    with override_settings(API_MIDDLEWARE=[], SITE_MIDDLEWARE=[PROBE]):
        middleware = SiteOrApiMiddleware(view)
    _thread, response = run_async(middleware, "/admin/")
    assert response["X-Probe"] == "seen" and [hook for hook, *_ in SEEN] == ["request",
                                                                             "response"]
    SEEN.clear()
    _thread, response = run_async(middleware, "/v1/health")
    assert SEEN == [] and not response.has_header("X-Probe")


def test_an_api_request_hook_that_answers_skips_the_view_not_the_response_hooks():
    SEEN.clear()
    with override_settings(API_MIDDLEWARE=[PROBE, "tests.test_middleware.Answer"],
                           SITE_MIDDLEWARE=[]):
        middleware = SiteOrApiMiddleware(view)
    _thread, response = run_async(middleware, "/v1/health")
    assert (response.status_code, response.content) == (301, b"early")
    assert response["X-Probe"] == "seen"


def test_sync_mode_too():
    """Under WSGI (and Django's test client) the same, without an event loop."""
    SEEN.clear()
    with override_settings(API_MIDDLEWARE=[PROBE], SITE_MIDDLEWARE=[]):
        middleware = SiteOrApiMiddleware(lambda request: HttpResponse("ok"))
    assert middleware(RequestFactory().get("/v1/health"))["X-Probe"] == "seen"


def test_middleware_whose_hooks_it_would_not_run_is_refused():
    with override_settings(API_MIDDLEWARE=["django.middleware.csrf.CsrfViewMiddleware"]):
        with pytest.raises(ImproperlyConfigured, match="view hooks"):
            SiteOrApiMiddleware(view)
    with override_settings(SITE_MIDDLEWARE=["tests.test_middleware.Catches"], API_MIDDLEWARE=[]):
        with pytest.raises(ImproperlyConfigured, match="process_exception"):
            SiteOrApiMiddleware(view)


@pytest.mark.django_db
def test_csrf_still_guards_the_site_and_never_the_api():
    """CsrfViewMiddleware's view hook runs for the site (through SiteOrApiMiddleware)."""
    client = Client(enforce_csrf_checks=True)
    assert client.post("/admin/login/", {"username": "x", "password": "y"}).status_code == 403
    reply = client.post("/v1/completions", "{}", content_type="application/json")
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
