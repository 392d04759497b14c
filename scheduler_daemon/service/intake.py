"""Jobs in: read from the model's jobs stream, queued fairly per tenant, started one by one.

Two threads:

- the reader: takes jobs from the model's fair queue in Redis (``wire/queue.py``'s TAKE,
  fair across tenants and across the fleet) into the prepare queue, only as many as this
  daemon can hold: ``capacity`` (its slots plus a small local queue, LOCAL_QUEUE) less the
  generation jobs it holds (read, starting, or started and not ended; embeddings and
  tokenize/detokenize jobs have caps of their own, ``held``). The rest waits in Redis, where
  any live daemon of the model can take it; so no daemon refuses ``queue_full`` (the web's
  gate does, from the queue). Idle, it blocks on the queue's bell (at most 0.5 s). It
  takes only while the lifecycle is ``SERVING`` (it moves ``PAUSING`` on to ``PAUSED``
  when its wait returns), and every ``RECLAIM_INTERVAL_S`` it has dead daemons' jobs
  recovered (``recovery.py``). A malformed entry is dropped, acknowledged, counted.
- the preparer: takes the prepare queue round-robin by tenant (``fair_queue.FairQueue``: one
  tenant's large prompts delay another's job by at most one of them), checks the durable
  cancel flag and the quarantine, records the job as running here (``llm:running:<id>``)
  *before* any native code sees it, reads the job's wire shape (``job_input``) and
  enqueues it in the core (tokenizing, the token and queue caps, the grammar). Then
  ``accepted``, or an ``error`` event with the HTTP ``status`` the web answers with. Any
  failure while starting a job ends that job alone (``internal_error``); ``rejected``
  counts these answers by code.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

from wire import affinity as wire_affinity
from wire import errors, ownership, protocol, queue, sessions
from wire.backoff import Backoff
from wire.errors import Refusal

from ..core.affinity import SESSION_TTL_S, SUMMARY_TTL_S, AffinitySummary
from ..core.fair_queue import FairQueue
from ..core.inference import InferenceCore
from ..core.job_input import submit_arguments
from ..core.lifecycle import State
from .context import DaemonContext
from .event_writer import EventWriter
from .recovery import FRESH, Recovery, Takeover, as_text, quarantined_refusal

log = logging.getLogger(__name__)

RECLAIM_INTERVAL_S = 5.0
INTAKE_BATCH = 16  # jobs taken in one TAKE at most
PREPARE_QUEUE_MAX = 2 * INTAKE_BATCH  # a daemon's capacity when none is given
VOCABULARY_DRAIN_S = 10.0  # a drain waits this long for the vocabulary thread at most
# tokenize/detokenize jobs in flight here (queued for the vocabulary thread or being
# answered): per tenant past VOCAB_TENANT_JOBS, 429 tenant_queue_full; all tenants past
# VOCAB_JOBS, 503 queue_full (settings of the same names)
VOCAB_TENANT_JOBS = 4
VOCAB_JOBS = 16
FULL_POLL_S = 0.02  # a full daemon looks for room this often
ALIVE_EVERY_S = 0.5  # ... and shows its consumer alive this often (recovery's idle check)
DRAIN_WINDOW_S = 30.0  # the rate jobs were taken at is measured over this long


def job_fingerprint(job: protocol.Job) -> str:
    """What makes a job the same request again, under whatever id: the quarantine's key (a
    poison request sent anew is still refused). Its tenant is part of it: another tenant's
    copies neither count a death for it nor are refused with it (docs/daemon.md); so is
    its adapter (id and file hash), if any."""
    body = {
        "tenant": job.tenant_id,
        "kind": job.kind,
        "model": job.model,
        "prompt": job.prompt,
        "messages": job.messages,
        "params": job.params,
    }
    if isinstance(job.adapter, dict):  # under an adapter it is another request
        body["adapter"] = [job.adapter.get("id"), job.adapter.get("sha256")]
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


Prepared = tuple[str, protocol.Job, Takeover]  # entry id, job, how it goes on here


def _bounded_apart(job: protocol.Job) -> bool:
    """Embeddings and tokenize/detokenize jobs: bounded by their own caps, not counted in
    the room the intake keeps for generation."""
    return job.kind == protocol.EMBEDDING_KIND or job.kind in protocol.VOCAB_KINDS


class PrepareQueue:
    """Jobs read but not started, fair across tenants; ``get`` blocks."""

    def __init__(self) -> None:
        self._jobs: FairQueue[str, Prepared] = FairQueue()
        self._cond = threading.Condition()
        self.apart = 0  # jobs bounded apart among them (not in the intake's generation count)

    def __len__(self) -> int:
        return len(self._jobs)

    def put(self, entry_id: str, job: protocol.Job, takeover: Takeover = FRESH) -> None:
        with self._cond:
            self._jobs.push(job.tenant_id, (entry_id, job, takeover))
            self.apart += _bounded_apart(job)
            self._cond.notify()

    def get(self, timeout: float) -> Prepared | None:
        """The next tenant's oldest job; None after ``timeout`` with nothing queued."""
        with self._cond:
            self._cond.wait_for(lambda: bool(self._jobs), timeout)
            taken = self._jobs.pop()
            if taken is None:
                return None
            self.apart -= _bounded_apart(taken[1][1])
            return taken[1]


class Intake:
    """Reads, queues and starts one model's jobs (``read_loop`` and ``prepare_loop``)."""

    def __init__(
        self,
        ctx: DaemonContext,
        core: InferenceCore,
        writer: EventWriter,
        capacity: int = PREPARE_QUEUE_MAX,
    ) -> None:
        """``capacity``: the jobs this daemon holds at most (read and not ended)."""
        self.core = core
        self.redis = client = ctx.redis
        self.model = ctx.model
        self.capacity = max(1, int(capacity))
        self.daemon_id = daemon_id = ctx.daemon_id
        self.lifecycle = ctx.lifecycle
        self.writer = writer
        self.jobs_stream = ctx.jobs_stream
        self.running_key = ctx.running_key
        self.prepare = PrepareQueue()
        self.rejected: Counter[str] = Counter()  # jobs answered with an error before starting
        self.started: list[Callable[[protocol.Job], None]] = []  # told of each accepted job
        # told of each generation job just before the core queues it
        self.starting: list[Callable[[protocol.Job], None]] = []
        self.recovery = Recovery(ctx, writer, self.prepare.put, self.refuse)
        self._last_reclaim = time.monotonic()
        self._take_owner = client.register_script(ownership.TAKE)
        self._outage = Backoff("reading jobs", log)  # the reader thread's
        self._starting = 0  # 1 while the preparer starts a job (held, in neither count)
        self._submitting = False  # the preparer's job is not yet queued in the core
        self._looking = False  # the reader took jobs and is taking again (a burst's rest)
        self._taken: list[float] = []  # when jobs were taken (monotonic), DRAIN_WINDOW_S
        self._taken_lock = threading.Lock()
        self._bell = "0-0"  # the queue's bell entry seen last (wait for one after it)
        # the takes' sequence numbers (queue.take): from the clock, so that a run restarted
        # under this id never repeats an earlier run's number
        self._take_seq = time.time_ns()
        self._last_alive = 0.0
        self.summary = AffinitySummary()  # the chains of the jobs started here
        self.summary_key = wire_affinity.summary_key(daemon_id)
        self.taken_by_tenant: Counter[str] = Counter()  # jobs started here, per tenant
        self._embeddings: set[str] = set()  # embeddings jobs started, until their end is written
        self._embeddings_lock = threading.Lock()
        self.vocabulary = PrepareQueue()  # tokenize/detokenize jobs, for their own thread
        self._vocabulary_thread: threading.Thread | None = None
        self._vocabulary_lock = threading.Lock()
        # tokenize/detokenize jobs handed to that thread, until their end is written: id ->
        # tenant (guarded by _vocabulary_lock); the caps below, set from settings
        self._vocabulary_live: dict[str, str] = {}
        self.vocab_tenant_jobs = VOCAB_TENANT_JOBS
        self.vocab_jobs = VOCAB_JOBS
        self._vocabulary_s = 0.1  # seconds per answer, measured (Retry-After)
        self._wake: Callable[[], None] = lambda: None  # the core's loop (``feed``)

    def held(self) -> int:
        """Generation jobs this daemon holds: taken and not started, being started, or not
        ended. Embeddings jobs (the core's ``check_embeddings_room``) and tokenize/detokenize
        jobs (``vocabulary_live``'s caps) have their own bounds and do not count: a burst of
        them never keeps a chat waiting in Redis."""
        return (len(self.prepare) - self.prepare.apart + self._starting
                + self.writer.live_count() - self.embeddings_live()
                - len(self.vocabulary_live()))

    def feed(self, scheduler: Any) -> None:
        """Let ``scheduler``'s ticks wait for the jobs on their way here (``arriving``), so
        that a burst's first tick holds the whole burst; it is woken when none is left."""
        scheduler.arrivals = self.arriving
        self._wake = scheduler.wake

    def arriving(self) -> int:
        """Generation jobs on their way into the core: read and not yet queued there (the
        prepare queue, the job being started), and one more while the reader, having just
        taken jobs, takes again (the rest of a burst may be behind them). The core's tick
        waits for them while slots would stay free (``Scheduler.await_arrivals``). None
        once the daemon no longer serves: a draining or stopping intake takes and starts
        nothing more (what its queue holds goes back to Redis)."""
        if self.lifecycle.state is not State.SERVING:
            return 0
        return (len(self.prepare) - self.prepare.apart + self._submitting + self._looking)

    def embeddings_live(self) -> int:
        """Embeddings jobs started here whose end the writer has not yet written."""
        with self._embeddings_lock:
            self._embeddings = {i for i in self._embeddings if self.writer.is_live(i)}
            return len(self._embeddings)

    def vocabulary_live(self) -> list[str]:
        """The tenants of the tokenize/detokenize jobs started here (queued for the
        vocabulary thread or being answered) whose end the writer has not yet written."""
        with self._vocabulary_lock:
            self._vocabulary_live = {i: tenant for i, tenant in self._vocabulary_live.items()
                                     if self.writer.is_live(i)}
            return list(self._vocabulary_live.values())

    def room(self) -> int:
        """Jobs it may take now: none while the loop is stuck (they would wait for the
        watchdog's restart here rather than be served by another daemon)."""
        if self.core.loop_state()["stuck"]:
            return 0
        return self.capacity - self.held()

    def drain_per_s(self) -> float:
        """Jobs taken per second over the last DRAIN_WINDOW_S (the web's Retry-After)."""
        now = time.monotonic()
        with self._taken_lock:
            self._taken = [t for t in self._taken if now - t <= DRAIN_WINDOW_S]
            return len(self._taken) / DRAIN_WINDOW_S

    def ensure_group(self) -> None:
        """Create the jobs stream's consumer group if it is not there."""
        try:
            self.redis.xgroup_create(self.jobs_stream, protocol.JOBS_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    # -- the reader thread ----------------------------------------------------------------------

    def read_loop(self) -> None:
        while self.lifecycle.taking_jobs:
            self._reclaim_when_due()
            state = self.lifecycle.state
            if state is State.PAUSING:
                self.lifecycle.move(State.PAUSED)  # no read is under way any more
            if state is not State.SERVING:
                self._look_again(False)
                self.lifecycle.wait_for({State.SERVING, State.DRAINING}, timeout=0.5)
                continue
            room = self.room()
            if room <= 0:  # the rest waits in Redis, where another daemon may take it
                self._look_again(False)
                if time.monotonic() - self._last_alive >= ALIVE_EVERY_S:
                    self._read(0)
                time.sleep(FULL_POLL_S)
                continue
            entries = self._read(min(INTAKE_BATCH, room))
            self._look_again(bool(entries))  # jobs taken: the next take looks for more
            if not entries:
                self._wait_for_work()
                continue
            for entry_id, fields in entries:
                if not self.lifecycle.taking_jobs:
                    return  # taken by us: reclaimed by the next daemon once we are gone
                try:
                    self._take(as_text(entry_id), fields)
                except Exception:  # never let one entry stop the intake
                    log.exception("could not take job entry %s", entry_id)

    def _look_again(self, looking: bool) -> None:
        """Whether the reader takes again right after taking jobs (``arriving`` counts it);
        when it stops, the core's tick waits for it no more."""
        if self._looking and not looking:
            self._looking = False
            self._wake()
        self._looking = looking

    def _read(self, count: int) -> list[tuple[Any, Any]]:
        """Up to ``count`` jobs from the model's fair queue (0: none, only shows this daemon's
        consumer alive); [] while Redis is away or the stream is gone (recreated)."""
        try:
            entries, self._bell = queue.take(self.redis, self.model, self.daemon_id, count,
                                             self._take_seq)
            if count > 0:  # replied: the next take is a new one (after an error: the same)
                self._take_seq += 1
            self._last_alive = time.monotonic()
            self._outage.succeeded()
        except redis.ResponseError as exc:
            if "NOGROUP" not in str(exc):
                log.exception("taking jobs failed; retrying in 1 s")
                time.sleep(1)
                return []
            log.warning("the jobs stream or its group vanished (Redis restarted?): recreating it")
            try:
                self.ensure_group()
            except redis.RedisError as lost:  # gone again: the next read tries again
                time.sleep(self._outage.failed(lost))
            return []
        except redis.RedisError as exc:  # Redis away (a restart): wait for it, never give up
            time.sleep(self._outage.failed(exc))
            return []
        if entries:
            now = time.monotonic()
            with self._taken_lock:
                self._taken.extend([now] * len(entries))
        return entries

    def _wait_for_work(self) -> None:
        """Block until a job is enqueued (the bell) or BELL_BLOCK_MS pass."""
        try:
            queue.wait_for_bell(self.redis, self.model, self._bell)
        except redis.RedisError as exc:
            time.sleep(self._outage.failed(exc))

    def _reclaim_when_due(self) -> None:
        if time.monotonic() - self._last_reclaim < RECLAIM_INTERVAL_S:
            return
        self._last_reclaim = time.monotonic()
        try:
            self.recovery.reclaim_dead()
        except redis.ConnectionError as exc:  # Redis away: the reader says so already
            log.warning("reclaiming dead daemons' jobs failed (Redis: %s)", exc)
        except Exception:  # a bug: try again next interval, keep reading
            log.exception("reclaiming dead daemons' jobs failed")

    def _take(self, entry_id: str, fields: dict[Any, Any]) -> None:
        """Queue a read job for the preparer (a malformed entry is dropped and counted)."""
        try:
            job = protocol.Job.decode(fields)
            if not isinstance(job.id, str) or not isinstance(job.tenant_id, str):
                raise TypeError("job id and tenant id must be strings")
        except Exception:
            log.error("dropping malformed job entry %s", entry_id)
            self.rejected["malformed"] += 1
            self.ack_quietly(entry_id)
            return
        self.prepare.put(entry_id, job)

    # -- the preparer thread ------------------------------------------------------------------

    def prepare_loop(self) -> None:
        while self.lifecycle.taking_jobs:
            item = self.prepare.get(timeout=0.5)
            if item is None:
                continue
            self._starting = 1  # held, though in neither the prepare queue nor the writer
            self._submitting = not _bounded_apart(item[1])
            try:
                self.start_job_safely(*item)
            finally:
                self._starting = 0
                self._submitting = False
        self.join_vocabulary(VOCABULARY_DRAIN_S)  # its answers go out before the writer ends

    def start_job_safely(self, entry_id: str, job: protocol.Job,
                         takeover: Takeover = FRESH) -> None:
        """Start one job; any failure ends that job alone with an error event."""
        try:
            self._start_job(entry_id, job, takeover)
        except (redis.ConnectionError, redis.TimeoutError):
            # Redis away and the daemon stopping: nothing ran; the entry stays pending
            # under this id, for the daemon that recovers it
            log.warning("job %s not started: Redis is away and the daemon stops", job.id)
            self.writer.release(job.id)
        except Exception:
            log.exception("starting job %s failed; it ends with an error, alone", job.id)
            self.writer.release(job.id)
            self.rejected[errors.INTERNAL_ERROR] += 1
            data = {
                "code": errors.INTERNAL_ERROR,
                "message": "The server could not start this request.",
                "status": errors.status_of(errors.INTERNAL_ERROR),
            }
            self.writer.terminal(job.id, entry_id, protocol.ERROR, data)

    def _start_job(self, entry_id: str, job: protocol.Job, takeover: Takeover) -> None:
        if self.writer.is_live(job.id):
            # The id's event stream, running record and slot belong to the live request: an
            # answer to this entry would be a second end in that stream. Only a writer other
            # than the web (which makes a new uuid per request) can send one.
            log.warning("job %s: a request with this id is running here; entry %s dropped",
                        job.id, entry_id)
            self.rejected[errors.DUPLICATE_ID] += 1
            self.ack_quietly(entry_id)
            return
        fingerprint = job_fingerprint(job)
        # a session's continued turn (a rogue job's other shapes are refused by
        # submit_arguments, which checks both fields' types)
        continuing = isinstance(job.session_id, str) and job.continue_session is True

        def checks() -> list[Any]:
            pipe = self.redis.pipeline(transaction=False)
            # Ownership first: a request the web has given up on (or another daemon runs)
            # is not this daemon's to start (wire/ownership.py).
            self._take_owner(*ownership.take_args(job.id, self.daemon_id, "", self.daemon_id),
                             client=pipe)
            pipe.exists(protocol.cancel_key(job.id))
            pipe.hget(protocol.QUARANTINE_HASH, fingerprint)
            # Before any native code sees the job: if it kills this daemon, the next one
            # knows the job was running here (recovery.py). Its terminal event removes it.
            pipe.hset(self.running_key, job.id,
                      protocol.running_entry(self.recovery.run_id, fingerprint))
            self._publish_affinity(pipe, job)
            if continuing:
                pipe.hget(sessions.key(job.session_id), "tokens")  # the conversation so far
            replies = pipe.execute()
            return [*replies[:4], replies[-1] if continuing else None]

        owned, cancelled, quarantined, _, session_tokens = self._while_redis_away(checks)
        if not owned:
            log.warning("job %s is owned elsewhere (or ended); entry %s dropped", job.id, entry_id)
            self.redis.hdel(self.running_key, job.id)
            self.recovery.done_with(entry_id)
            return
        self.writer.track(job.id, job.tenant_id, job.retention(), takeover.resumed,
                          session_id=job.session_id if isinstance(job.session_id, str) else None)
        if cancelled:
            self.writer.terminal(job.id, entry_id, protocol.DONE, cancelled_before_start())
            return
        if quarantined:
            self.refuse(job.id, entry_id, quarantined_refusal())
            return
        if job.kind in protocol.VOCAB_KINDS:
            self._answer_vocabulary(job, entry_id)
            return
        if job.kind == protocol.EMBEDDING_KIND:
            self._start_embeddings(job, entry_id)
            return
        self.writer.hold(job.id)
        for listener in self.starting:
            listener(job)
        try:
            echo: str | list[str] | None = None
            if job.echo and job.kind == "completion":  # each choice's own prompt, as text
                echo = (self.core.prompt_text(job.prompt) if job.prompts is None else
                        [self.core.prompt_text(p) for p in job.prompts for _ in range(job.n)])
            continuation = takeover.continuation
            arguments = submit_arguments(job)  # checked, max_queued too ...
            arguments["max_queued"] = None  # ... but the tenant's share is the web's gate
            if continuing:
                prefix = sessions.unpack(session_tokens)
                if not prefix or any(not 0 <= t < self.core.engine.n_vocab for t in prefix):
                    raise Refusal(errors.NO_SESSION, "The session holds no conversation any "
                                  "more; send the full history.")
                arguments["session_prefix"] = prefix
            prompt_tokens = self.core.enqueue(
                **arguments, continuation=continuation,
                # its timings (duration, ttft) count from its first queueing, not the takeover
                since=job.enqueued_at if continuation and _is_time(job.enqueued_at) else None,
            )
            self._submitting = False  # queued: the core's wait for it is over
        except Refusal as refusal:
            self.writer.release(job.id)
            self.refuse(job.id, entry_id, refusal)
            return
        self.writer.accepted(job.id, entry_id, prompt_tokens, echo)
        for listener in self.started:
            listener(job)
        try:
            if self.redis.exists(protocol.cancel_key(job.id)):  # cancelled while submitting
                self.core.cancel(job.id)
        except redis.RedisError:
            log.warning("could not re-check the cancel flag of %s", job.id)

    def _publish_affinity(self, pipe: Any, job: protocol.Job) -> None:
        """Queue on ``pipe`` what the fleet's routing learns from a job started here: its
        chain into this daemon's summary, its session's daemon (wire/affinity.py). Shapes a
        rogue writer got wrong are ignored: routing is a hint."""
        if job.kind not in (protocol.COMPLETION_KIND, protocol.CHAT_KIND):
            return
        self.taken_by_tenant[job.tenant_id] += 1
        chain = job.affinity
        if job.adapter and isinstance(chain, list):
            chain = chain[1:]  # its adapter's head: published while the adapter is loaded
        if isinstance(chain, list) and len(chain) <= wire_affinity.MAX_PIECES and all(
                isinstance(d, str) and len(d) == 2 * wire_affinity.HASH_BYTES for d in chain):
            added, removed = self.summary.record(job.tenant_id, chain)
            if added:
                pipe.sadd(self.summary_key, *added)
            if removed:
                pipe.srem(self.summary_key, *removed)
            pipe.expire(self.summary_key, SUMMARY_TTL_S)
        session = job.session_hash
        if isinstance(session, str) and len(session) == 2 * wire_affinity.HASH_BYTES:
            pipe.set(wire_affinity.session_key(self.model, session), self.daemon_id,
                     ex=SESSION_TTL_S)

    def forget_tenant(self, tenant: str) -> None:
        """The tenant's cached prefixes were evicted here: its summary entries go too."""
        removed = self.summary.forget(tenant)
        if removed:
            self.redis.srem(self.summary_key, *removed)

    def _answer_vocabulary(self, job: protocol.Job, entry_id: str) -> None:
        """A tokenize/detokenize job goes to the vocabulary thread (started with the first
        one): tokenizing 256 KiB takes about a second, which must not hold up the start of
        other tenants' generation jobs here. Refused past the caps on jobs in flight: the
        tenant's (``vocab_tenant_jobs``: 429 ``tenant_queue_full``) or all tenants'
        (``vocab_jobs``: 503 ``queue_full``), with a Retry-After from the jobs ahead at the
        measured time per answer."""
        live = self.vocabulary_live()
        mine = live.count(job.tenant_id)
        if mine >= self.vocab_tenant_jobs or len(live) >= self.vocab_jobs:
            retry_after_s = int(min(60, max(1, math.ceil(len(live) * self._vocabulary_s))))
            if mine >= self.vocab_tenant_jobs:
                refusal = Refusal(errors.TENANT_QUEUE_FULL,
                                  f"this tenant already has {mine} tokenize/detokenize "
                                  f"requests in this daemon; at most {self.vocab_tenant_jobs} "
                                  "(VOCAB_TENANT_JOBS)", max_queued=self.vocab_tenant_jobs,
                                  retry_after_s=retry_after_s)
            else:
                refusal = Refusal(errors.QUEUE_FULL,
                                  f"this daemon already has {len(live)} tokenize/detokenize "
                                  f"requests; at most {self.vocab_jobs} (VOCAB_JOBS)",
                                  max_queue=self.vocab_jobs, retry_after_s=retry_after_s)
            self.refuse(job.id, entry_id, refusal)
            return
        with self._vocabulary_lock:
            self._vocabulary_live[job.id] = job.tenant_id
            if self._vocabulary_thread is None:
                self._vocabulary_thread = threading.Thread(
                    target=self.vocabulary_loop, name="daemon-vocabulary", daemon=True)
                self._vocabulary_thread.start()
        self.vocabulary.put(entry_id, job)

    def vocabulary_loop(self) -> None:
        """The vocabulary thread: tokenize/detokenize jobs round-robin by tenant, each
        answered whole; it ends when the daemon stops taking jobs and none is left."""
        while self.lifecycle.taking_jobs or len(self.vocabulary):
            item = self.vocabulary.get(timeout=0.5)
            if item is not None:
                entry_id, job, _ = item
                t0 = time.monotonic()
                try:
                    self.answer_vocabulary(job, entry_id)
                except Exception:
                    log.exception("answering job %s failed; it ends with an error, alone",
                                  job.id)
                    try:  # nothing may end this thread: every later job would wait for good
                        self.refuse(job.id, entry_id, Refusal(
                            errors.INTERNAL_ERROR, "The server could not answer this request."))
                    except Exception:
                        log.exception("ending job %s with an error failed", job.id)
                self._vocabulary_s += 0.2 * (time.monotonic() - t0 - self._vocabulary_s)

    def join_vocabulary(self, timeout_s: float) -> None:
        """Wait for the vocabulary thread to answer what it holds and end (a drain)."""
        thread = self._vocabulary_thread
        if thread is not None:
            thread.join(timeout=timeout_s)

    def answer_vocabulary(self, job: protocol.Job, entry_id: str) -> None:
        """One tokenize/detokenize job answered from the vocabulary (no slot, no decode) as
        one ``done`` event holding the ``result``; its tokens (the text's, or the ids) are
        its usage, billed like a prompt's, a refused answer's too (the work was done)."""
        try:
            result, n_tokens = self.core.vocabulary_answer(job.kind, job.prompt, job.params,
                                                           job.messages, job.tools)
        except Refusal as refusal:
            self.refuse(job.id, entry_id, refusal)
            return
        done = {"finish_reason": "stop", "stop": None, "timings": {}, "result": result,
                "usage": protocol.usage(n_tokens, 0, 0)}
        self.writer.terminal(job.id, entry_id, protocol.DONE, done)

    def _start_embeddings(self, job: protocol.Job, entry_id: str) -> None:
        """An embeddings job: the tenant's room checked, its inputs tokenized here,
        ``accepted``, embedded by the loop thread (the one that decodes), answered with one
        ``done`` event: each vector as base64 of little-endian float32, and the tokens as
        prompt usage. A refusal (the tenant's share of embeddings work: 429
        ``tenant_queue_full``), a cancel, its deadline, a failed decode or a stopping daemon
        end it with that error, billed for the tokens embedded before it (its ``usage``)."""
        with self._embeddings_lock:
            self._embeddings.add(job.id)  # its own count from here (``held``)
        try:
            self.core.check_embeddings_room(job.cache_scope)  # before tokenizing
            inputs = self.core.embedding_inputs(job.prompt)
        except Refusal as refusal:
            self.refuse(job.id, entry_id, refusal)
            return
        n_tokens = sum(len(tokens) for tokens in inputs)

        def done(vectors: list[Any] | None, error: BaseException | None) -> None:
            if error is not None or vectors is None:
                if not isinstance(error, Refusal):  # the core wraps failures: a bug
                    error = Refusal(errors.INTERNAL_ERROR,
                                    "The embeddings of this request failed.")
                self.refuse(job.id, entry_id, error)
                return
            result = {"vectors": [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
                                  for v in vectors]}
            self.writer.terminal(job.id, entry_id, protocol.DONE, {
                "finish_reason": "stop", "stop": None, "timings": {}, "result": result,
                "usage": protocol.usage(n_tokens, 0, 0)})

        self.writer.accepted(job.id, entry_id, n_tokens)  # the web waits for the end after it
        try:
            self.core.submit_embeddings(job.id, inputs, done, deadline=_deadline_of(job),
                                        scope=job.cache_scope)
        except Refusal as refusal:
            self.refuse(job.id, entry_id, refusal)

    def _while_redis_away(self, call: Callable[[], Any]) -> Any:
        """``call()``, tried again while Redis is away (a restart): the job waits for Redis
        rather than fail for it. Gives up when the daemon stops taking jobs."""
        outage = Backoff("starting a job", log)
        while True:
            try:
                result = call()
                outage.succeeded()
                return result
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if not self.lifecycle.taking_jobs:
                    raise
                time.sleep(outage.failed(exc))

    def refuse(self, request_id: str, entry_id: str, refusal: Refusal) -> None:
        """Answer a job the daemon will not run with its error event (and count it)."""
        self.rejected[refusal.code] += 1
        data = {**refusal.as_dict(), "status": errors.status_of(refusal.code)}
        self.writer.terminal(request_id, entry_id, protocol.ERROR, data)

    def ack_quietly(self, entry_id: str) -> None:
        try:
            self.recovery.done_with(entry_id)
        except redis.RedisError:
            log.warning("could not acknowledge job entry %s", entry_id)


def _deadline_of(job: protocol.Job) -> float | None:
    return float(job.deadline) if _is_time(job.deadline) else None


def _is_time(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def cancelled_before_start() -> dict[str, Any]:
    return {
        "finish_reason": "cancelled",
        "stop": None,
        "usage": protocol.usage(0, 0, 0),
        "timings": {},
    }
