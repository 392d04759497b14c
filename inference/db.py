"""Database calls from the web's async code: one worker thread that keeps its connection.

channels' ``database_sync_to_async`` opens and closes a connection around every call (with
``CONN_MAX_AGE = 0``) and, inside a Django request, runs it on a thread made for that
request. On the completion path that was three connects, three thread hand-offs and a new
thread per request: about half of the web's CPU time per request (py-spy, bench/README.md),
taken from llama.cpp's threads on a small machine. Here every call runs on one long-lived
thread whose connection stays open; it is dropped after a database error that left it
unusable, or re-checked after a quiet spell, as Django's own ``close_old_connections``
would. One thread is enough: a call is a fraction of a millisecond, and SQLite serialises
writers anyway.

``settings.WEB_DB_THREAD = False`` falls back to ``database_sync_to_async``: in-process
tests need it, since their database work happens inside a transaction on the test's own
connection, which no other thread can see.
"""
from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connections
from django.db.backends.base.base import BaseDatabaseWrapper

P = ParamSpec("P")
R = TypeVar("R")

RECHECK_AFTER_IDLE_S = 30.0  # a connection unused this long is pinged before it is trusted

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="web-db")
_last_used = 0.0


async def run(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` on the database thread."""
    if not settings.WEB_DB_THREAD:
        return await database_sync_to_async(fn)(*args, **kwargs)
    call = functools.partial(_call, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor, call)


def sync(fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Decorator: an async version of ``fn`` that runs on the database thread."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return await run(fn, *args, **kwargs)

    return wrapper


def close() -> None:
    """Close the thread's connections (tests that drop their database call this first)."""
    _executor.submit(connections.close_all).result(timeout=30)


def _call(fn: Callable[..., R], *args: object, **kwargs: object) -> R:
    global _last_used
    now = time.monotonic()
    if now - _last_used > RECHECK_AFTER_IDLE_S:
        drop_dead_connections()
    _last_used = now
    try:
        return fn(*args, **kwargs)
    finally:
        tidy_connections()


def drop_dead_connections() -> None:
    """Close this thread's connections that no longer answer (a ping on PostgreSQL)."""
    for conn in connections.all(initialized_only=True):
        if conn.connection is not None and not conn.is_usable():
            conn.close()


def tidy_connections() -> None:
    """After a unit of work on a thread that keeps its connections (this module's thread,
    the daemon's writer): close those an error left unusable or a transaction left open;
    keep the healthy ones. ``close_old_connections`` would close every one of them while
    ``CONN_MAX_AGE`` is 0, and the next query would pay for a new connection."""
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
