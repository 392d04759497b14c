"""inference/db.py: the web's one database thread keeps its connection between calls."""
import asyncio
import threading

import pytest
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
    assert first == second
    assert first[0] != threading.get_ident()


def test_a_transaction_left_open_costs_the_connection(db_thread):
    closed = []

    def close() -> None:  # SQLite ignores close() on the in-memory test database: record it
        closed.append(True)
        transaction.rollback()
        transaction.set_autocommit(True)

    def leave_open() -> None:
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
