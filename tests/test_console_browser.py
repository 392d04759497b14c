"""The tenant console (issue 38) in a real headless Chromium (Playwright driving Debian's
/usr/bin/chromium, as tests/test_browser.py does) against real daphne behind the door and the
real SmolLM2 daemon: a member invited with ``manage.py invite`` sets a password, logs in,
creates a key (an expiry, SmolLM2 only, limits of its own), uses it, rotates it with an
overlap, ends the overlap, revokes it (an open websocket on it closed with 4401), sees the
usage page count the requests and downloads them as CSV; a viewer cannot create keys; a
member of another tenant reaches nothing of the first's; the operator's overview draws the
run. Screenshots go where tests/test_browser.py's go (``SCREENSHOT_DIR`` when set: `make
screenshots`)."""
from __future__ import annotations

import csv
import json
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from config.models import GEMMA, SMOLLM2
from tests import test_browser
from tests.live_service import ROOT, WebServer, shared_daemon, wait_until
from tests.test_browser import MAKE_STAFF

pytestmark = pytest.mark.slow
# tests/test_browser.py's fixtures: its Chromium, a context per test, where screenshots go
browser, context, shots = test_browser.browser, test_browser.context, test_browser.shots
PASSWORD = "a-long-console-password-17"
HELLO = [{"role": "user", "content": "Say hi."}]
CLOSE_UNAUTHENTICATED = 4401
# How far ahead the old key's expiry is set at least to end the overlap: time enough for the
# form to be sent and saved while still in the future (the form refuses a past expiry).
OVERLAP_END_S = 20
SETUP = """
import json
from accounts.models import ApiKey, Membership, Tenant
from console.forms import invite
a = Tenant.objects.create(slug="{a}", name="Tenant A")
b = Tenant.objects.create(slug="{b}", name="Tenant B")
seed, raw = ApiKey.issue(a, "seed key of A")
users = {{}}
for email, tenant, role in (("{viewer}", a, "viewer"), ("{outsider}", b, "member")):
    user, _ = invite(email, tenant, role, base_url="http://testserver", actor_name="ops")
    user.set_password("{password}")
    user.save()
print(json.dumps({{"a": a.pk, "b": b.pk, "seed_id": seed.pk, "seed": raw}}))
"""


@dataclass
class Console:
    """Tenant A (a seed key used once: ``seed_request``), a viewer of A, a member of tenant B,
    the live server and its SmolLM2 daemon."""

    web: WebServer
    a_slug: str
    seed_id: int
    seed_prefix: str
    seed_request: str
    viewer: str
    outsider: str


def manage(web: WebServer, *argv: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "manage.py", *argv], cwd=ROOT, env={**web.env, **env},
                          check=True, capture_output=True, text=True)
    return done.stdout.strip()


def chat(web: WebServer, key: str, model: str = SMOLLM2):
    return web.request("POST", "/v1/chat/completions",
                       {"model": model, "messages": HELLO, "max_tokens": 4, "temperature": 0},
                       key)


def answered(web: WebServer, key: str) -> bool:
    """A chat with SmolLM2 answered (200); anything else fails with its body."""
    reply = chat(web, key)
    assert reply.status == 200, (reply.status, reply.json())
    reply.json()
    return True


@pytest.fixture(scope="module")
def console(web: WebServer) -> Console:
    shared_daemon(web, "chat")  # SmolLM2 under its catalog name
    tag = uuid.uuid4().hex[:6]
    viewer, outsider = f"viewer-{tag}@example.com", f"outsider-{tag}@example.com"
    made = json.loads(manage(web, "shell", "-c", SETUP.format(
        a=f"console-a-{tag}", b=f"console-b-{tag}", viewer=viewer, outsider=outsider,
        password=PASSWORD)).splitlines()[-1])
    manage(web, "shell", "-c", MAKE_STAFF)
    reply = chat(web, made["seed"])
    assert reply.status == 200, reply.json()
    request_id = reply.header("X-Request-Id")
    assert request_id, "the reply names its request (X-Request-Id)"
    return Console(web, f"console-a-{tag}", made["seed_id"],
                   made["seed"].split(".")[0].removeprefix("sk-"), request_id, viewer, outsider)


def log_in(context, web: WebServer, username: str, password: str = PASSWORD, shot=None):
    page = context.new_page()
    page.goto(f"{web.base_url}/console/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    if shot:
        page.screenshot(path=str(shot), full_page=True)
    page.click("button[type=submit]:has-text('Log in')")
    page.wait_for_url("**/console/keys/")
    return page


def usage_numbers(page, web: WebServer) -> dict[str, int]:
    """The usage page's summary (the last 24 h by hour), reloaded."""
    page.goto(f"{web.base_url}/console/usage/?range=24h")
    cells = page.locator("table.usage-summary tbody td").all_inner_texts()
    names = ["requests", "done", "cancelled", "error", "prompt", "cached", "completion"]
    return {name: int(cells[i]) for i, name in enumerate(names)}


def counted(page, web: WebServer, done: int, timeout_s: float = 30) -> dict[str, int]:
    """The usage page's numbers once they count ``done`` requests done (their history rows
    are written as they end); fails with the numbers and the requests page."""
    deadline = time.monotonic() + timeout_s
    while (numbers := usage_numbers(page, web))["done"] < done:
        if time.monotonic() > deadline:
            page.goto(f"{web.base_url}/console/requests/")
            raise AssertionError(f"{numbers}, not {done} done; the requests:\n"
                                 f"{page.inner_text('table')}")
        time.sleep(1)
    return numbers


def chart_labels(page, selector: str) -> list[str]:
    """Each SVG chart's aria-label (``<title>: <what it draws>``, or ``...: no data``)."""
    return page.eval_on_selector_all(selector, "svgs => svgs.map(s => s.getAttribute("
                                     "'aria-label'))")


def shows(page, selector: str, text: str) -> None:
    """Wait for ``selector`` holding ``text``; fail with what the page shows instead."""
    try:
        page.locator(selector, has_text=text).first.wait_for(timeout=20_000)
    except Exception as exc:
        raise AssertionError(f"no {text!r} in {selector}; {page.url} shows:\n"
                             f"{page.inner_text('main')}") from exc


def csrf_post(page, url: str, form: dict[str, str] | None = None):
    """A POST from the logged-in page with its CSRF token (as its forms send it): a refusal
    is the view's, not the CSRF middleware's."""
    token = page.input_value("input[name=csrfmiddlewaretoken] >> nth=0")
    reply = page.request.post(url, form={"csrfmiddlewaretoken": token, **(form or {})},
                              headers={"Referer": page.url}, max_redirects=0)
    assert "CSRF" not in reply.text(), reply.text()[:300]
    return reply


def test_a_member_manages_a_key_from_invite_to_revoke(context, console, shots):
    web = console.web
    # -- invited by the operator; the link sets a password; log in ---------------------------
    email = f"member-{uuid.uuid4().hex[:6]}@example.com"
    printed = manage(web, "invite", console.a_slug, email, "--role", "member",
                     CONSOLE_URL=web.base_url)
    link = printed.splitlines()[-1]
    assert link.startswith(f"{web.base_url}/console/password/reset/"), printed
    page = context.new_page()
    page.goto(link)
    page.fill("#id_new_password1", PASSWORD)
    page.fill("#id_new_password2", PASSWORD)
    page.click("button:has-text('Set password')")
    shows(page, "h1", "Password set")
    page.close()
    page = log_in(context, web, email, shot=shots / "console-login.png")
    before = usage_numbers(page, web)

    # -- create a key: an expiry, SmolLM2 only, limits of its own -----------------------------
    page.goto(f"{web.base_url}/console/keys/")
    page.click("a:has-text('New key')")
    page.fill("#id_name", "ci pipeline")
    expiry = (datetime.now(UTC) + timedelta(days=30)).replace(second=0, microsecond=0)
    page.fill("#id_expires_at", expiry.strftime("%Y-%m-%dT%H:%M"))
    page.check(f"input[name=allowed_models][value='{SMOLLM2}']")
    page.fill("#id_requests_per_minute", "600")
    page.fill("#id_tokens_per_minute", "200000")
    page.fill("#id_monthly_token_budget", "5000000")
    page.click("button:has-text('Create key')")
    shows(page, "h1", "Key created")
    first = page.inner_text(".secret").strip()
    assert first.startswith("sk-")
    page.screenshot(path=str(shots / "console-key-created.png"), full_page=True)

    # -- use it: the allowed model answers, the other is refused -----------------------------
    assert answered(web, first)
    refused = chat(web, first, GEMMA)
    assert refused.status == 403
    assert refused.json()["error"]["code"] == "model_not_allowed"

    # -- its page: the settings shown and editable -------------------------------------------
    page.click("a:has-text(\"The key's page\")")
    shows(page, "h1", "ci pipeline")
    first_url = page.url
    facts = page.inner_text("table.facts")
    assert SMOLLM2 in facts and "600 req/min" in facts and expiry.strftime("%Y-%m-%d") in facts
    assert page.is_checked(f"input[name=allowed_models][value='{SMOLLM2}']")
    page.screenshot(path=str(shots / "console-key-detail.png"), full_page=True)

    # -- rotate with an overlap: both keys work ----------------------------------------------
    page.click("a:has-text('Rotate…')")
    page.check("input[name=overlap_s][value='3600']")
    page.screenshot(path=str(shots / "console-key-rotate.png"), full_page=True)
    page.click("button:has-text('Rotate')")
    shows(page, "h1", "Key rotated")
    second = page.inner_text(".secret").strip()
    assert second.startswith("sk-") and second != first
    second_url = page.locator("a:has-text(\"The key's page\")").get_attribute("href")
    assert answered(web, first)
    assert answered(web, second)

    # -- end the overlap: the old key's expiry set OVERLAP_END_S ahead in its edit form (to
    # the second); the usage page is checked meanwhile --------------------------------------
    page.goto(first_url)
    ends = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=OVERLAP_END_S)
    page.fill("#id_expires_at", ends.strftime("%Y-%m-%dT%H:%M:%S"))
    page.click("button:has-text('Save')")
    shows(page, ".messages", "Saved: expires_at")

    # -- usage: the requests above counted (the history rows are written as they end) ---------
    made = 3  # the first key twice, the second once: each done
    after = counted(page, web, before["done"] + made)
    assert after["requests"] >= before["requests"] + made
    assert after["prompt"] + after["completion"] > before["prompt"] + before["completion"]
    drawn = chart_labels(page, "figure svg.chart")
    assert drawn and not any(label.endswith("no data") for label in drawn[:3]), drawn
    page.screenshot(path=str(shots / "console-usage.png"), full_page=True)

    # -- the CSV holds the same requests, per key ---------------------------------------------
    with page.expect_download() as download:
        page.click("a:has-text('Download CSV')")
    rows = list(csv.DictReader(Path(download.value.path()).read_text().splitlines()))
    done_by_key: dict[str, int] = {}
    for row in rows:
        if row["model"] == SMOLLM2:
            done_by_key[row["key_prefix"]] = done_by_key.get(row["key_prefix"], 0) + int(
                row["done"])
    prefix = {key: key.split(".")[0].removeprefix("sk-") for key in (first, second)}
    assert done_by_key.get(prefix[first]) == 2 and done_by_key.get(prefix[second]) == 1, rows
    assert done_by_key.get(console.seed_prefix) == 1, rows

    page.goto(f"{web.base_url}/console/requests/")
    listed = page.inner_text("table")
    assert listed.count(SMOLLM2) >= made + 1 and f"sk-{prefix[second]}" in listed
    page.screenshot(path=str(shots / "console-requests.png"), full_page=True)

    # -- after the overlap only the new key works --------------------------------------------
    wait_until(lambda: web.request("GET", "/v1/models", key=first).status == 401,
               timeout_s=OVERLAP_END_S + 120, step_s=0.5)
    expired = chat(web, first)
    assert expired.status == 401 and expired.json()["error"]["code"] == "invalid_api_key"
    assert answered(web, second)

    # -- revoke the new key in another page: the next request 401, and a websocket open on
    # it in this page closed with 4401 ---------------------------------------------------------
    page.goto(f"{web.base_url}/console/keys/")
    page.evaluate("""([url, key]) => {
        window.wsLog = {messages: [], close: null};
        const ws = new WebSocket(url);
        ws.onopen = () => ws.send(JSON.stringify({type: "auth", api_key: key}));
        ws.onmessage = (e) => window.wsLog.messages.push(JSON.parse(e.data));
        ws.onclose = (e) => { window.wsLog.close = e.code; };
    }""", [web.ws_url, second])
    page.wait_for_function(
        "window.wsLog.messages.some(m => m.type === 'authenticated')", timeout=30_000)
    admin = context.new_page()
    admin.goto(f"{web.base_url}{second_url}")
    admin.click("a:has-text('Revoke…')")
    admin.click("button:has-text('Revoke')")
    shows(admin, ".messages", "Revoked")
    revoked_at = time.monotonic()
    gone = chat(web, second)
    assert gone.status == 401 and gone.json()["error"]["code"] == "invalid_api_key"
    page.wait_for_function("window.wsLog.close !== null", timeout=30_000)
    closed_after_s = time.monotonic() - revoked_at
    log = page.evaluate("window.wsLog")
    assert log["close"] == CLOSE_UNAUTHENTICATED, log
    assert log["messages"][-1]["error"]["code"] == "invalid_api_key", log
    print(f"the websocket closed {closed_after_s:.1f} s after the revoke")
    admin.close()
    counted(page, web, before["done"] + made + 1)

    # -- the audit log, the keys list ----------------------------------------------------------
    page.goto(f"{web.base_url}/console/audit/")
    audit = page.inner_text("table")
    for action in ("created", "rotated", "revoked"):
        assert action in audit.lower(), audit
    assert email in audit and "expires_at" in audit
    page.screenshot(path=str(shots / "console-audit.png"), full_page=True)
    page.goto(f"{web.base_url}/console/keys/")
    keys = page.inner_text("table")
    assert "revoked" in keys and "expired" in keys
    page.screenshot(path=str(shots / "console-keys.png"), full_page=True)


def test_a_viewer_sees_the_keys_but_cannot_create_one(context, console):
    web = console.web
    page = log_in(context, web, console.viewer)
    assert f"sk-{console.seed_prefix}" in page.inner_text("table")
    assert page.locator("a:has-text('New key')").count() == 0
    assert page.request.get(f"{web.base_url}/console/keys/new/").status == 403
    create = csrf_post(page, f"{web.base_url}/console/keys/new/", {"name": "mine"})
    assert create.status == 403
    page.goto(f"{web.base_url}/console/keys/{console.seed_id}/")
    assert page.locator("button:has-text('Save')").count() == 0
    for action in ("", "rotate/", "revoke/"):
        url = f"{web.base_url}/console/keys/{console.seed_id}/{action}"
        assert csrf_post(page, url, {"name": "renamed", "overlap_s": "0"}).status == 403, url
    keys = manage(web, "shell", "-c", "from accounts.models import ApiKey; print(sorted(ApiKey."
                  f"objects.filter(tenant__slug={console.a_slug!r}).values_list('name', flat="
                  "True)))")
    assert "mine" not in keys and "renamed" not in keys, keys


def test_a_member_of_another_tenant_reaches_nothing_of_a(context, console):
    web = console.web
    page = log_in(context, web, console.outsider)
    base = f"{web.base_url}/console"
    assert f"sk-{console.seed_prefix}" not in page.content()
    key = console.seed_id
    for path in (f"keys/{key}/", f"keys/{key}/rotate/", f"keys/{key}/revoke/",
                 f"requests/{console.seed_request}/", f"usage/?key={key}",
                 f"usage.csv?key={key}"):
        assert page.request.get(f"{base}/{path}").status == 404, path
    for path in (f"keys/{key}/", f"keys/{key}/rotate/", f"keys/{key}/revoke/"):
        assert csrf_post(page, f"{base}/{path}", {"name": "taken", "overlap_s": "0"}
                         ).status == 404, path
    page.goto(f"{base}/requests/?key={key}")
    assert "No requests." in page.inner_text("table")
    assert usage_numbers(page, web)["requests"] == 0
    csv_rows = page.request.get(f"{base}/usage.csv?range=30d").text().splitlines()
    assert len(csv_rows) == 1, csv_rows  # the header only
    still = manage(web, "shell", "-c", (
        "import json; from accounts.models import ApiKey; "
        f"k = ApiKey.objects.get(pk={key}); "
        "print(json.dumps([k.name, k.revoked_at is None, k.expires_at is None]))"))
    still = json.loads(still.splitlines()[-1])
    assert still == ["seed key of A", True, True]


def test_the_operator_overview_draws_the_run(context, console, shots):
    web = console.web
    page = context.new_page()
    page.goto(f"{web.base_url}/admin/login/?next=/admin/overview/")
    page.fill("#id_username", "ops")
    page.fill("#id_password", "ops-password")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/overview/")

    def drawn() -> dict[str, str] | None:
        page.goto(f"{web.base_url}/admin/overview/?range=1h")
        labels = chart_labels(page, ".overview-chart svg.chart")
        by_title = {label.split(":")[0]: label for label in labels}
        wanted = [by_title.get("Tokens per second", ""), by_title.get("Time to first token", "")]
        ready = all(label and not label.endswith("no data") for label in wanted)
        return by_title if ready else None

    # the daemons sample every TIMESERIES_INTERVAL_S (10 s): the run's buckets come in
    by_title = wait_until(drawn, timeout_s=60, step_s=2)
    for title in ("Tokens per second", "Time to first token"):
        chart = page.locator(".overview-chart", has=page.locator(
            "svg.chart text.chart-title", has_text=title)).first
        assert chart.locator("svg circle, svg rect:not(.legend-item rect)").count() > 0, title
        assert chart.locator("table tbody tr").count() > 0, by_title[title]
    page.screenshot(path=str(shots / "admin-overview.png"), full_page=True)
