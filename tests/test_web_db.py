"""inference/db.py: the web's one database thread keeps its connection between calls; off
(in-process tests), calls use the test's own connection and leave its transaction alone."""
import asyncio
import threading

import pytest
from asgiref.sync import async_to_sync
from django.db import connection, transaction

from accounts.models import Tenant
from inference import db

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def db_thread(settings):
    settings.WEB_DB_THREAD = True  # conftest turns it off for in-process tests
    yield
    db.close()


def _probe() -> tuple[int, int]:
    Tenant.objects.count()
    return threading.get_ident(), id(connection.connection)


def test_calls_share_one_thread_and_connection(db_thread):
    first = asyncio.run(db.run(_probe))
    second = asyncio.run(db.run(_probe))
    assert first[0] == second[0] != threading.get_ident()
    if not connection.settings_dict["OPTIONS"].get("pool"):  # a pool hands out any of its own
        assert first[1] == second[1]


def test_a_transaction_left_open_costs_the_connection(db_thread):
    closed = []
    real_close = None

    def close() -> None:  # SQLite ignores close() on the in-memory test database: record it
        closed.append(True)
        transaction.rollback()
        transaction.set_autocommit(True)
        real_close()  # (a pool takes its connection back)

    def leave_open() -> None:
        nonlocal real_close
        real_close = connection.close
        connection.close = close  # this thread's wrapper only
        transaction.set_autocommit(False)
        Tenant.objects.count()

    asyncio.run(db.run(leave_open))
    try:
        assert closed == [True]
        assert asyncio.run(db.run(connection.get_autocommit))
    finally:
        asyncio.run(db.run(lambda: connection.__dict__.pop("close", None)))


def test_errors_reach_the_caller(db_thread):
    def fails() -> None:
        raise ValueError("nope")

    with pytest.raises(ValueError, match="nope"):
        asyncio.run(db.run(fails))
    assert asyncio.run(db.run(_probe))  # the thread still serves


def test_off_runs_through_channels(settings):
    settings.WEB_DB_THREAD = False
    ident = asyncio.run(db.run(lambda: threading.current_thread().name))
    assert not ident.startswith("web-db")


def _thread_name() -> str:
    return threading.current_thread().name


def test_sync_callers_wait_for_the_database_thread(db_thread):
    """DRF authenticates on the request's thread: ``call`` hands the lookup over."""
    assert db.call(_thread_name).startswith(db.THREAD_NAME)
    inner = asyncio.run(db.run(db.call, _thread_name))  # from the thread itself: no deadlock
    assert inner.startswith(db.THREAD_NAME)


@pytest.mark.django_db  # inside the test's transaction (PostgreSQL: a closed connection)
def test_off_uses_the_tests_connection_and_keeps_its_transaction(settings):
    settings.WEB_DB_THREAD = False
    closed = []
    Tenant.objects.create(slug="uncommitted", name="Uncommitted")
    connection.close = lambda: closed.append(True)  # this thread's wrapper only
    try:
        seen = async_to_sync(db.run)(Tenant.objects.filter(slug="uncommitted").exists)
        assert seen and db.call(Tenant.objects.filter(slug="uncommitted").exists)
        assert closed == []
    finally:
        del connection.close
