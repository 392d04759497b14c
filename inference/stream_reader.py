"""One reader per web process for every request stream it follows: one XREAD BLOCK over them all.

Each follower of a request's events stream (a streamed or waited-for request, an SSE or
websocket resume) used to wait in an XREAD BLOCK of its own on a pooled connection: per
event, a command, a reply and a task wake-up per stream. Here one task per event loop (one
web process) reads every followed stream in one XREAD BLOCK on a connection of its own and
hands each follower its entries, in order, each once; a daemon's flush (one pipeline for
all its streams) mostly arrives as one reply. Followers wait on a future, not on Redis, so
cancelling one (its client left) costs nothing and leaves no command half-read.

A follower that joins while the read is blocked without its stream wakes it: one XADD to
this reader's own wake stream (``protocol.reader_wake_stream``), which the read includes.
A follower that leaves is dropped at once: the next read no longer names its stream, and
what the current one returns for it is discarded. Redis away: the read is retried with
backoff, and every follower's read fails with its error until a read works again
(``broker.read_events`` counts the outage, as it did for its own reads). The task ends when
no follower is left.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

import redis
import redis.asyncio as aredis

from wire import protocol
from wire.backoff import Backoff
from wire.protocol import as_text, entry_order

log = logging.getLogger(__name__)

READ_BLOCK_MS = 1000  # the shared read's longest block (a follower's own wait is its own)
READ_COUNT = 1000  # entries per stream per read (a resume from 0-0 of a long stream: several)
WAKE_TTL_S = 3600  # the wake stream outlives a dead process by at most this


class Follower:
    """One reader's place in one stream: what the shared read fetched for it and not yet
    handed out (``buffer``), and up to where (``fetched``)."""

    __slots__ = ("stream", "fetched", "buffer", "waiter", "failure")

    def __init__(self, stream: str, after: str) -> None:
        self.stream = stream
        self.fetched = after  # the last entry id taken into ``buffer`` (or skipped)
        self.buffer: deque[tuple[str, Any]] = deque()  # (entry id, decoded entry)
        self.waiter: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None  # its stream held an entry we cannot read

    def _notify(self, error: BaseException | None = None) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(None)


class StreamReader:
    """Every followed stream of one event loop, read by one task (``_run``)."""

    def __init__(self, connect: Callable[[], aredis.Redis], waker: Callable[[], aredis.Redis],
                 decode: Callable[[str, Any], Any]) -> None:
        """``connect``: a client for the reader's own connection; ``waker``: a client for
        short commands (the wake); ``decode(entry_id, fields)``: an entry as followers get it."""
        self._connect = connect
        self._waker = waker
        self._decode = decode
        self.wake_stream = protocol.reader_wake_stream(uuid.uuid4().hex)
        self._wake_after = "0-0"
        self._followers: dict[str, set[Follower]] = {}
        self._in_flight: dict[str, str] | None = None  # the blocked read's streams -> ids
        self._task: asyncio.Task[None] | None = None
        self._client: aredis.Redis | None = None
        self._error: BaseException | None = None  # the shared read's failure, until it reads again

    # -- followers --------------------------------------------------------------------------

    def follow(self, stream: str, after: str) -> Follower:
        follower = Follower(stream, after)
        self._followers.setdefault(stream, set()).add(follower)
        if self._task is None or self._task.done():
            self._error = None  # a new task's first read finds out afresh
            self._task = asyncio.get_running_loop().create_task(self._run())
        return follower

    def leave(self, follower: Follower) -> None:
        """Drop a follower at once (its entries of the read in flight are discarded)."""
        followers = self._followers.get(follower.stream)
        if followers is not None:
            followers.discard(follower)
            if not followers:
                del self._followers[follower.stream]
        follower.buffer.clear()
        if follower.waiter is not None:
            follower.waiter.cancel()  # a wait of another task's: it ends
            follower.waiter = None

    def streams(self) -> set[str]:
        """The streams followed now."""
        return set(self._followers)

    async def read(self, follower: Follower, after: str, block_ms: int,
                   count: int | None = None) -> list[Any]:
        """Entries of the follower's stream after ``after``, waiting up to ``block_ms`` for
        the first; [] when none came. Raises what the shared read failed with meanwhile."""
        if follower.failure is not None:
            raise follower.failure  # that request's error alone (a 500), as before
        self._seek(follower, after)
        if not follower.buffer:
            if self._error is not None:
                raise self._error  # Redis is away: the caller counts the outage
            if self._in_flight is not None and not self._covers(follower):
                await self._wake()
            loop = asyncio.get_running_loop()
            follower.waiter = loop.create_future()
            try:
                async with asyncio.timeout(block_ms / 1000):
                    await follower.waiter
            except TimeoutError:
                pass
            finally:
                follower.waiter = None
            if not follower.buffer and self._error is not None:
                raise self._error
        out = []
        while follower.buffer and (count is None or len(out) < count):
            out.append(follower.buffer.popleft()[1])
        return out

    def _seek(self, follower: Follower, after: str) -> None:
        """Start the follower after ``after``: entries up to it are dropped from its buffer;
        an ``after`` before what was fetched (and already handed out) fetches again."""
        mark = entry_order(after)
        while follower.buffer and entry_order(follower.buffer[0][0]) <= mark:
            follower.buffer.popleft()
        if not follower.buffer and entry_order(follower.fetched) != mark:
            follower.fetched = after

    def _covers(self, follower: Follower) -> bool:
        """Whether the read in flight names the follower's stream from its place or before."""
        assert self._in_flight is not None
        since = self._in_flight.get(follower.stream)
        return since is not None and entry_order(since) <= entry_order(follower.fetched)

    async def _wake(self) -> None:
        """End the blocked read now (it names this stream): an entry in the wake stream."""
        pipe = self._waker().pipeline(transaction=False)
        pipe.xadd(self.wake_stream, {"w": "1"}, maxlen=1, approximate=False)
        pipe.expire(self.wake_stream, WAKE_TTL_S)
        await pipe.execute()

    # -- the shared read -----------------------------------------------------------------------

    async def _run(self) -> None:
        outage = Backoff()
        while self._followers:
            streams = {stream: min((f.fetched for f in followers), key=entry_order)
                       for stream, followers in self._followers.items()}
            streams[self.wake_stream] = self._wake_after
            self._in_flight = streams
            try:
                if self._client is None:
                    self._client = self._connect()
                    # the reply as Redis sends it: entries' fields stay flat lists, which
                    # ``decode`` reads (redis-py's own parsing of each reply into dicts was
                    # a tenth of a streaming web process's CPU)
                    self._client.set_response_callback("XREAD", _raw)
                reply = await self._client.execute_command(
                    "XREAD", "COUNT", READ_COUNT, "BLOCK", READ_BLOCK_MS, "STREAMS",
                    *streams.keys(), *streams.values())
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                self._in_flight = None  # not blocked while it backs off
                self._error = exc
                for followers in list(self._followers.values()):
                    for follower in followers:
                        follower._notify(exc)
                await asyncio.sleep(outage.failed(exc))
                continue
            finally:
                self._in_flight = None
            outage.succeeded()
            self._error = None
            try:
                self._deliver(reply or [], streams)
            except Exception:  # a bug here must not stop every stream of this process
                log.exception("the stream reader failed to hand out a reply; carrying on")

    def _deliver(self, reply: list[Any], since: dict[str, str]) -> None:
        """Hand each follower the entries after its place, from a read that started at or
        before it (a follower that joined behind the read waits for the next one: the read
        may have skipped entries it wants)."""
        for raw_stream, entries in (reply.items() if isinstance(reply, dict) else reply):
            stream = raw_stream.decode() if isinstance(raw_stream, bytes) else raw_stream
            if stream == self.wake_stream:
                self._wake_after = as_text(entries[-1][0])
                continue
            followers = self._followers.get(stream)
            if not followers:
                continue  # its followers left while the read was in flight
            try:
                events = [(as_text(entry_id), self._decode(as_text(entry_id), fields))
                          for entry_id, fields in entries]
            except Exception as exc:  # a malformed entry: its stream's followers fail, alone
                log.error("unreadable entry in %s: %r", stream, exc)
                for follower in followers:
                    follower.failure = exc
                    follower.fetched = as_text(entries[-1][0])  # not read again meanwhile
                    follower._notify()
                continue
            start = entry_order(since[stream])
            for follower in followers:
                mark = entry_order(follower.fetched)
                if start > mark:
                    continue
                fresh = [item for item in events if entry_order(item[0]) > mark]
                if fresh:
                    follower.buffer.extend(fresh)
                    follower.fetched = fresh[-1][0]
                    follower._notify()


def _raw(response: Any, **options: Any) -> Any:
    """XREAD's reply unparsed: ``{stream: [[entry id, [field, value, ...]], ...]}`` (RESP3;
    RESP2: a list of ``[stream, entries]`` pairs)."""
    return response
