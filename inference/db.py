"""The web's database calls from async code (and the key lookup): one long-lived thread.

Under ASGI Django runs each request's sync code on a thread made for that request, so a
connection opened there dies with it (Django's docs: no persistent connections under ASGI).
The API's database work (the key lookup of every request, admission and history rows, the
websocket's checks) runs instead on this one thread, whose connection lives as long as
``CONN_MAX_AGE`` allows, or comes back from the pool (PostgreSQL; config/settings.py).
A new SQLite connection costs ~0.5 ms of CPU (Django registers its SQL functions, the WAL
pragmas run): more than the queries of a request. Each unit of work is wrapped in
``close_old_connections()``, as Django wraps a request: a connection an error left
unusable, a transaction left open, or one past ``CONN_MAX_AGE`` is dropped
(``CONN_HEALTH_CHECKS`` pings a reused one first). One thread is enough: a call is a
fraction of a millisecond, and SQLite serialises writers anyway.

- ``run(fn, ...)``: from async code; ``@sync``: a decorator for the same.
- ``call(fn, ...)``: from a sync thread (DRF authenticates on the request's thread).

``settings.WEB_DB_THREAD = False`` (in-process tests) runs calls where Django runs sync
code (``sync_to_async``): on the thread of a test that drives the view, whose connection
holds the test's uncommitted data; connections inside a transaction are left alone.
"""
from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connections

P = ParamSpec("P")
R = TypeVar("R")

THREAD_NAME = "web-db"
_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)


async def run(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` on the database thread."""
    if not settings.WEB_DB_THREAD:
        return await sync_to_async(_in_place, thread_sensitive=True)(fn, *args, **kwargs)
    unit = functools.partial(_unit, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor, unit)


def call(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` on the database thread, from sync code (which waits)."""
    if not settings.WEB_DB_THREAD:
        return _in_place(fn, *args, **kwargs)
    if threading.current_thread().name.startswith(THREAD_NAME):
        return fn(*args, **kwargs)  # already there (a unit of work calling another)
    return _executor.submit(_unit, fn, *args, **kwargs).result()


def sync(fn: Callable[P, R]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Decorator: an async version of ``fn`` that runs on the database thread."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        return await run(fn, *args, **kwargs)

    return wrapper


def close() -> None:
    """Close the thread's connections (tests that drop their database call this first)."""
    _executor.submit(connections.close_all).result(timeout=30)


def _unit(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    close_old_connections()
    try:
        return fn(*args, **kwargs)
    finally:
        close_old_connections()


def _in_place(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    try:
        return fn(*args, **kwargs)
    finally:
        if not _in_transaction():
            close_old_connections()


def _in_transaction() -> bool:
    """Whether one of this thread's open connections is inside a transaction."""
    return any(conn.connection is not None and not conn.get_autocommit()
               for conn in connections.all(initialized_only=True))
