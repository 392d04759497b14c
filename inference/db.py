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
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from channels.db import database_sync_to_async
from django.conf import settings
from django.db import connections

from config.db import kept_connections

P = ParamSpec("P")
R = TypeVar("R")

_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="web-db")


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
    with kept_connections():
        return fn(*args, **kwargs)
