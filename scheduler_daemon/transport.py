"""The daemon's side of the Redis wire (see ``protocol.py``): jobs in, events out.

Threads, besides the core's scheduler loop:
- intake:  XREADGROUP on the model's jobs stream into a small queue kept per tenant.
- prepare: takes that queue round-robin by tenant (one tenant's big prompts delay another's
           job by at most one of them); checks the durable cancel flag and the quarantine;
           renders, tokenizes and submits to the core. Refusals, and any other failure to
           start a job, become that job's ``error`` event: starting a job never stops the
           daemon (``rejected`` counts them by reason).
- cancels: pub/sub on ``llm:cancel``; cancels in-flight work at once (abort mid-prefill).
- control: operator commands on ``llm:control:<daemon id>`` (drain, resume, evict a scope).
- writer:  one pipeline per tick with every request's new events (tokens coalesced), the
           XACK of finished jobs, history rows, the heartbeat snapshot, and reclaiming the
           jobs of dead daemons. A finished request's tokens are added to its tenant's
           usage counters and its concurrency slot freed in that same pipeline, ahead of its
           terminal event (``protocol.record_usage``; limits: ``inference/limits.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

import redis

from wire import errors, protocol
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .core import InferenceCore
from .history import HistorySink, NoHistory
from .jobs import Event, FinishedEvent, TokenEvent

log = logging.getLogger(__name__)
request_log = logging.getLogger("scheduler_daemon.requests")  # one JSON line per finished request

RECLAIM_INTERVAL_S = 5.0
INTAKE_BATCH = 16
PREPARE_QUEUE_MAX = 2 * INTAKE_BATCH  # jobs read but not yet started; more wait in Redis
QUARANTINE_AFTER_DEATHS = 2  # a job running at this many daemon deaths is never run again
# Test-only fault hook (setting FAULT_INJECTION): a job whose prompt holds this text makes
# the daemon abort the process at its first tick, like a native crash would.
FAULT_MARKER = "__abort_the_daemon__"


class _FairQueue:
    """Jobs waiting to be started, one FIFO per tenant, taken round-robin across tenants."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[tuple[str, protocol.Job]]] = {}
        self._turns: deque[str] = deque()
        self._cond = threading.Condition()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def put(self, entry_id: str, job: protocol.Job) -> None:
        with self._cond:
            queue = self._queues.setdefault(job.tenant_id, deque())
            if not queue:
                self._turns.append(job.tenant_id)
            queue.append((entry_id, job))
            self._size += 1
            self._cond.notify()

    def get(self, timeout: float) -> tuple[str, protocol.Job] | None:
        """The next tenant's oldest job; None after ``timeout`` with nothing queued."""
        with self._cond:
            if not self._size and not self._cond.wait(timeout):
                return None
            if not self._size:
                return None
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            item = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            self._size -= 1
            return item


def job_fingerprint(job: protocol.Job) -> str:
    """What makes a job the same request again, whoever sends it and under whatever id: the
    quarantine's key (a poison request sent anew is still refused)."""
    body = {
        "kind": job.kind,
        "model": job.model,
        "prompt": job.prompt,
        "messages": job.messages,
        "params": job.params,
    }
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(slots=True)
class _Outgoing:
    """One event on its way to a request's stream."""

    request_id: str
    kind: str
    data: dict[str, Any]
    entry_id: str | None = None  # the job's entry in the jobs stream, acked with the terminal event


@dataclass(slots=True)
class _Buffer:
    """Events waiting for the writer. Events of a request being submitted are held back
    until its ``accepted`` (or refusal) is queued, so a stream always starts with it."""

    items: list[_Outgoing] = field(default_factory=list)
    held: dict[str, list[_Outgoing]] = field(default_factory=dict)
    urgent: bool = False  # holds an event that must not wait for the stream interval


class DaemonTransport:
    """Serves one model's jobs from Redis with an ``InferenceCore``."""

    def __init__(
        self,
        core: InferenceCore,
        client: redis.Redis,
        model: str,
        daemon_id: str | None = None,
        config_info: dict[str, Any] | None = None,
        stream_interval_s: float = 0.0,
        fault_injection: bool = False,
        history: HistorySink | None = None,
    ) -> None:
        """``stream_interval_s`` (STREAM_INTERVAL_MS): a request's later tokens are written at
        most this often, several to one event; its first token, ``accepted`` and the end go
        at once. 0: every tick's tokens are written at the end of that tick."""
        self.core = core
        self.history: HistorySink = history or NoHistory()
        self.redis = client
        self.model = model
        self.daemon_id = daemon_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.config_info = config_info or {}
        self.started_at = time.time()
        self.jobs_stream = protocol.jobs_stream(model)
        self._entries: dict[str, str] = {}  # request id -> jobs-stream entry id
        self._tenants: dict[str, str] = {}  # request id -> tenant id, for the request log
        self._buffer = _Buffer()
        self.stream_interval_s = stream_interval_s
        self._last_flush = 0.0
        self._streaming: set[str] = set()  # requests whose first text has been buffered
        self._cond = threading.Condition()
        self._intake_open = threading.Event()
        self.draining = False  # an operator's drain: jobs stay in the stream for other daemons
        self.drained = False  # published: the drain is in effect (the intake has paused)
        self._intake_paused = threading.Event()  # set while the intake honours a drain
        self._running = threading.Event()
        self._threads: list[threading.Thread] = []
        self._last_heartbeat = 0.0
        self._last_reclaim = 0.0
        self._prepare = _FairQueue()
        self.rejected: Counter[str] = Counter()  # jobs answered with an error before starting
        self.fault_injection = fault_injection
        self.running_key = protocol.running_key(self.daemon_id)
        core.listeners.append(self._on_event)
        core.tick_listeners.append(lambda _stats: self._wake())

    # -- lifecycle --------------------------------------------------------------------------

    def _ensure_group(self) -> None:
        try:
            self.redis.xgroup_create(self.jobs_stream, protocol.JOBS_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def start(self) -> None:
        """Create the consumer group if needed, publish a first heartbeat, start the threads."""
        self._ensure_group()
        self._running.set()
        self._intake_open.set()
        self._heartbeat()
        self._reclaim_own()
        threads = (
            self._intake_loop,
            self._prepare_loop,
            self._cancel_loop,
            self._control_loop,
            self._writer_loop,
        )
        for target in threads:
            thread = threading.Thread(target=target, name=target.__name__.strip("_"), daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("daemon %s serving model %r from %s", self.daemon_id, self.model, self.jobs_stream)

    def stop(self, grace_s: float) -> None:
        """Stop taking jobs, let in-flight work finish for ``grace_s`` (then cancel it),
        write every last event, and leave: the heartbeat key goes at once."""
        self._intake_open.clear()
        self.core.stop(grace_s)
        self._running.clear()
        self._wake(force=True)
        for thread in self._threads:
            thread.join(timeout=10)
        self._flush()
        self.redis.delete(protocol.daemon_key(self.daemon_id))
        self.redis.zrem(protocol.DAEMONS_ZSET, self.daemon_id)
        if not self.redis.hlen(self.running_key):
            self.redis.delete(self.running_key)
        log.info("daemon %s stopped", self.daemon_id)

    @property
    def healthy(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    # -- intake -----------------------------------------------------------------------------

    def _intake_loop(self) -> None:
        while self._intake_open.is_set():
            if self.draining:
                self._intake_paused.set()
                time.sleep(0.1)
                continue
            self._intake_paused.clear()
            room = PREPARE_QUEUE_MAX - len(self._prepare)
            if room <= 0:  # the rest waits in Redis, where another daemon may take it
                time.sleep(0.02)
                continue
            try:
                reply = self.redis.xreadgroup(
                    protocol.JOBS_GROUP,
                    self.daemon_id,
                    {self.jobs_stream: ">"},
                    count=min(INTAKE_BATCH, room),
                    block=500,
                )
            except redis.ResponseError as exc:
                if "NOGROUP" not in str(exc):
                    log.exception("reading jobs failed; retrying in 1 s")
                    time.sleep(1)
                    continue
                log.warning(
                    "the jobs stream or its group vanished (Redis restarted?): recreating it"
                )
                self._ensure_group()
                continue
            except redis.RedisError:
                log.exception("reading jobs failed; retrying in 1 s")
                time.sleep(1)
                continue
            for _stream, entries in reply or []:
                for entry_id, fields in entries:
                    if not self._intake_open.is_set():
                        return  # unread by us: reclaimed by the next daemon once we are gone
                    try:
                        self._take(_text(entry_id), fields)
                    except Exception:  # never let one entry stop the intake
                        log.exception("could not take job entry %s", entry_id)

    def _take(self, entry_id: str, fields: dict[Any, Any]) -> None:
        """Queue a read job for the preparer (a malformed entry is dropped and counted)."""
        try:
            job = protocol.Job.decode(fields)
            if not isinstance(job.id, str) or not isinstance(job.tenant_id, str):
                raise TypeError("job id and tenant id must be strings")
        except Exception:
            log.error("dropping malformed job entry %s", entry_id)
            self.rejected["malformed"] += 1
            self._ack_quietly(entry_id)
            return
        self._prepare.put(entry_id, job)

    def _prepare_loop(self) -> None:
        while self._intake_open.is_set():
            item = self._prepare.get(timeout=0.5)
            if item is not None:
                self._start_job_safely(*item)

    def _start_job_safely(self, entry_id: str, job: protocol.Job) -> None:
        """``_start_job``; any failure ends that job alone with an error event."""
        try:
            self._start_job(entry_id, job)
        except Exception:
            log.exception("starting job %s failed; it ends with an error, alone", job.id)
            with self._cond:
                self._buffer.held.pop(job.id, None)
            self.rejected["internal_error"] += 1
            data = {
                "code": "internal_error",
                "message": "The server could not start this request.",
                "status": 500,
            }
            self._queue_terminal(job.id, entry_id, protocol.ERROR, data)

    def _start_job(self, entry_id: str, job: protocol.Job) -> None:
        self._tenants[job.id] = job.tenant_id
        fingerprint = job_fingerprint(job)
        pipe = self.redis.pipeline(transaction=False)
        pipe.exists(protocol.cancel_key(job.id))
        pipe.hget(protocol.QUARANTINE_HASH, fingerprint)
        # Before any native code sees the job: if it kills this daemon, the next one knows
        # the job was running here (see _recover). Its terminal event, whatever it is,
        # removes the record (_flush).
        pipe.hset(self.running_key, job.id, fingerprint)
        cancelled, quarantined, _ = pipe.execute()
        if cancelled:
            self._queue_terminal(job.id, entry_id, protocol.DONE, _cancelled_before_start())
            return
        if quarantined:
            self._refuse(job.id, entry_id, _quarantined_refusal())
            return
        with self._cond:
            self._buffer.held[job.id] = []
        if self.fault_injection and FAULT_MARKER in json.dumps([job.prompt, job.messages]):
            self.core.abort_process_when_running(job.id)  # test-only: before its first tick
        try:
            params = SamplingParams.from_dict(job.params)
            handle = self.core.submit(
                prompt=job.prompt,
                messages=job.messages,
                params=params,
                request_id=job.id,
                cache_scope=job.cache_scope,
                session=job.session,
                cache_prompt=job.cache_prompt,
                max_queued=job.max_queued,
            )
        except Refusal as refusal:
            with self._cond:
                self._buffer.held.pop(job.id, None)
            self._refuse(job.id, entry_id, refusal)
            return
        with self._cond:
            self._entries[job.id] = entry_id
            accepted = _Outgoing(
                job.id,
                protocol.ACCEPTED,
                {
                    "daemon_id": self.daemon_id,
                    "prompt_tokens": handle.prompt_tokens,
                    "model": self.model,
                },
            )
            self._buffer.items.append(accepted)
            self._buffer.items.extend(self._buffer.held.pop(job.id))
            self._buffer.urgent = True
            self._cond.notify()
        try:
            if self.redis.exists(protocol.cancel_key(job.id)):  # cancelled while submitting
                self.core.cancel(job.id)
        except redis.RedisError:
            log.warning("could not re-check the cancel flag of %s", job.id)

    def _refuse(self, request_id: str, entry_id: str, refusal: Refusal) -> None:
        """Answer a job the daemon will not run with its error event (and count it)."""
        self.rejected[refusal.code] += 1
        data = {**refusal.as_dict(), "status": errors.status_of(refusal.code)}
        self._queue_terminal(request_id, entry_id, protocol.ERROR, data)

    def _ack_quietly(self, entry_id: str) -> None:
        try:
            self.redis.xack(self.jobs_stream, protocol.JOBS_GROUP, entry_id)
        except redis.RedisError:
            log.warning("could not acknowledge job entry %s", entry_id)

    # -- cancels ----------------------------------------------------------------------------

    def _cancel_loop(self) -> None:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        pubsub.subscribe(protocol.CANCEL_CHANNEL)
        try:
            while self._running.is_set():
                try:
                    message = pubsub.get_message(timeout=0.5)
                except redis.RedisError:
                    log.exception("cancel channel failed; resubscribing in 1 s")
                    time.sleep(1)
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(protocol.CANCEL_CHANNEL)
                    continue
                if message and message["type"] == "message":
                    self.core.cancel(_text(message["data"]))
        finally:
            pubsub.close()

    # -- operator commands ------------------------------------------------------------------

    def _control_loop(self) -> None:
        stream, last = protocol.control_stream(self.daemon_id), "$"
        while self._running.is_set():
            try:
                reply = self.redis.xread({stream: last}, block=500)
            except redis.RedisError:
                log.exception("reading control commands failed; retrying in 1 s")
                time.sleep(1)
                continue
            for _name, entries in reply or []:
                for entry_id, fields in entries:
                    last = _text(entry_id)
                    try:
                        self.apply_command(protocol.decode_command(fields))
                    except Exception:  # an operator's bad command must never stop the daemon
                        log.exception("ignoring a control command that failed")

    def apply_command(self, command: dict[str, Any]) -> None:
        """Carry out one operator command (see protocol.CONTROL_ACTIONS)."""
        action = command["action"]
        log.warning("operator command: %s", command)
        if action == "drain":
            self.draining = True
            self._intake_paused.wait(timeout=10)  # a read already blocking may still deliver
            self.drained = True
        elif action == "resume":
            self.draining = self.drained = False
        elif action == "evict_scope":
            evicted = self.core.scheduler.evict_scope(str(command["scope"]))
            log.warning("evicted %s cached prefix entries of scope %s", evicted, command["scope"])
        else:
            raise ValueError(f"unknown control action {action!r}")
        self._heartbeat()  # the admin sees the effect at once

    # -- events out -------------------------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        """Core listener (scheduler thread, scheduler lock held): buffer only."""
        if isinstance(event, TokenEvent):
            item = _Outgoing(
                event.request_id, protocol.TOKEN, {"text": event.text, "n_tokens": event.n_tokens}
            )
        else:
            kind, data = _finished_payload(event)
            item = _Outgoing(event.request_id, kind, data)
        with self._cond:
            held = self._buffer.held.get(event.request_id)
            if held is not None:
                held.append(item)
                return
            if item.kind == protocol.TOKEN and event.request_id not in self._streaming:
                if item.data["text"]:  # the first text (TTFT) does not wait
                    self._streaming.add(event.request_id)
                    self._buffer.urgent = True
            if item.kind in protocol.TERMINAL:
                self._streaming.discard(event.request_id)
                item.entry_id = self._entries.pop(event.request_id, None)
            self._buffer.items.append(item)
            if item.kind in protocol.TERMINAL:
                self._buffer.urgent = True
                self._cond.notify()

    def _queue_terminal(
        self, request_id: str, entry_id: str, kind: str, data: dict[str, Any]
    ) -> None:
        with self._cond:
            self._buffer.items.append(_Outgoing(request_id, kind, data, entry_id))
            self._buffer.urgent = True
            self._cond.notify()

    def _wake(self, force: bool = False) -> None:
        """After each tick: let the writer go if what it holds is due (or ``force``)."""
        with self._cond:
            if force or self._flush_wait_s() == 0.0:
                self._cond.notify()

    def _flush_wait_s(self) -> float | None:
        """How long buffered events may still wait (0: now); None when nothing is buffered.
        Called with the condition held."""
        if not self._buffer.items:
            return None
        if self._buffer.urgent:
            return 0.0
        return max(0.0, self._last_flush + self.stream_interval_s - time.monotonic())

    def _writer_loop(self) -> None:
        while self._running.is_set():
            with self._cond:
                wait = self._flush_wait_s()
                if wait != 0.0:
                    idle = protocol.HEARTBEAT_INTERVAL_S / 4
                    self._cond.wait(timeout=idle if wait is None else min(wait, idle))
                due = self._flush_wait_s() == 0.0
            try:
                if due:
                    self._flush()
                now = time.monotonic()
                if now - self._last_heartbeat >= protocol.HEARTBEAT_INTERVAL_S:
                    self._heartbeat()
                if now - self._last_reclaim >= RECLAIM_INTERVAL_S:
                    self._last_reclaim = now
                    self.reclaim_dead()
            except redis.RedisError:
                log.exception("writing to Redis failed; retrying")
                time.sleep(0.5)
            except Exception:  # a bug here must not stop every stream of this daemon
                log.exception("the event writer failed; carrying on")
                time.sleep(0.5)

    def _flush(self) -> None:
        """Write everything buffered in one round trip. History rows are closed before the
        terminal event goes out (a client that saw ``done`` finds its row final). If Redis
        fails, the events go back to the front of the buffer for the next try."""
        with self._cond:
            items, self._buffer.items = self._buffer.items, []
            self._buffer.urgent = False
            if items:
                self._last_flush = time.monotonic()
        if not items:
            return
        items = _coalesce(items)
        ended: list[tuple[str, str, int]] = []  # (tenant id, request id, tokens used)
        for item in items:
            if item.kind in protocol.TERMINAL:
                self.history.mark_finished(
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
            protocol.record_usage(pipe, tenant_id, request_id, total_tokens, now)
        for item in items:
            stream = protocol.events_stream(item.request_id)
            pipe.xadd(stream, protocol.encode_event(item.kind, item.data))
            if item.kind == protocol.ACCEPTED:
                pipe.expire(stream, protocol.EVENTS_TTL_S)
            elif item.kind in protocol.TERMINAL:
                pipe.expire(stream, protocol.EVENTS_TTL_AFTER_END_S)
                pipe.hdel(self.running_key, item.request_id)
                if item.entry_id:
                    pipe.xack(self.jobs_stream, protocol.JOBS_GROUP, item.entry_id)
        try:
            pipe.execute()
        except redis.RedisError:
            with self._cond:
                self._buffer.items[:0] = items
                self._buffer.urgent = True
            raise
        for item in items:
            if item.kind == protocol.ACCEPTED:
                self.history.mark_running(item.request_id, item.data["prompt_tokens"])
            elif item.kind in protocol.TERMINAL:
                self._log_end(item)

    def _log_end(self, item: _Outgoing) -> None:
        usage = item.data.get("usage") or {}
        timings = item.data.get("timings") or {}
        request_log.info(
            json.dumps(
                {
                    "event": "request_end",
                    "request_id": item.request_id,
                    "tenant_id": self._tenants.pop(item.request_id, None),
                    "model": self.model,
                    "daemon_id": self.daemon_id,
                    "finish_reason": item.data.get("finish_reason", "error"),
                    "error_code": item.data.get("code"),
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get(
                        "cached_tokens"
                    ),
                    "completion_tokens": usage.get("completion_tokens"),
                    "ttft_ms": timings.get("ttft_ms"),
                    "duration_ms": timings.get("duration_ms"),
                },
                separators=(",", ":"),
            )
        )

    # -- heartbeat and dead daemons -----------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The state published for the admin, /v1/health and /metrics (no prompt text)."""
        return {
            "daemon_id": self.daemon_id,
            "model": self.model,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "heartbeat_at": time.time(),
            "config": self.config_info,
            "draining": self.drained,
            "rejected": dict(self.rejected),
            **self.core.snapshot(),
        }

    def _heartbeat(self) -> None:
        self._last_heartbeat = time.monotonic()
        snap = self.snapshot()
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(
            protocol.daemon_key(self.daemon_id),
            json.dumps(snap),
            px=int(protocol.HEARTBEAT_TTL_S * 1000),
        )
        pipe.zadd(protocol.DAEMONS_ZSET, {self.daemon_id: snap["heartbeat_at"]})
        pipe.zremrangebyscore(protocol.DAEMONS_ZSET, 0, snap["heartbeat_at"] - 3600)
        pipe.expire(self.running_key, protocol.RUNNING_TTL_S)
        pipe.execute()

    def reclaim_dead(self) -> int:
        """Take over the pending jobs of consumers whose daemon is gone (see ``_recover``)."""
        reclaimed = 0
        try:
            consumers = self.redis.xinfo_consumers(self.jobs_stream, protocol.JOBS_GROUP)
        except redis.ResponseError:
            return 0
        for consumer in consumers:
            name = _text(consumer["name"])
            if name == self.daemon_id or self.redis.exists(protocol.daemon_key(name)):
                continue
            pending = self.redis.xpending_range(
                self.jobs_stream, protocol.JOBS_GROUP, "-", "+", count=1000, consumername=name
            )
            ids = [p["message_id"] for p in pending]
            claimed = (
                self.redis.xclaim(
                    self.jobs_stream,
                    protocol.JOBS_GROUP,
                    self.daemon_id,
                    min_idle_time=0,
                    message_ids=ids,
                )
                if ids
                else []
            )
            reclaimed += self._recover_all(claimed, name)
            self.redis.xgroup_delconsumer(self.jobs_stream, protocol.JOBS_GROUP, name)
            log.warning("reclaimed %d pending jobs of dead daemon %s", len(claimed), name)
        return reclaimed

    def _reclaim_own(self) -> int:
        """At start: entries still pending under this daemon id were read by an earlier run of
        it (restarted by its supervisor under the same id): recover them like a dead daemon's."""
        pending = self.redis.xpending_range(
            self.jobs_stream, protocol.JOBS_GROUP, "-", "+", count=1000,
            consumername=self.daemon_id,
        )
        entries: list[tuple[Any, Any]] = []
        for p in pending:
            found = self.redis.xrange(self.jobs_stream, p["message_id"], p["message_id"])
            entries.append(found[0] if found else (p["message_id"], {}))  # {}: trimmed away
        if entries:
            log.warning("recovering %d jobs of this daemon's previous run", len(entries))
        return self._recover_all(entries, self.daemon_id)

    def _recover_all(self, claimed: list[tuple[Any, Any]], dead: str) -> int:
        """Recover each claimed entry of the daemon ``dead``; its running record goes after."""
        running_key = protocol.running_key(dead)
        started = {_text(k): _text(v) for k, v in self.redis.hgetall(running_key).items()}
        for entry_id, fields in claimed:
            if fields:
                try:
                    self._recover(_text(entry_id), fields, dead, started)
                except redis.RedisError:
                    raise
                except Exception:
                    log.exception("recovering job entry %s failed; dropping it", entry_id)
                    self._ack_quietly(_text(entry_id))
            else:  # the entry was trimmed away: nothing left to serve
                self.redis.xack(self.jobs_stream, protocol.JOBS_GROUP, entry_id)
        self.redis.delete(running_key)
        return len(claimed)

    def _recover(
        self, entry_id: str, fields: dict[Any, Any], dead: str, started: dict[str, str]
    ) -> None:
        """One job a dead daemon had read. Ended: acknowledged. Running there when it died:
        one more death on its fingerprint, and at QUARANTINE_AFTER_DEATHS it is quarantined
        (refused, never run again). Otherwise a job that had streamed no text is served
        again here; one that had ends with ``inference_interrupted``."""
        job = protocol.Job.decode(fields)
        stream = protocol.events_stream(job.id)
        kinds = [protocol.decode_event(f)[0] for _, f in self.redis.xrange(stream)]
        if any(k in protocol.TERMINAL for k in kinds):
            self.redis.xack(self.jobs_stream, protocol.JOBS_GROUP, entry_id)
            return
        fingerprint = started.get(job.id)
        if fingerprint is not None:
            deaths = self._count_death(fingerprint)
            log.warning("job %s was running when daemon %s died (%d deaths)", job.id, dead, deaths)
            if deaths >= QUARANTINE_AFTER_DEATHS:
                self._quarantine(entry_id, job, fingerprint, dead, deaths)
                return
        if protocol.TOKEN not in kinds:
            self._prepare.put(entry_id, job)
            return
        if self.redis.set(
            protocol.interrupted_key(job.id), self.daemon_id, nx=True, ex=protocol.EVENTS_TTL_S
        ):
            self._tenants[job.id] = job.tenant_id
            self._queue_terminal(
                job.id,
                entry_id,
                protocol.ERROR,
                {
                    "code": protocol.INFERENCE_INTERRUPTED,
                    "message": f"the scheduler daemon {dead} stopped while serving this request",
                },
            )
        else:
            self.redis.xack(self.jobs_stream, protocol.JOBS_GROUP, entry_id)

    def _count_death(self, fingerprint: str) -> int:
        key = protocol.deaths_key(fingerprint)
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(key)
        pipe.expire(key, protocol.DEATHS_TTL_S)
        return int(pipe.execute()[0])

    def _quarantine(
        self, entry_id: str, job: protocol.Job, fingerprint: str, dead: str, deaths: int
    ) -> None:
        """Record the job's fingerprint as poison (the admin lists and releases them) and end
        it with ``request_quarantined``."""
        record = {
            "request_id": job.id,
            "tenant_id": job.tenant_id,
            "model": job.model,
            "kind": job.kind,
            "deaths": deaths,
            "last_daemon": dead,
            "at": time.time(),
        }
        self.redis.hset(protocol.QUARANTINE_HASH, fingerprint, json.dumps(record))
        log.error("quarantined request %s (tenant %s): %d daemon deaths", job.id, job.tenant_id,
                  deaths)
        self._tenants[job.id] = job.tenant_id
        self._refuse(job.id, entry_id, _quarantined_refusal())


def _quarantined_refusal() -> Refusal:
    return Refusal(
        protocol.REQUEST_QUARANTINED,
        "This request was running each time a scheduler daemon crashed; it will not be run "
        "again.",
    )


def _finished_payload(event: FinishedEvent) -> tuple[str, dict[str, Any]]:
    s = event.stats
    data: dict[str, Any] = {
        "finish_reason": event.finish_reason,
        "stop": event.stop,
        "usage": protocol.usage(s.prompt_tokens, s.cached_tokens, s.completion_tokens),
        "timings": {
            "queue_ms": s.queue_ms,
            "ttft_ms": s.ttft_ms,
            "duration_ms": s.duration_ms,
            "prompt_eval_rate": s.prompt_eval_rate,
            "generation_rate": s.generation_rate,
        },
    }
    if event.error is not None:
        return protocol.ERROR, {**data, **event.error}
    return protocol.DONE, data


def _total_tokens(data: dict[str, Any]) -> int:
    usage = data.get("usage") or {}
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


def _cancelled_before_start() -> dict[str, Any]:
    return {
        "finish_reason": "cancelled",
        "stop": None,
        "usage": protocol.usage(0, 0, 0),
        "timings": {},
    }


def _coalesce(items: list[_Outgoing]) -> list[_Outgoing]:
    """Merge consecutive token events of one request (a slow writer sends fewer, larger ones)."""
    out: list[_Outgoing] = []
    last_token: dict[str, _Outgoing] = {}
    for item in items:
        prev = last_token.get(item.request_id)
        if item.kind == protocol.TOKEN and prev is not None:
            prev.data = {
                "text": prev.data["text"] + item.data["text"],
                "n_tokens": prev.data["n_tokens"] + item.data["n_tokens"],
            }
            continue
        out.append(item)
        if item.kind == protocol.TOKEN:
            last_token[item.request_id] = item
        else:
            last_token.pop(item.request_id, None)
    return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
