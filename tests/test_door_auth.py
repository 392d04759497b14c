"""Authentication at the door: wrong keys cost no database work past a per-address limit, the
proxy's key check, what /v1/health tells strangers, admin logins throttled (django-axes),
and plain HTTP redirected except for what machines reach directly.

In-process (Django's test client, the channels middleware called directly): each test's
client addresses are its own, and conftest.py clears the failure counts between tests.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import string
import threading
import time
from typing import Any

import pytest
from django.contrib.auth.models import User
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from accounts.authentication import Found
from accounts.models import ApiKey
from inference import auth
from tests.conftest import bearer
from wire import protocol

LIMIT = 5
URL = "/v1/models"  # a keyed view that reads only Redis once the key is known
KEY_CHECK = "/v1/internal/key-check"
ALPHABET = string.ascii_letters + string.digits


def random_key() -> str:
    prefix = "".join(secrets.choice(ALPHABET) for _ in range(10))
    return f"sk-{prefix}.{secrets.token_urlsafe(32)}"


def error_of(response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.content
    return response.json()["error"]


@pytest.fixture
def limit(settings):
    settings.AUTH_FAILURES_PER_MINUTE = LIMIT
    return LIMIT


@pytest.fixture
def long_key_cache(monkeypatch):
    """Keys stay fresh in the cache for the test's length (KEY_CACHE_S is 1 s)."""
    auth.keys.forget()
    monkeypatch.setattr(auth, "KEY_CACHE_S", 3600.0)
    yield
    auth.keys.forget()


@pytest.fixture
def fake_lookups(db, monkeypatch):
    """The database lookup replaced by one that counts its calls and finds no key."""
    calls: list[str] = []

    def find_key(raw: str) -> Found:
        calls.append(raw)
        time.sleep(0.01)  # concurrent checks overlap here
        return Found(None, False)

    monkeypatch.setattr(auth, "find_key", find_key)
    return calls


# -- the failed-auth throttle -----------------------------------------------------------------


def test_a_flood_of_wrong_keys_is_refused_without_queries_past_the_limit(
        api, parties, limit, long_key_cache):
    attacker, other = "203.0.113.9", "198.51.100.4"
    assert api.get(URL, REMOTE_ADDR=other, **bearer(parties.owner)).status_code == 200  # cached
    for _ in range(limit):
        assert error_of(api.get(URL, REMOTE_ADDR=attacker, **bearer(random_key())),
                        401)["code"] == "invalid_api_key"
    with CaptureQueriesContext(connection) as queries:
        for _ in range(50):
            reply = api.get(URL, REMOTE_ADDR=attacker, **bearer(random_key()))
            error = error_of(reply, 429)
            assert (error["code"], error["type"]) == ("auth_throttled", "rate_limit_error")
            assert 1 <= int(reply["Retry-After"]) <= 60
        # a key this process holds as good still works from the throttled address
        assert api.get(URL, REMOTE_ADDR=attacker, **bearer(parties.owner)).status_code == 200
    assert queries.captured_queries == []
    # another address is not affected, an unknown key from it is looked up as ever
    assert api.get(URL, REMOTE_ADDR=other, **bearer(parties.member)).status_code == 200
    assert error_of(api.get(URL, REMOTE_ADDR=other, **bearer(random_key())),
                    401)["code"] == "invalid_api_key"
    # a good key this process never saw is refused with the rest from the throttled address
    assert error_of(api.get(URL, REMOTE_ADDR=attacker, **bearer(parties.outsider)),
                    429)["code"] == "auth_throttled"


def test_a_known_key_whose_cached_copy_aged_is_still_looked_up_for_a_throttled_address(
        api, parties, limit, long_key_cache):
    address = "203.0.113.10"
    assert api.get(URL, REMOTE_ADDR=address, **bearer(parties.owner)).status_code == 200
    for _ in range(limit):
        api.get(URL, REMOTE_ADDR=address, **bearer(random_key()))
    assert api.get(URL, REMOTE_ADDR=address, **bearer(random_key())).status_code == 429
    for key in auth.keys._keys.values():
        key.loaded_at -= 7200  # older than any KEY_CACHE_S: the database must say again
    with CaptureQueriesContext(connection) as queries:
        assert api.get(URL, REMOTE_ADDR=address, **bearer(parties.owner)).status_code == 200
    assert len(queries.captured_queries) >= 1
    # its wrong-secret twin is no known key: refused
    twin = f"sk-{parties.owner_key.prefix}.{secrets.token_urlsafe(32)}"
    assert api.get(URL, REMOTE_ADDR=address, **bearer(twin)).status_code == 429


def test_malformed_credentials_count_as_failures(api, parties, limit):
    address = "203.0.113.11"
    for header in ["Bearer garbage", "Basic dXNlcjpwYXNz", "Token x", "Bearer sk-.",
                   "Bearer sk-short.x"]:
        assert api.get(URL, REMOTE_ADDR=address, HTTP_AUTHORIZATION=header).status_code == 401
    assert api.get(URL, REMOTE_ADDR=address,
                   HTTP_AUTHORIZATION="Bearer garbage").status_code == 429
    # no header at all is not a failed check: it stays the 401 that asks for a key
    assert api.get(URL, REMOTE_ADDR=address).status_code == 401


def test_an_ipv6_client_counts_with_its_64_and_ipv4_mapped_as_ipv4(api, parties, limit):
    for i in range(limit):
        api.get(URL, REMOTE_ADDR=f"2001:db8:1:2::{i + 1}", **bearer(random_key()))
    assert api.get(URL, REMOTE_ADDR="2001:db8:1:2:ffff::1",
                   **bearer(random_key())).status_code == 429
    assert api.get(URL, REMOTE_ADDR="2001:db8:1:3::1", **bearer(random_key())).status_code == 401
    for _ in range(limit):
        api.get(URL, REMOTE_ADDR="192.0.2.50", **bearer(random_key()))
    assert api.get(URL, REMOTE_ADDR="::ffff:192.0.2.50",
                   **bearer(random_key())).status_code == 429


PENDING = 8  # PENDING_LOOKUPS_PER_ADDRESS in the concurrency tests


def at_once(check, n: int = 40) -> list[str]:
    """``check()`` on n threads at once: "ok", "401" or "429" of each."""
    outcomes: list[str] = []

    def one() -> None:
        try:
            outcomes.append("401" if check() is None else "ok")
        except auth.AuthThrottled:
            outcomes.append("429")

    threads = [threading.Thread(target=one) for _ in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_concurrent_checks_of_wrong_keys_from_one_address_make_bounded_lookups(
        limit, fake_lookups, monkeypatch):
    """Lookups in progress at once are bounded per address, and none starts once the
    address has its limit of failures: 40 wrong keys at once make at most
    limit - 1 + PENDING lookups, and the address is throttled after them."""
    monkeypatch.setattr(auth, "PENDING_LOOKUPS_PER_ADDRESS", PENDING)
    outcomes = at_once(lambda: auth.lookup(random_key(), "192.0.2.60"))
    assert limit <= len(fake_lookups) <= limit - 1 + PENDING
    assert sorted(outcomes) == ["401"] * len(fake_lookups) + ["429"] * (40 - len(fake_lookups))
    with pytest.raises(auth.AuthThrottled):
        auth.lookup(random_key(), "192.0.2.60")


def test_concurrent_checks_of_a_good_key_with_nothing_cached_are_not_throttled(
        parties, limit, monkeypatch):
    """Clients reconnecting at once from one address after a restart (no key cached): more
    checks than the failure limit, all looked up, none refused, nothing counted against
    the address."""
    auth.keys.forget()
    row = ApiKey.objects.get(prefix=parties.owner_key.prefix)

    def find_key(raw: str) -> Found:
        time.sleep(0.05)  # the checks overlap here
        return Found(row, True)

    monkeypatch.setattr(auth, "find_key", find_key)
    monkeypatch.setattr(auth.keys, "get", lambda raw: False)  # every check asks
    assert at_once(lambda: auth.lookup(parties.owner, "192.0.2.61"), n=4 * limit) == (
        ["ok"] * 4 * limit)
    monkeypatch.undo()
    for _ in range(limit - 1):  # the address's failures start from none
        assert auth.lookup(random_key(), "192.0.2.61") is None


def test_the_window_ends_and_a_good_lookup_gives_its_count_back(parties, limit, monkeypatch):
    address = "192.0.2.61"
    for _ in range(limit - 1):
        assert auth.lookup(random_key(), address) is None
    for _ in range(3):  # good keys (looked up each time) do not count
        auth.keys.forget()
        assert auth.lookup(parties.owner, address) is not None
    assert auth.lookup(random_key(), address) is None  # the limit-th failure
    with pytest.raises(auth.AuthThrottled):
        auth.lookup(random_key(), address)
    later = time.monotonic() + auth.FAILURE_WINDOW_S + 1
    monkeypatch.setattr(auth.time, "monotonic", lambda: later)
    assert auth.lookup(random_key(), address) is None  # a new window


def test_tracked_addresses_are_bounded(limit, fake_lookups, monkeypatch):
    monkeypatch.setattr(auth, "MAX_TRACKED_ADDRESSES", 100)
    for i in range(1000):
        auth.lookup(random_key(), f"10.20.{i // 250}.{i % 250}")
    assert len(auth.failures._windows) == 100


# -- the negative cache -------------------------------------------------------------------------


def test_an_unknown_prefix_is_answered_without_a_query_until_it_expires(
        api, parties, settings, monkeypatch):
    settings.AUTH_FAILURES_PER_MINUTE = 0  # the throttle off: the cache alone
    unknown = random_key()
    with CaptureQueriesContext(connection) as first:
        assert api.get(URL, **bearer(unknown)).status_code == 401
    assert len(first.captured_queries) == 1
    with CaptureQueriesContext(connection) as again:
        for secret in ("a", "b", "c"):  # any secret under that prefix
            other = unknown.rsplit(".", 1)[0] + f".{secret}"
            assert api.get(URL, **bearer(other)).status_code == 401
    assert again.captured_queries == []
    later = time.monotonic() + settings.AUTH_NEGATIVE_CACHE_S + 1
    monkeypatch.setattr(auth.time, "monotonic", lambda: later)
    with CaptureQueriesContext(connection) as expired:
        assert api.get(URL, **bearer(unknown)).status_code == 401
    assert len(expired.captured_queries) == 1


def test_a_key_made_with_a_remembered_prefix_works_at_once(api, parties, settings):
    settings.AUTH_FAILURES_PER_MINUTE = 0
    api_key = ApiKey(tenant=parties.a, name="late")
    plaintext = api_key.assign_secret()
    assert api.get(URL, **bearer(plaintext)).status_code == 401  # no such prefix yet
    api_key.save()  # post_save forgets the prefix
    assert api.get(URL, **bearer(plaintext)).status_code == 200


def test_a_known_prefix_with_a_wrong_secret_is_not_remembered(api, parties, settings):
    settings.AUTH_FAILURES_PER_MINUTE = 0
    twin = f"sk-{parties.owner_key.prefix}.{secrets.token_urlsafe(32)}"
    assert api.get(URL, **bearer(twin)).status_code == 401
    assert parties.owner_key.prefix not in auth.unknown_prefixes
    auth.keys.forget()
    assert api.get(URL, **bearer(parties.owner)).status_code == 200


def test_the_negative_cache_is_bounded(fake_lookups, settings, monkeypatch):
    settings.AUTH_FAILURES_PER_MINUTE = 0
    monkeypatch.setattr(auth, "MAX_UNKNOWN_PREFIXES", 50)
    for _ in range(200):
        auth.lookup(random_key(), "192.0.2.70")
    assert len(auth.unknown_prefixes._until) == 50


# -- the websocket ------------------------------------------------------------------------------


def test_websocket_lookups_count_against_the_connections_address(limit, fake_lookups):
    """The middleware's header lookup and the consumer's ``auth`` message (``key_for``,
    which has no request) both count against the connection's client address."""
    seen: list[tuple[Any, ...]] = []

    async def consumer(scope: dict, receive: Any, send: Any) -> None:
        try:
            looked_up = await auth.key_for(random_key())
        except auth.AuthThrottled:
            looked_up = "throttled"
        seen.append((scope["api_key"], scope["auth_error"], looked_up,
                     scope.get("auth_error_code")))

    app = auth.ApiKeyAuthMiddleware(consumer)

    async def connect(address: str, key: str | None = None) -> None:
        headers = [(b"authorization", f"Bearer {key}".encode())] if key else []
        await app({"type": "websocket", "client": [address, 50000], "headers": headers},
                  None, None)

    async def run() -> None:
        for _ in range(limit // 2):
            await connect("192.0.2.80", random_key())  # two failures each
        await connect("192.0.2.80")  # the auth message: the limit-th failure
        await connect("192.0.2.80", random_key())
        await connect("192.0.2.81", random_key())

    asyncio.run(run())
    assert len(fake_lookups) == limit + 2  # nothing for the throttled connection
    assert all(s[1] == auth.BAD_KEY for s in seen[:limit // 2])
    throttled = seen[-2]
    assert throttled[0] is None and throttled[1].startswith("Too many failed API key checks")
    assert throttled[2:] == ("throttled", "auth_throttled")  # the socket closes with that code
    assert seen[-1][1] == auth.BAD_KEY  # another address: looked up


# -- the key check (nginx's auth_request) --------------------------------------------------------


def test_key_check_answers_204_for_a_usable_key_in_either_header(parties):
    client = Client(REMOTE_ADDR="192.0.2.90")
    for headers in (bearer(parties.owner), {"HTTP_X_API_KEY": parties.member}):
        reply = client.get(KEY_CHECK, **headers)
        assert reply.status_code == 204, headers
        assert reply.content == b""


def test_key_check_answers_401_with_the_refusal_for_no_key_or_an_unusable_one(parties):
    client = Client(REMOTE_ADDR="192.0.2.91")
    parties.owner_key.revoke()
    for headers in ({}, {"HTTP_AUTHORIZATION": "Bearer junk"},
                    {"HTTP_AUTHORIZATION": "Basic dXNlcjpwYXNz"}, {"HTTP_X_API_KEY": "sk-x"},
                    bearer(random_key()), bearer(parties.owner)):
        reply = client.get(KEY_CHECK, **headers)
        assert reply.status_code == 401, headers
        assert reply["X-Refusal"] == "invalid_api_key"


def test_key_check_answers_403_for_a_throttled_address_but_passes_a_cached_key(
        parties, limit, long_key_cache):
    client = Client(REMOTE_ADDR="192.0.2.92")
    assert client.get(KEY_CHECK, **bearer(parties.owner)).status_code == 204
    for _ in range(limit):
        assert client.get(KEY_CHECK, HTTP_X_API_KEY=random_key()).status_code == 401
    with CaptureQueriesContext(connection) as queries:
        reply = client.get(KEY_CHECK, **bearer(random_key()))
        assert reply.status_code == 403
        assert reply["X-Refusal"] == "auth_throttled"
        assert 1 <= int(reply["Retry-After"]) <= 60
        assert "X-Accel-Expires" not in reply  # not a flood yet: the door asks again
        assert client.get(KEY_CHECK, **bearer(parties.owner)).status_code == 204
    assert queries.captured_queries == []
    assert Client(REMOTE_ADDR="192.0.2.93").get(
        KEY_CHECK, **bearer(parties.member)).status_code == 204


def test_key_check_tells_the_door_to_keep_its_refusal_once_the_address_floods(
        parties, limit):
    """A throttled address refused as many times again as it may fail is flooding: the
    403 then carries X-Accel-Expires (its Retry-After), the door's cue to answer the
    address alone until the window ends."""
    client = Client(REMOTE_ADDR="192.0.2.95")
    for _ in range(limit):
        assert client.get(KEY_CHECK, **bearer(random_key())).status_code == 401
    for _ in range(limit - 1):
        assert "X-Accel-Expires" not in client.get(KEY_CHECK, **bearer(random_key()))
    reply = client.get(KEY_CHECK, **bearer(random_key()))
    assert reply.status_code == 403
    assert reply["X-Accel-Expires"] == reply["Retry-After"]
    other = Client(REMOTE_ADDR="192.0.2.96").get(KEY_CHECK, **bearer(random_key()))
    assert other.status_code == 401 and "X-Accel-Expires" not in other


def test_key_check_needs_no_csrf_token_and_sets_no_cookie(parties):
    client = Client(enforce_csrf_checks=True, REMOTE_ADDR="192.0.2.94")
    reply = client.post(KEY_CHECK, **bearer(parties.owner))
    assert reply.status_code == 204
    assert not reply.cookies


# -- /v1/health ------------------------------------------------------------------------------------


def publish(redis_client, model: str, stuck: bool = False) -> str:
    """A live daemon's snapshot whose id names its host and process, as real ones do."""
    daemon_id, now = f"gpu-host-7.internal:{secrets.randbelow(10**6)}", time.time()
    snapshot = {"daemon_id": daemon_id, "model": model, "heartbeat_at": now,
                "started_at": now - 5, "restarts": 1, "last_exit": "killed by signal 9",
                "loop": {"stuck": stuck}, "slots": [{"state": "idle"}],
                "queue": [{"request_id": "r"}]}
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snapshot), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: now})
    return daemon_id


@pytest.fixture
def daemon(redis_client):
    daemon_ids = [publish(redis_client, "door-model"), publish(redis_client, "door-stuck", True)]
    yield daemon_ids[0]
    for daemon_id in daemon_ids:
        redis_client.delete(protocol.daemon_key(daemon_id))
        redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)


def test_anonymous_health_says_only_which_models_are_up(db, daemon, settings):
    settings.MODELS = ["door-model", "door-absent"]
    reply = Client().get("/v1/health")
    assert reply.status_code == 200
    body = reply.json()  # (other live daemons of the test Redis may be listed too)
    assert set(body) == {"status", "models", "model_status"} and body["status"] == "ok"
    assert "door-model" in body["models"] and "door-stuck" not in body["models"]
    assert list(body["model_status"])[:2] == ["door-model", "door-absent"]  # MODELS first
    assert {name: body["model_status"][name] for name in ("door-model", "door-absent",
            "door-stuck")} == {"door-model": "up", "door-absent": "down", "door-stuck": "down"}
    assert "gpu-host" not in reply.content.decode()


def test_a_key_or_a_staff_session_sees_the_daemons(parties, daemon, settings):
    settings.MODELS = ["door-model"]
    keyed = Client().get("/v1/health", **bearer(parties.member)).json()
    listed = next(d for d in keyed["daemons"] if d["daemon_id"] == daemon)
    assert listed["queue_depth"] == 1 and listed["restarts"] == 1
    assert (keyed["model_status"]["door-model"], keyed["model_status"]["door-stuck"]) == (
        "up", "down")
    staff = Client()
    staff.force_login(User.objects.create_user("ops", is_staff=True))
    assert daemon in json.dumps(staff.get("/v1/health").json()["daemons"])
    viewer = Client()
    viewer.force_login(User.objects.create_user("viewer", is_staff=False))
    assert "daemons" not in viewer.get("/v1/health").json()
    forged = Client()
    forged.cookies["sessionid"] = "not-a-session"
    assert "daemons" not in forged.get("/v1/health").json()


def test_health_with_a_wrong_key_is_401(db):
    assert error_of(Client().get("/v1/health", **bearer(random_key())),
                    401)["code"] == "invalid_api_key"


# -- admin logins (django-axes) -------------------------------------------------------------------


def login(client: Client, password: str):
    return client.post("/admin/login/?next=/admin/",
                       {"username": "root", "password": password, "next": "/admin/"})


def test_the_sixth_wrong_admin_password_is_refused_and_the_right_one_after_it(db, settings):
    User.objects.create_superuser("root", "root@example.com", "right-password-1")
    attacker = Client(REMOTE_ADDR="192.0.2.100")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        reply = login(attacker, "wrong")
        assert reply.status_code == 200 and b"Please enter the correct" in reply.content
    for _ in range(2):  # the limit-th failure locks the address out; so is the next try
        refused = login(attacker, "wrong")
        assert refused.status_code == 429
        assert b"too many login attempts" in refused.content.lower()
        assert not refused.content.lstrip().startswith(b"{")  # a page, not the API's error
    right = login(attacker, "right-password-1")
    assert right.status_code == 429
    assert attacker.get("/admin/").status_code == 302  # not logged in
    # the administrator elsewhere is not locked out
    elsewhere = Client(REMOTE_ADDR="198.51.100.100")
    reply = login(elsewhere, "right-password-1")
    assert reply.status_code == 302 and reply["Location"] == "/admin/"
    assert elsewhere.get("/admin/").status_code == 200


# -- plain HTTP -----------------------------------------------------------------------------------


@override_settings(SECURE_SSL_REDIRECT=True)
def test_plain_http_is_redirected_except_what_machines_reach_directly(parties):
    client = Client()
    for path in ("/admin/login/", URL, "/v1/docs"):
        reply = client.get(path)
        assert reply.status_code == 301 and reply["Location"].startswith("https://"), path
    assert client.get(URL, HTTP_X_FORWARDED_PROTO="https",
                      **bearer(parties.owner)).status_code == 200
    assert client.get(KEY_CHECK, **bearer(parties.owner)).status_code == 204
    assert client.get("/v1/health").status_code == 200
    for path in ("/metrics", "/v1/metrics"):
        assert client.get(path).status_code == 200, path
