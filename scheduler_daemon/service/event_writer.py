"""Events out: a buffer the scheduler fills, one Redis pipeline per flush, the request log.

The scheduler thread hands every event to ``on_event`` (with its lock held: buffering
only). The writer thread flushes when something is due: a request's ``accepted``, its
first text and its end at once, later tokens ``stream_interval_s`` after the previous write
(consecutive tokens of a request become one ``token`` event, ``n_tokens`` says how many).
One flush writes everything buffered in one pipeline: the events, the stream TTLs (each
request's retention after its last event), the XACK and XDEL of finished jobs (no prompt
text stays in Redis) and the removal of their running record and owner, and each finished
request's
usage (``protocol.record_usage``: tenant limits, ``inference/limits.py``) ahead of its
terminal event. History rows are closed through the ``history`` sink *before* the terminal
event goes out (a client that saw ``done`` finds its row final). If Redis fails, the
events go back to the front of the buffer for the next flush.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from wire import limits, protocol, sessions
from wire.backoff import Backoff

from ..core.state import Event, FinishedEvent, TokenEvent
from .context import DaemonContext
from .history import HistorySink, NoHistory
from .telemetry import Telemetry

log = logging.getLogger(__name__)

# A tick that ends less than this share of the interval before its slot flushes the slot:
# with ticks as long as the interval (a stream at 20 tokens/s, 50 ms), a tick end a hair
# before the slot would otherwise wait a whole tick and the client see a 100 ms gap.
SLOT_EARLY = 0.25
EXPIRE_RENEW_S = 60.0  # a live stream's TTL (its retention, 10 min or more) renewed this often


@dataclass(slots=True)
class Outgoing:
    """One event on its way to a request's stream."""

    request_id: str
    kind: str
    data: dict[str, Any]
    entry_id: str | None = None  # the job's entry in the jobs stream, acked with the terminal event
    # a session's finished turn: the conversation's tokens (packed), saved with its end
    session_tokens: bytes | None = None


@dataclass(slots=True)
class _Buffer:
    """Events waiting for the writer. Events of a request being submitted are held back
    until its ``accepted`` (or refusal) is queued, so a stream always starts with it."""

    items: list[Outgoing] = field(default_factory=list)
    held: dict[str, list[Outgoing]] = field(default_factory=dict)
    # requests with an event that must not wait for the stream interval: an early flush
    # writes theirs alone (every event of theirs, in order); the rest wait for their slot
    urgent: set[str] = field(default_factory=set)
    everything: bool = False  # a failed write's events: all go at the next flush


class EventWriter:
    """Buffers every request's events and writes them to Redis (``run`` is its thread)."""

    def __init__(
        self,
        ctx: DaemonContext,
        history: HistorySink | None = None,
        stream_interval_s: float = 0.0,
        telemetry: Telemetry | None = None,
    ) -> None:
        """``stream_interval_s`` (STREAM_INTERVAL_MS): a request's later tokens are written at
        most this often, several to one event. 0: every tick's tokens at the end of the tick.
        ``telemetry``: where each written end is reported (the request log)."""
        self.redis = ctx.redis
        self.model = ctx.model
        self.daemon_id = ctx.daemon_id
        self.lifecycle = ctx.lifecycle
        self.history: HistorySink = history or NoHistory()
        self.telemetry = telemetry or Telemetry(ctx.daemon_id, ctx.model)
        self.stream_interval_s = stream_interval_s
        self.jobs_stream = ctx.jobs_stream
        self.load_key = ctx.load_key
        self.running_key = ctx.running_key
        self._buffer = _Buffer()
        self._cond = threading.Condition()
        self._next_due = 0.0  # the next slot of the stream interval's grid (monotonic)
        # a tick that ends this little before the slot flushes it (tokens come at tick
        # ends: waiting for the next one would double the gap when ticks last the interval)
        self._early_s = stream_interval_s * SLOT_EARLY
        # a stream's TTL is renewed by its accepted, its end and at most once per this long
        # between (a token's write alone renews nothing): it never expires while it is live
        self.expire_renew_s = EXPIRE_RENEW_S
        self._expired_at: dict[str, float] = {}  # request id -> its stream's last EXPIRE
        self._streaming: set[str] = set()  # requests whose first text has been buffered
        self._entries: dict[str, str] = {}  # accepted request id -> its jobs-stream entry id
        self._tenants: dict[str, str] = {}  # request id -> tenant id (usage, request log)
        self._retention: dict[str, int] = {}  # request id -> its stream's retention (s)
        self._resumed: dict[str, int] = {}  # request id -> times it was continued (if any)
        self._sessions: dict[str, str] = {}  # request id -> the session whose turn it is
        self.session_ttl_s = sessions.DEFAULT_TTL_S  # SESSION_TTL_S (the daemon sets it)

    # -- from the intake (preparer thread) --------------------------------------------------

    def track(self, request_id: str, tenant_id: str,
              retention_s: int = protocol.STREAM_RETENTION_S, resumed: int = 0,
              session_id: str | None = None) -> None:
        """Remember a request's tenant (its usage and its log line name it at the end), its
        stream's retention, how many times it has been continued after a death, and the
        session whose turn it is (its end ends the turn: wire/sessions.py)."""
        self._tenants[request_id] = tenant_id
        self._retention[request_id] = retention_s
        if resumed:
            self._resumed[request_id] = resumed
        if session_id is not None:
            self._sessions[request_id] = session_id

    def live_count(self) -> int:
        """Requests started here whose end is not yet written."""
        return len(self._tenants)

    def is_live(self, request_id: str) -> bool:
        """Whether a request with this id started here and its end is not yet written."""
        return request_id in self._tenants

    def hold(self, request_id: str) -> None:
        """Hold the request's events until ``accepted`` or ``release`` (it is being submitted)."""
        with self._cond:
            self._buffer.held[request_id] = []

    def release(self, request_id: str) -> None:
        """Drop what was held for a request that was not accepted after all."""
        with self._cond:
            self._buffer.held.pop(request_id, None)

    def accepted(self, request_id: str, entry_id: str, prompt_tokens: int,
                 echo: str | list[str] | None = None) -> None:
        """Queue ``accepted``, then the events held since ``hold``; the job's entry is
        acknowledged with its terminal event. A continued request's ``accepted`` says
        ``resumed`` (the web follows the new daemon and sends the client nothing for it).
        ``echo``: the prompt's text, for a completion that asked for it back."""
        data: dict[str, Any] = {
            "daemon_id": self.daemon_id, "prompt_tokens": prompt_tokens, "model": self.model,
        }
        if echo is not None and request_id not in self._resumed:  # the client has it once
            data["echo"] = echo
        if request_id in self._resumed:
            data["resumed"] = self._resumed[request_id]
        with self._cond:
            held = self._buffer.held.pop(request_id, [])
            ended = [item for item in held if item.kind in protocol.TERMINAL]
            for item in ended:  # it ended while being submitted (a cancel, a tiny max_tokens)
                item.entry_id = entry_id
            if not ended:
                self._entries[request_id] = entry_id
            self._buffer.items.append(Outgoing(request_id, protocol.ACCEPTED, data))
            self._buffer.items.extend(held)
            self._buffer.urgent.add(request_id)
            self._cond.notify()

    def terminal(self, request_id: str, entry_id: str, kind: str, data: dict[str, Any]) -> None:
        """Queue the end of a request the core never ran (a refusal, a recovery's verdict,
        an answer of the intake or of an embeddings job)."""
        with self._cond:
            self._entries.pop(request_id, None)  # acknowledged with this end
            self._streaming.discard(request_id)
            self._buffer.items.append(Outgoing(request_id, kind, data, entry_id))
            self._buffer.urgent.add(request_id)
            self._cond.notify()

    # -- from the core (scheduler thread, its lock held) --------------------------------------

    def on_event(self, event: Event) -> None:
        """Core listener: buffer only."""
        if isinstance(event, TokenEvent):
            data = {"text": event.text, "n_tokens": event.n_tokens, "ids": list(event.tokens)}
            if event.logprobs:
                data["logprobs"] = list(event.logprobs)
            if event.index is not None:  # a choice of several (n > 1)
                data["index"] = event.index
            item = Outgoing(event.request_id, protocol.TOKEN, data)
        else:
            item = Outgoing(event.request_id, *finished_payload(event))
            if event.tokens is not None and event.request_id in self._sessions:
                item.session_tokens = sessions.pack(event.tokens)
            resumed = self._resumed.get(event.request_id)
            if resumed:
                item.data["resumed"] = resumed
        with self._cond:
            held = self._buffer.held.get(event.request_id)
            if held is not None:
                held.append(item)
                return
            if item.kind == protocol.TOKEN and event.request_id not in self._streaming:
                if item.data["text"]:  # the first text (TTFT) does not wait
                    self._streaming.add(event.request_id)
                    self._buffer.urgent.add(event.request_id)
            if item.kind in protocol.TERMINAL:
                self._streaming.discard(event.request_id)
                item.entry_id = self._entries.pop(event.request_id, None)
                self._buffer.urgent.add(event.request_id)
            self._buffer.items.append(item)
            if item.kind in protocol.TERMINAL:
                self._cond.notify()

    def handed_back(self, request_ids: list[str]) -> None:
        """Requests the core dropped without an end (a stopping daemon): their entries stay
        pending, unacknowledged, for the next daemon; their running records go (a hand-back
        is no crash: it must not count toward the quarantine). Called after the last flush
        of their events was queued."""
        with self._cond:
            for request_id in request_ids:
                self._entries.pop(request_id, None)
                self._streaming.discard(request_id)
        if request_ids:
            self.redis.hdel(self.running_key, *request_ids)
        for request_id in request_ids:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self._expired_at.pop(request_id, None)
        self._sessions.pop(request_id, None)
        self._tenants.pop(request_id, None)
        self._retention.pop(request_id, None)
        self._resumed.pop(request_id, None)

    def wake(self, force: bool = False) -> None:
        """After each tick: let the writer go if what it holds is due (or ``force``)."""
        with self._cond:
            if force or self._flush_wait_s() == 0.0:
                self._cond.notify()

    # -- the writer thread ----------------------------------------------------------------------

    def run(self) -> None:
        """Flush whenever something is due, until the lifecycle reaches STOPPING."""
        outage = Backoff("writing events", log)  # Redis away: the events wait in the buffer
        while self.lifecycle.running:
            with self._cond:
                wait = self._flush_wait_s()
                if wait != 0.0:
                    idle = protocol.HEARTBEAT_INTERVAL_S / 4
                    self._cond.wait(timeout=idle if wait is None else min(wait, idle))
                due = self._flush_wait_s() == 0.0
            if not due:
                continue
            try:
                self.flush()
                outage.succeeded()
            except redis.RedisError as exc:
                time.sleep(outage.failed(exc))
            except Exception:  # a bug here must not stop every stream of this daemon
                log.exception("the event writer failed; carrying on")
                time.sleep(0.5)

    def _flush_wait_s(self) -> float | None:
        """How long buffered events may still wait (0: now); None when nothing is buffered.
        Called with the condition held."""
        if not self._buffer.items:
            return None
        if self._buffer.urgent or self._buffer.everything:
            return 0.0
        return max(0.0, self._next_due - self._early_s - time.monotonic())

    def flush(self, everything: bool = False) -> None:
        """Write what is due in one round trip (see the module docstring): the slot's
        events, or before the slot the urgent requests' alone; ``everything``: all that is
        buffered (a stopping daemon's last flush)."""
        with self._cond:
            buffer = self._buffer
            now_m = time.monotonic()
            if (everything or buffer.everything
                    or now_m >= self._next_due - self._early_s):  # the slot
                items, buffer.items = buffer.items, []
                if items:
                    self._next_due = next_slot(self._next_due, now_m, self.stream_interval_s)
            else:  # early: the urgent requests' events alone
                items, rest = [], []
                for item in buffer.items:
                    (items if item.request_id in buffer.urgent else rest).append(item)
                buffer.items = rest
            buffer.urgent = set()
            buffer.everything = False
        if not items:
            return
        items = coalesce(items)
        ended: list[tuple[str, str, int]] = []  # (tenant id, request id, tokens used)
        for item in items:
            if item.kind in protocol.TERMINAL:
                self._history(
                    self.history.mark_finished,
                    item.request_id,
                    item.data.get("finish_reason", "error"),
                    item.data.get("usage"),
                    item.data.get("timings"),
                    error_code=item.data.get("code", ""),
                )
                tenant_id = self._tenants.get(item.request_id)
                if tenant_id is not None:
                    ended.append((tenant_id, item.request_id, _total_tokens(item.data)))
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        for tenant_id, request_id, total_tokens in ended:  # tenant limits (inference/limits.py)
            limits.record_usage(pipe, tenant_id, request_id, total_tokens, now)
        expiring: dict[str, int] = {}  # stream -> retention, once per stream per flush
        for item in items:
            stream = protocol.events_stream(item.request_id)
            pipe.xadd(stream, protocol.encode_event(item.kind, item.data))
            retention_s = self._retention.get(item.request_id, protocol.STREAM_RETENTION_S)
            renewed = self._expired_at.get(item.request_id)
            if (item.kind != protocol.TOKEN or renewed is None
                    or now_m - renewed >= min(self.expire_renew_s, retention_s / 4)):
                expiring[stream] = retention_s
                self._expired_at[item.request_id] = now_m
            if item.kind in protocol.TERMINAL:
                pipe.hdel(self.running_key, item.request_id)
                pipe.delete(protocol.owner_key(item.request_id))
                session_id = self._sessions.get(item.request_id)
                if session_id is not None:  # the turn ends (with its tokens if it finished)
                    keys, args = sessions.end_args(
                        session_id, self._tenants.get(item.request_id, ""), item.request_id,
                        item.session_tokens or b"", self.session_ttl_s, now)
                    pipe.eval(sessions.END, len(keys), *keys, *args)
                if item.entry_id:
                    pipe.xack(self.jobs_stream, protocol.JOBS_GROUP, item.entry_id)
                    pipe.xdel(self.jobs_stream, item.entry_id)
                    pipe.hincrby(self.load_key, self.daemon_id, -1)  # the fleet's live load
        for stream, retention_s in expiring.items():
            pipe.expire(stream, retention_s)
        try:
            pipe.execute()
        except redis.RedisError:
            with self._cond:
                self._buffer.items[:0] = items
                self._buffer.everything = True
            for item in items:  # their streams' TTLs were not renewed either
                self._expired_at.pop(item.request_id, None)
            raise
        for item in items:
            if item.kind == protocol.ACCEPTED:
                self._history(
                    self.history.mark_running, item.request_id, item.data["prompt_tokens"]
                )
            elif item.kind in protocol.TERMINAL:
                self._log_end(item)

    @staticmethod
    def _history(mark: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
        """A sink call that cannot lose the flush: it runs after the buffer was taken, so an
        exception here would drop every event of this flush (requests that never end)."""
        try:
            mark(request_id, *args, **kwargs)
        except Exception:
            log.exception("the history sink failed for %s; its events go out anyway", request_id)

    def _log_end(self, item: Outgoing) -> None:
        """The request log: its end as telemetry (``request.done`` or ``request.exception``),
        once its events are written."""
        tenant_id = self._tenants.pop(item.request_id, None)
        self._forget(item.request_id)
        self.telemetry.request_end(item.request_id, item.kind, item.data, tenant_id)

    def tenant_of(self, request_id: str) -> str | None:
        """The tenant of a request started here and not yet ended (any thread)."""
        return self._tenants.get(request_id)


def finished_payload(event: FinishedEvent) -> tuple[str, dict[str, Any]]:
    """(``done`` or ``error``, its data) for a request's last event."""
    s = event.stats
    data: dict[str, Any] = {
        "finish_reason": event.finish_reason,
        "stop": event.stop,
        "usage": protocol.usage(s.prompt_tokens, s.cached_tokens, s.completion_tokens,
                                s.cache_created_tokens, s.cache_hit, s.cache_tier),
        "timings": {
            "queue_ms": s.queue_ms,
            "ttft_ms": s.ttft_ms,
            "duration_ms": s.duration_ms,
            "prompt_eval_rate": s.prompt_eval_rate,
            "generation_rate": s.generation_rate,
            "prompt_evaluated": (s.prompt_evaluated if s.prompt_evaluated is not None
                                 else s.prompt_tokens - s.cached_tokens),
        },
    }
    if event.choices:
        data["choices"] = [{"index": c.index, "finish_reason": c.finish_reason, "stop": c.stop}
                           for c in event.choices]
    if event.error is not None:
        return protocol.ERROR, {**data, **event.error}
    return protocol.DONE, data


def next_slot(due: float, now: float, interval_s: float) -> float:
    """The flush slot after one made at ``now`` for the slot ``due``: one interval after
    the slot, not after the flush. Tokens come at tick ends, so a flush waits for the
    first tick end past its slot (or at most ``SLOT_EARLY`` of an interval before it), on
    average half a tick late; timed from the flush, every gap carried that lateness (a
    client at 50 ms with 34 ms ticks got a chunk every ~62 ms). On the slots' grid the
    lateness is made up by the next gap: the client's gaps average the interval. A flush a
    whole interval late (idle) starts the grid afresh."""
    if now - due >= interval_s:
        return now + interval_s
    return due + interval_s


def coalesce(items: list[Outgoing]) -> list[Outgoing]:
    """Merge consecutive token events of one request (a slow writer sends fewer, larger ones)."""
    out: list[Outgoing] = []
    last_token: dict[str, Outgoing] = {}
    for item in items:
        prev = last_token.get(item.request_id)
        if (item.kind == protocol.TOKEN and prev is not None
                and prev.data.get("index") != item.data.get("index")):
            prev = None  # another choice of the request: its own event
        if item.kind == protocol.TOKEN and prev is not None:
            merged = {
                "text": prev.data["text"] + item.data["text"],
                "n_tokens": prev.data["n_tokens"] + item.data["n_tokens"],
                "ids": prev.data.get("ids", []) + item.data.get("ids", []),
            }
            if "logprobs" in prev.data or "logprobs" in item.data:
                merged["logprobs"] = prev.data.get("logprobs", []) + item.data.get("logprobs", [])
            if "index" in item.data:
                merged["index"] = item.data["index"]
            prev.data = merged
            continue
        out.append(item)
        if item.kind == protocol.TOKEN:
            last_token[item.request_id] = item
        else:
            last_token.pop(item.request_id, None)
    return out


def _total_tokens(data: dict[str, Any]) -> int:
    usage = data.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)
