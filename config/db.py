"""Database connections kept by a long-lived thread (the web's database thread in
``inference/db.py``, the daemon's event writer in ``scheduler_daemon/history.py``).

``close_old_connections`` would close every connection after each unit of work while
``CONN_MAX_AGE`` is 0, and the next query would pay for a new one; these keep the healthy
ones, as Django would with a connection age limit and health checks.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

RECHECK_AFTER_IDLE_S = 30.0  # a connection unused this long is pinged before it is trusted

_local = threading.local()


@contextmanager
def kept_connections() -> Iterator[None]:
    """Around one unit of database work on a thread that keeps its connections."""
    now = time.monotonic()
    if now - getattr(_local, "last_used", 0.0) > RECHECK_AFTER_IDLE_S:
        _drop_dead_connections()
    _local.last_used = now
    try:
        yield
    finally:
        _tidy_connections()


def _drop_dead_connections() -> None:
    """Close this thread's connections that no longer answer (a ping on PostgreSQL)."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and not conn.is_usable():
            conn.close()


def _tidy_connections() -> None:
    """After a unit of work: close this thread's connections that an error left unusable or
    a transaction left open; keep the healthy ones."""
    for conn in connections.all(initialized_only=True):
        _tidy(conn)


def _tidy(conn: BaseDatabaseWrapper) -> None:
    """Django's ``close_if_unusable_or_obsolete`` without the age limit."""
    if conn.connection is None:
        return
    if conn.get_autocommit() != conn.settings_dict["AUTOCOMMIT"]:
        conn.close()  # a transaction was left open: start clean
    elif conn.errors_occurred:
        if conn.is_usable():
            conn.errors_occurred = False
        else:
            conn.close()
