"""Dead daemons' jobs: reclaimed, served again, ended, or quarantined.

A daemon that dies (a native crash kills the process; Python cannot catch it) leaves its
read jobs pending in the consumer group. They are recovered by a restarted daemon under
the same id at start (``reclaim_own``) and by every daemon, every few seconds, for
consumers whose heartbeat key is gone (``reclaim_dead``):

- a job whose stream already ended is acknowledged;
- a job that was *running* there (in ``llm:running:<id>``, with the run that started it)
  adds that death (the daemon id and the run: ``protocol.death_id``) to its fingerprint's
  set of deaths. Copies of one fingerprint at one death, and two daemons recovering the
  same death, add it once (one Lua script: ``protocol.COUNT_DEATH``). At
  ``QUARANTINE_AFTER_DEATHS`` distinct deaths it is quarantined: ``llm:quarantine`` records
  the fingerprint, the request ends with ``request_quarantined`` (400), and any later job
  with that fingerprint is refused before it reaches the engine. The fingerprint includes
  the tenant (``intake.job_fingerprint``): one tenant's copies never count for another's.
  A run killed by the watchdog while stuck in one request's sampler (its heartbeat named it:
  ``protocol.hang_key``) is that request's death alone: its neighbours go on uncounted;
- any other job is taken over (its owner key moves from the dead daemon to this one, a
  compare-and-set the web's give-up cannot also win: ``wire/ownership.py``) and goes back
  into the prepare queue: served from the start if no token event went out, else
  *continued*: the prompt plus the tokens already sent (their ids ride in the token
  events) are prefilled, the tokens replayed through the new sampler (its grammar too),
  and generation carries on after them, so the client's stream goes on without a gap or a
  duplicate. The new ``accepted`` and the ``done`` say ``resumed`` (how many times);
- a job whose tokens cannot be replayed (an event without ids) ends with
  ``inference_interrupted``.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from wire import ownership, protocol, queue
from wire.errors import Refusal

from ..core.state import Continuation
from .context import DaemonContext
from .event_writer import EventWriter

log = logging.getLogger(__name__)

QUARANTINE_AFTER_DEATHS = protocol.QUARANTINE_AFTER_DEATHS
# XCLAIM's min idle time: a dead daemon's entries have been idle at least this long (its
# heartbeat key outlives it by more), and a claim resets the idle time, so when two daemons
# reclaim the same dead one at once only the first claim of each entry wins (at 0 the
# second took the entries back and both daemons served the job).
CLAIM_MIN_IDLE_MS = 1000
# A consumer is dead only when its heartbeat key is gone *and* it has not read for this long
# (XINFO CONSUMERS ``idle``; a live daemon reads every 0.5 s at most). The key alone is not
# enough: it expires during a Redis outage longer than HEARTBEAT_TTL_S, and a live daemon
# may take a moment after Redis returns to publish it again.
CONSUMER_DEAD_IDLE_MS = int(3 * protocol.HEARTBEAT_TTL_S * 1000)


@dataclass(frozen=True, slots=True)
class Takeover:
    """How a job another daemon had read goes on here."""

    continuation: Continuation | None = None  # None: served from the start
    resumed: int = 0  # earlier ``accepted`` events in its stream (0: a fresh job)


FRESH = Takeover()


class Recovery:
    """Recovers the pending jobs of dead consumers of one jobs stream."""

    def __init__(
        self,
        ctx: DaemonContext,
        writer: EventWriter,
        requeue: Callable[[str, protocol.Job, Takeover], None],
        refuse: Callable[[str, str, Refusal], None],
    ) -> None:
        """``requeue``: serve a job again here (the prepare queue); ``refuse``: end a job with
        a refusal (counted as rejected)."""
        self.redis = client = ctx.redis
        self.jobs_stream = ctx.jobs_stream
        self.daemon_id = ctx.daemon_id
        self.writer = writer
        self.requeue = requeue
        self.refuse = refuse
        self._take = client.register_script(ownership.TAKE)
        self._count_death_script = client.register_script(protocol.COUNT_DEATH)
        self._forget_running = client.register_script(protocol.FORGET_RUNNING)
        # This process's run of the daemon id: recorded with each job it starts (intake.py),
        # so a death is this run's, not every run's of the id (the supervisor restarts it).
        self.run_id = uuid.uuid4().hex[:12]
        # CONTINUE_STREAMS: continue a request that had streamed tokens; off: it ends with
        # inference_interrupted (a request served from the start is not affected)
        self.continue_streams = True

    def reclaim_dead(self, dead_idle_ms: int = CONSUMER_DEAD_IDLE_MS) -> int:
        """Take over the pending jobs of consumers whose daemon is gone (no heartbeat key, no
        read for ``dead_idle_ms``); returns how many."""
        reclaimed = 0
        try:
            consumers = self.redis.xinfo_consumers(self.jobs_stream, protocol.JOBS_GROUP)
        except redis.ResponseError:
            return 0
        for consumer in consumers:
            name = as_text(consumer["name"])
            if name in (self.daemon_id, queue.HOLDER):  # HOLDER: the jobs still waiting
                continue
            if int(consumer["idle"]) <= dead_idle_ms and not self.redis.exists(
                    protocol.gone_key(name)):
                continue  # a consumer that read lately is alive, heartbeat key or not
            if self.redis.exists(protocol.daemon_key(name)):
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
                    min_idle_time=CLAIM_MIN_IDLE_MS,
                    message_ids=ids,
                )
                if ids
                else []
            )
            if claimed:  # else another daemon won them: its recovery needs the running record
                reclaimed += self._recover_all(claimed, name)
                log.warning("reclaimed %d pending jobs of dead daemon %s", len(claimed), name)
            if not ids:  # deleting a consumer drops its pending entries: only an empty one
                self.redis.xgroup_delconsumer(self.jobs_stream, protocol.JOBS_GROUP, name)
        return reclaimed

    def reclaim_own(self) -> int:
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
        recovered = self._recover_all(entries, self.daemon_id)
        # What earlier runs left without a pending entry (ended, its record not yet deleted)
        running_key = protocol.running_key(self.daemon_id)
        stale = [(k, v) for k, v in self.redis.hgetall(running_key).items()
                 if protocol.parse_running_entry(as_text(v))[0] != self.run_id]
        if stale:
            self._forget_running([running_key], [x for kv in stale for x in kv])
        return recovered

    def _recover_all(self, claimed: list[tuple[Any, Any]], dead: str) -> int:
        """Recover each claimed entry of the daemon ``dead``; the running records of these
        jobs go after (only theirs: another daemon may be recovering the rest, and a later
        run of the same id may have written its own since)."""
        running_key = protocol.running_key(dead)
        started = {as_text(k): as_text(v) for k, v in self.redis.hgetall(running_key).items()}
        blamed = self._hangs(dead, started)
        recovered: list[str] = []
        for entry_id, fields in claimed:
            if not fields:  # the entry was deleted: nothing left to serve
                self.done_with(entry_id)
                continue
            try:
                job = protocol.Job.decode(fields)
                recovered.append(job.id)
                running = started.get(job.id)
                if running is not None and blamed.get(protocol.parse_running_entry(running)[0],
                                                      job.id) != job.id:
                    log.warning("job %s was running when run %s of daemon %s hung in another "
                                "request's sampler: not its death", job.id,
                                protocol.parse_running_entry(running)[0], dead)
                    running = None
                self._recover(as_text(entry_id), job, dead, running)
            except redis.RedisError:
                raise
            except Exception:
                log.exception("recovering job entry %s failed; dropping it", entry_id)
                self.done_with(entry_id)
        read = [x for job_id in recovered if job_id in started for x in (job_id, started[job_id])]
        if read:
            self._forget_running([running_key], read)
        return len(claimed)

    def _hangs(self, dead: str, started: dict[str, str]) -> dict[str, str]:
        """The runs of ``dead`` among ``started``'s that hung in one request's sampler: run id
        -> that request (the heartbeat's record, ``protocol.hang_key``)."""
        runs = sorted({protocol.parse_running_entry(v)[0] for v in started.values()})
        if not runs:
            return {}
        found = self.redis.mget([protocol.hang_key(dead, run) for run in runs])
        return {run: as_text(f) for run, f in zip(runs, found, strict=True) if f is not None}

    def _recover(self, entry_id: str, job: protocol.Job, dead: str, running: str | None) -> None:
        """One job a dead daemon had read (see the module docstring); ``running``: its entry
        in the dead daemon's running hash (None: it had not started there)."""
        events = [protocol.decode_event(f) for _, f in self.redis.xrange(
            protocol.events_stream(job.id))]
        if any(kind in protocol.TERMINAL for kind, _ in events):
            self.done_with(entry_id)
            return
        if running is not None:
            run_id, fingerprint = protocol.parse_running_entry(running)
            deaths = self._count_death(fingerprint, protocol.death_id(dead, run_id))
            log.warning("job %s was running when run %s of daemon %s died (%d distinct deaths)",
                        job.id, run_id or "?", dead, len(deaths))
            if len(deaths) >= QUARANTINE_AFTER_DEATHS:
                self._quarantine(entry_id, job, fingerprint, dead, deaths)
                return
        if not self._take(*ownership.take_args(job.id, self.daemon_id, dead, "")):
            # The web gave up on it (its end is written) or a live daemon still runs it
            # (its end acknowledges the entry): nothing to do here.
            log.info("job %s is no longer %s's; leaving it", job.id, dead)
            return
        takeover = takeover_of(events)
        if takeover is not None and takeover.continuation and not self.continue_streams:
            takeover = None
        if takeover is None:
            self.writer.track(job.id, job.tenant_id, job.retention())
            data = {
                "code": protocol.INFERENCE_INTERRUPTED,
                "message": f"the scheduler daemon {dead} stopped while serving this request",
            }
            self.writer.terminal(job.id, entry_id, protocol.ERROR, data)
            return
        if takeover.continuation is not None:
            log.warning("continuing job %s of daemon %s after %d tokens", job.id, dead,
                        len(takeover.continuation.tokens))
        self.requeue(entry_id, job, takeover)

    def done_with(self, entry_id: str) -> None:
        """Acknowledge and delete a job entry whose request has ended."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.jobs_stream, protocol.JOBS_GROUP, entry_id)
        pipe.xdel(self.jobs_stream, entry_id)
        pipe.execute()

    def _count_death(self, fingerprint: str, death: str) -> list[str]:
        """Add ``death`` to the fingerprint's deaths (once, whoever adds it); every death it
        was running at."""
        members = self._count_death_script(*protocol.count_death_args(fingerprint, death))
        return sorted(as_text(m) for m in members)

    def _quarantine(
        self, entry_id: str, job: protocol.Job, fingerprint: str, dead: str, deaths: list[str]
    ) -> None:
        """Record the job's fingerprint as poison (the admin lists and releases them) and end
        it with ``request_quarantined``."""
        record = {
            "request_id": job.id,
            "tenant_id": job.tenant_id,
            "model": job.model,
            "kind": job.kind,
            "deaths": len(deaths),
            "death_ids": deaths,  # "<daemon id>/<run id>" each
            "last_daemon": dead,
            "at": time.time(),
        }
        self.redis.hset(protocol.QUARANTINE_HASH, fingerprint, json.dumps(record))
        log.error("quarantined request %s (tenant %s): running at %d daemon deaths (%s)",
                  job.id, job.tenant_id, len(deaths), ", ".join(deaths))
        self.writer.track(job.id, job.tenant_id, job.retention())
        self.refuse(job.id, entry_id, quarantined_refusal())


def takeover_of(events: list[tuple[str, dict[str, Any]]]) -> Takeover | None:
    """How to go on with a job whose stream holds ``events`` (no terminal one); None when
    its tokens cannot be replayed (a token event without their ids)."""
    resumed = sum(kind == protocol.ACCEPTED for kind, _ in events)
    tokens: list[int] = []
    text: list[str] = []
    for kind, data in events:
        if kind != protocol.TOKEN:
            continue
        if "index" in data:
            return None  # a choice of several: one request's replay cannot carry them on
        ids = data.get("ids")
        if not isinstance(ids, list) or len(ids) != data.get("n_tokens"):
            return None
        if not all(type(t) is int for t in ids):
            return None
        tokens.extend(ids)
        text.append(str(data.get("text", "")))
    if not tokens and not any(text):
        return Takeover(None, resumed)
    return Takeover(Continuation(tuple(tokens), "".join(text)), resumed)


def quarantined_refusal() -> Refusal:
    return Refusal(
        protocol.REQUEST_QUARANTINED,
        f"This request was running at {QUARANTINE_AFTER_DEATHS} separate scheduler daemon "
        "failures (a crash, or a hang the watchdog ended); it will not be run again.",
    )


def as_text(value: Any) -> str:
    """A Redis reply's bytes as text."""
    return value.decode() if isinstance(value, bytes) else str(value)
