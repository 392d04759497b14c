"""The playground and the live admin pages in a real headless Chromium (Playwright driving
Debian's /usr/bin/chromium) against real daphne and a real ``run_scheduler`` with Gemma.
Screenshots go to a temporary directory, or to ``SCREENSHOT_DIR`` when set (`make
screenshots` points it at docs/screenshots/)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from config.models import SMOLLM2
from tests.live_service import ROOT, RealDaemon, WebServer, shared_daemon

# A long reply to stop mid-way: within one tenant's KV share (KV_TENANT_SHARE 0.5 of the
# live daemons' N_CTX 2048, prompt included).
LONG_MAX_TOKENS = 900

pytestmark = pytest.mark.slow
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
MAKE_STAFF = ("from django.contrib.auth.models import User; "
              "User.objects.filter(username='ops').exists() or "
              "User.objects.create_superuser('ops', 'ops@example.com', 'ops-password')")
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    """Where screenshots go: ``SCREENSHOT_DIR``, else a temporary directory (a test run
    leaves the tracked docs/screenshots/ alone)."""
    where = os.environ.get("SCREENSHOT_DIR")
    return Path(where) if where else tmp_path_factory.mktemp("screenshots")


@pytest.fixture(scope="module")
def live(web: WebServer) -> tuple[WebServer, RealDaemon]:
    subprocess.run([sys.executable, "manage.py", "shell", "-c", MAKE_STAFF], cwd=ROOT,
                   env=web.env, check=True)
    return web, shared_daemon(web)


@pytest.fixture(scope="module")
def browser() -> Iterator:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium (apt-get install "
                    "chromium; `make test` does it when run as root). The browser tests need it.")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def context(browser) -> Iterator:
    ctx = browser.new_context(viewport={"width": 1400, "height": 900})
    ctx.set_default_timeout(TIMEOUT_MS)
    yield ctx
    ctx.close()


def open_playground(context, live, key: str | None = None):
    web, daemon = live
    page = context.new_page()
    page.goto(f"{web.base_url}/playground/")
    page.fill("#key", key or web.keys["owner"])
    page.click("#load-models")
    page.wait_for_selector(f"#model option[value='{daemon.model}']", state="attached")
    page.select_option("#model", daemon.model)
    return page


def ask(page, text: str, max_tokens: int = 24, ignore_eos: bool = False) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", "0")
    page.set_checked("#ignore-eos", ignore_eos)
    page.fill("#message", text)
    page.click("#send")


def last_stats(page, contains: str) -> str:
    locator = page.locator(".turn.assistant .stats").last
    try:
        locator.filter(has_text=contains).wait_for()
    except Exception as exc:
        raise AssertionError(f"no {contains!r}; page shows: {page.inner_text('body')}") from exc
    return locator.inner_text()


def admin_page(context, live, which: str):
    web, _ = live
    page = context.new_page()
    page.goto(f"{web.base_url}/admin/live/{which}/")
    if "/admin/login/" in page.url:  # the first admin page of this browser context
        page.fill("#id_username", "ops")
        page.fill("#id_password", "ops-password")
        page.click("input[type=submit]")
    page.wait_for_selector("#live-status:has-text('live daemon')")
    return page


def test_playground_streams_a_multi_turn_chat(context, live, shots):
    page = open_playground(context, live)
    page.fill("#system", "You are a terse assistant.")
    ask(page, "Name three colours.")
    first = last_stats(page, "finish:")
    assert re.search(r"TTFT \d+ ms", first) and "prompt" in first
    assert page.locator(".turn.assistant .content").last.inner_text().strip()
    ask(page, "And three animals?")
    second = last_stats(page, "finish:")
    cached = int(re.search(r"(\d+) cached", second).group(1))
    assert cached > 0, second  # the resent history hit the tenant's prefix cache
    page.screenshot(path=str(shots / "playground.png"), full_page=True)


def test_the_playground_defaults_to_the_chat_model(context, live, shots):
    """With the chat model's daemon live, the model list opens on it (the first of MODELS)
    and a question sent without choosing gets its answer."""
    web, _ = live
    shared_daemon(web, "chat")
    page = context.new_page()
    page.goto(f"{web.base_url}/playground/")
    page.fill("#key", web.keys["owner"])
    page.click("#load-models")
    page.wait_for_selector(f"#model option[value='{SMOLLM2}']", state="attached")
    assert page.input_value("#model") == SMOLLM2
    ask(page, "What is the capital of France?")
    last_stats(page, "finish:")
    answer = page.locator(".turn.assistant .content").last.inner_text()
    assert "Paris" in answer, answer
    page.screenshot(path=str(shots / "playground-chat-model.png"), full_page=True)


def test_stop_cancels_mid_stream(context, live):
    page = open_playground(context, live)
    ask(page, "Count to one thousand.", max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    page.locator(".turn.assistant .stats").last.filter(has_text="tokens/s").wait_for()
    page.click("#stop")
    stats = last_stats(page, "finish:")
    assert "finish: cancelled" in stats
    assert int(re.search(r"(\d+) tokens ·", stats).group(1)) < LONG_MAX_TOKENS


def test_a_wrong_key_shows_an_error(context, live):
    web, _ = live
    page = context.new_page()
    page.goto(f"{web.base_url}/playground/")
    page.fill("#key", "sk-wrongwrong.nope")
    page.fill("#message", "Hello?")
    page.click("#send")
    page.locator("#error").filter(has_text="Invalid API key").wait_for()


def test_admin_slots_follow_a_stream_and_cancel_ends_it(context, live, shots):
    _, daemon = live
    client = open_playground(context, live)
    ask(client, "Tell a long story.", max_tokens=LONG_MAX_TOKENS, ignore_eos=True)
    client.locator(".turn.assistant .stats").last.filter(has_text="tokens/s").wait_for()
    slots = admin_page(context, live, "slots")
    row = slots.locator("#live-root tr", has_text=daemon.daemon_id).filter(has_text="generating")
    row.first.wait_for()
    assert "Alpha" in row.first.inner_text()
    slots.wait_for_timeout(1500)  # two polls: tokens/s is known
    slots.screenshot(path=str(shots / "admin-slots.png"), full_page=True)
    row.first.get_by_role("button", name="Cancel").click()
    slots.locator("#live-message").filter(has_text="Cancel sent").wait_for()
    assert "finish: cancelled" in last_stats(client, "finish:")
    idle = slots.locator("#live-root tr", has_text=daemon.daemon_id).filter(has_text="generating")
    idle.first.wait_for(state="detached")


def test_queue_cache_and_daemon_pages(context, live, shots):
    _, daemon = live
    # 2 slots and 8 KV blocks of 256 tokens: two 600-token requests run, the third waits.
    clients = [open_playground(context, live) for _ in range(3)]
    for n, client in enumerate(clients):
        ask(client, f"Story number {n}.", max_tokens=600, ignore_eos=True)
    queue = admin_page(context, live, "queue")
    queue.locator("#live-root tr", has_text=daemon.daemon_id).first.wait_for()
    queue.screenshot(path=str(shots / "admin-queue.png"), full_page=True)
    for client in clients:
        client.click("#stop")
    for client in clients:
        client.locator("#send:enabled").wait_for()
    cache = admin_page(context, live, "cache")
    cache.locator("#live-root tr", has_text="Alpha").first.wait_for()
    cache.screenshot(path=str(shots / "admin-cache.png"), full_page=True)
    daemons = admin_page(context, live, "daemons")
    daemons.on("dialog", lambda dialog: dialog.accept())
    row = daemons.locator("#live-root tr", has_text=daemon.daemon_id)
    row.get_by_role("button", name="Drain").click()
    row.filter(has_text="draining").wait_for()
    assert daemon.snapshot().get("draining") is True
    daemons.screenshot(path=str(shots / "admin-daemons.png"), full_page=True)
    row.get_by_role("button", name="Resume").click()
    row.filter(has_text="serving").wait_for()
    assert daemon.snapshot().get("draining") is False
