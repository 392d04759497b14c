"""A request is watched while some reader follows it: its ``protocol.watch_key`` stays alive.

Every reader of a request in this process (a waited-for answer, a stream, an SSE or
websocket resume) holds ``Watching(request_id)`` (``service.CancelIfAbandoned`` does); one
task per process renews the keys of every request some reader holds, all in one pipeline,
every ``renew_s()``. Each key lives RESUME_GRACE_S past its last renewal. When the last
reader goes nothing is written: the key expires RESUME_GRACE_S later and the daemon cancels
the request (scheduler_daemon/service/watch.py), unless a reader, of this process or of another
(perhaps one started since this one was killed), comes back first. The grace is the
daemon's to enforce: a web process that dies can neither leave a request running for ever
nor have it cancelled at once.

RESUME_GRACE_S 0 turns the watch off: jobs are queued unwatched and a reader that goes
away cancels its request at once (``service.CancelIfAbandoned``).
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from types import TracebackType

from django.conf import settings

from inference import broker
from wire import protocol

log = logging.getLogger(__name__)

MAX_RENEW_S = 1.0  # renewals at least this often...
RENEWALS_PER_GRACE = 3  # ...and at least this many times within one grace (small graces)


def grace_s() -> float:
    """RESUME_GRACE_S: how long a request runs on after its last reader went away."""
    return max(0.0, float(settings.RESUME_GRACE_S))


def enabled() -> bool:
    """Whether requests are watched (a dropped reader leaves them the grace)."""
    return grace_s() > 0


def renew_s() -> float:
    return min(MAX_RENEW_S, grace_s() / RENEWALS_PER_GRACE)


class Watching:
    """Keeps ``request_id``'s watch key alive from ``__aenter__`` (which writes it before
    it returns: a request being queued is watched before a daemon can see it) to
    ``__aexit__`` (which writes nothing: the key expires a grace later). ``written``: the
    caller writes the first key itself, with ``ttl_ms()``, before anything can see the
    request (the enqueue script does, in the same round trip as the job)."""

    def __init__(self, request_id: str, written: bool = False) -> None:
        self.request_id = request_id
        self.written = written
        self._held = False

    async def __aenter__(self) -> Watching:
        if enabled():
            await _renewer().hold(self.request_id, write=not self.written)
            self._held = True
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._held:
            self._held = False
            _renewer().release(self.request_id)


class _Renewer:
    """One per event loop (web process): how many readers hold each request, and the task
    that renews their keys while any does."""

    def __init__(self) -> None:
        self.readers: Counter[str] = Counter()
        self.task: asyncio.Task[None] | None = None

    async def hold(self, request_id: str, write: bool = True) -> None:
        self.readers[request_id] += 1
        try:
            if write:
                await _renew([request_id])
        except asyncio.CancelledError:
            self.release(request_id)
            raise
        except Exception:  # Redis away: the renewal task tries again within renew_s()
            log.warning("could not write the watch key of %s", request_id, exc_info=True)
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())

    def release(self, request_id: str) -> None:
        self.readers[request_id] -= 1
        if self.readers[request_id] <= 0:
            del self.readers[request_id]

    async def _run(self) -> None:
        while self.readers:
            await asyncio.sleep(renew_s())
            try:
                await _renew(list(self.readers))
            except Exception:  # the daemon waits two checks before it cancels: try again
                log.warning("could not renew %d watch keys", len(self.readers), exc_info=True)


def ttl_ms() -> int:
    """A watch key's life from its last write: RESUME_GRACE_S (0: not watched)."""
    return max(1, int(grace_s() * 1000)) if enabled() else 0


async def _renew(request_ids: list[str]) -> None:
    if not request_ids:
        return
    ttl = ttl_ms()
    pipe = broker.async_client().pipeline(transaction=False)
    for request_id in request_ids:
        pipe.set(protocol.watch_key(request_id), 1, px=ttl)
    await pipe.execute()


_renewers: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Renewer] = (
    weakref.WeakKeyDictionary()
)


def _renewer() -> _Renewer:
    loop = asyncio.get_running_loop()
    if loop not in _renewers:
        _renewers[loop] = _Renewer()
    return _renewers[loop]
