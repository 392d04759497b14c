"""``manage.py run_scheduler``: load the model and serve its jobs from Redis until told to stop.

SIGTERM or SIGINT: stop taking jobs, let in-flight requests finish for ``--grace`` seconds,
cancel what is left (clients get ``cancelled`` with the text so far), exit 0.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from inference.history import DatabaseHistory
from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.liveness import LoopClock
from scheduler_daemon.service.daemon import SchedulerDaemon
from scheduler_daemon.service.supervisor import supervise
from scheduler_daemon.service.telemetry import install_handler, stop_listener
from wire import protocol

log = logging.getLogger("scheduler_daemon.run")

CONFIG_SETTINGS = (
    "N_PARALLEL",
    "N_CTX",
    "N_BATCH",
    "CHUNK_SIZE",
    "MAX_QUEUE",
    "DEFAULT_MAX_TOKENS",
    "N_THREADS",
    "KV_BLOCK_TOKENS",
    "CACHE_PROMPT",
    "PROMPT_CACHE_RAM_MB",
    "PROMPT_CACHE_DISK_MB",
    "STREAM_INTERVAL_MS",
    "CONTINUE_STREAMS",
    "MAX_QUEUE_PER_TENANT",
    "KV_TENANT_SHARE",
    "LOCAL_QUEUE",
    "TICK_DEADLINE_S",
    "SAMPLER_DEADLINE_S",
    "TELEMETRY_TICK_S",
    "TIMESERIES_INTERVAL_S",
    "TIMESERIES_RETENTION_S",
)

# Test-only (FAULT_INJECTION): a job whose prompt holds this aborts the process at the loop's
# next turn while the job is queued or running, before it produces a token, as a native crash
# would (recovery counts the death against it; two deaths quarantine it).
FAULT_MARKER = "__abort_the_daemon__"

# Test-only (FAULT_INJECTION): a job whose prompt holds this stops the scheduler loop for good
# at the end of the first tick it is in, holding the scheduler's lock and naming the request
# as the one it samples, as a sampler that never returns would (the supervisor's watchdog
# must kill and restart the daemon; recovery blames that request alone).
HANG_MARKER = "<<hang-the-loop>>"


def abort_when_marked(daemon: SchedulerDaemon) -> None:
    """Install the abort hook: a stand-in for a native crash, outside the production loop.
    The job is marked before the core queues it, so no tick runs it before the check."""
    marked: set[str] = set()

    def starting(job: protocol.Job) -> None:
        if FAULT_MARKER in json.dumps([job.prompt, job.messages]):
            marked.add(job.id)
            daemon.core.scheduler.wake()

    def turn() -> None:
        if marked and marked & daemon.core.scheduler.request_ids():
            log.critical("fault injection: aborting the process")
            os.abort()

    daemon.intake.starting.append(starting)
    daemon.core.turn_hooks.append(turn)


def hang_when_marked(daemon: SchedulerDaemon) -> None:
    """Install the hang hook: a stand-in for a stuck sampler, outside the production loop."""
    marked: set[str] = set()

    def started(job: protocol.Job) -> None:
        if HANG_MARKER in json.dumps([job.prompt, job.messages]):
            marked.add(job.id)

    def after_tick(_stats: object) -> None:
        scheduler = daemon.core.scheduler
        hung = marked & scheduler.request_ids()
        if hung:
            log.critical("fault injection: the scheduler loop hangs now")
            scheduler.lock.acquire()
            scheduler.sampling = min(hung)
            if scheduler.on_sampling is not None:
                scheduler.on_sampling(True)
            threading.Event().wait()

    daemon.intake.started.append(started)
    daemon.core.tick_listeners.append(after_tick)


class Command(BaseCommand):
    help = "Run the scheduler daemon for MODEL_PATH, serving jobs for MODEL_NAME from REDIS_URL."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "--grace",
            type=float,
            default=30.0,
            help="seconds in-flight requests may take to finish on shutdown",
        )
        parser.add_argument(
            "--daemon-id", default=None, help="consumer name (default host-pid-random)"
        )
        parser.add_argument(
            "--supervise",
            action="store_true",
            help="run the daemon in a child process under one daemon id and restart it "
            "whenever it dies (not when it exits cleanly)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        # before supervising: a missing file is not a crash to restart after
        if not Path(settings.MODEL_PATH).is_file():
            raise CommandError(f"the model {settings.MODEL_NAME!r}: MODEL_PATH="
                               f"{settings.MODEL_PATH} is not a file (`make setup` installs "
                               f"the models config/models.py knows)")
        if options["supervise"]:
            daemon_id = options["daemon_id"] or (
                f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            )
            argv = [sys.executable, os.path.abspath(sys.argv[0]), "run_scheduler",
                    "--grace", str(options["grace"]), "--daemon-id", daemon_id]
            status = supervise(argv, tick_deadline_s=settings.TICK_DEADLINE_S,
                               sampler_deadline_s=settings.SAMPLER_DEADLINE_S)
            if status != 0:
                raise CommandError(f"the supervised daemon ended with status {status}")
            return
        # telemetry: JSON lines alone on stderr, written from a thread of their own
        telemetry = install_handler()
        try:
            self._serve(options)
        finally:
            stop_listener(telemetry)

    def _serve(self, options: dict[str, Any]) -> None:
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: stop.set())
        client = redis.Redis.from_url(
            settings.REDIS_URL, socket_timeout=10, health_check_interval=30
        )
        try:
            client.ping()
        except redis.RedisError as exc:
            raise CommandError(f"Redis does not answer at {settings.REDIS_URL}: {exc}") from None
        t0 = time.monotonic()
        log.info("loading %s (model name %r) ...", settings.MODEL_PATH, settings.MODEL_NAME)
        # The daemon holds at most its slots + LOCAL_QUEUE jobs (the rest waits in Redis,
        # where the web's gate applies MAX_QUEUE and the tenants' shares): its core's own
        # queue caps must not refuse what it took.
        # (a job of n choices is n requests in the core: MAX_CHOICES each at most). The
        # embeddings queue is bounded apart by the same max_queue, one tenant's embeddings
        # jobs by a quarter of it (core.py: embeddings_tenant_jobs), not by the per-tenant caps.
        capacity = settings.N_PARALLEL + settings.LOCAL_QUEUE
        caps = capacity * protocol.MAX_CHOICES
        core = InferenceCore.from_settings(max_queue=caps, max_queue_per_tenant=caps)
        log.info("model loaded in %.1f s", time.monotonic() - t0)
        # what is loaded by now lives as long as the process: out of the collector's reach,
        # a full collection (60-80 ms here otherwise) no longer stalls a tick walking it
        gc.collect()  # start-up's garbage first: frozen, it would never be collected
        gc.freeze()
        if os.environ.get("LOOP_CLOCK_FILE"):  # supervised: the watchdog reads the loop's marks
            core.clock = LoopClock(os.environ["LOOP_CLOCK_FILE"])
        if settings.TICK_DEADLINE_S > 0:  # "stuck" is shown well before the watchdog kills
            core.stuck_after_s = settings.TICK_DEADLINE_S / 4
        daemon = SchedulerDaemon(
            core,
            client,
            settings.MODEL_NAME,
            daemon_id=options["daemon_id"],
            config_info={name.lower(): getattr(settings, name) for name in CONFIG_SETTINGS},
            stream_interval_s=settings.STREAM_INTERVAL_MS / 1000,
            history=DatabaseHistory(),
            capacity=capacity,
            queue_allowance=(settings.MAX_QUEUE, settings.MAX_QUEUE_PER_TENANT),
            run_info={"restarts": int(os.environ.get("DAEMON_RESTARTS") or 0),
                      "last_exit": os.environ.get("DAEMON_LAST_EXIT") or None},
            telemetry_tick_s=settings.TELEMETRY_TICK_S,
            timeseries_interval_s=settings.TIMESERIES_INTERVAL_S,
            timeseries_retention_s=settings.TIMESERIES_RETENTION_S,
        )
        if settings.FAULT_INJECTION:  # the test-only hooks, never in a production run
            abort_when_marked(daemon)
            hang_when_marked(daemon)
        daemon.intake.recovery.continue_streams = settings.CONTINUE_STREAMS
        daemon.writer.session_ttl_s = int(settings.SESSION_TTL_S)
        daemon.intake.vocab_tenant_jobs = settings.VOCAB_TENANT_JOBS
        daemon.intake.vocab_jobs = settings.VOCAB_JOBS
        core.start()
        daemon.start()
        self.stdout.write(f"scheduler daemon {daemon.daemon_id} ready", ending="\n")
        self.stdout.flush()
        while not stop.wait(0.5):
            if not daemon.healthy:
                log.error("a daemon thread died; shutting down")
                break
        log.info("shutting down: finishing in-flight requests (grace %.0f s)", options["grace"])
        daemon.stop(options["grace"])
        core.engine.close()
