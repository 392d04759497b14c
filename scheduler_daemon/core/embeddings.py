"""The embeddings jobs a daemon holds and their decodes between two generation ticks.

``InferenceCore`` owns one ``EmbeddingsQueue``: other threads queue, refuse and cancel
jobs here (under its lock); the loop thread runs one decode at a time (``run_one``), on
the engine's embeddings context. Which job and which pieces each decode takes is the
batcher's policy (``embed_batch.py``); this holds the caps a tenant is refused at, the
measured rate its Retry-After comes from, and how a job ends.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from wire import errors, protocol
from wire.errors import Refusal

from .embed_batch import EmbeddingBatcher, EmbeddingJob
from .scheduler import SchedulerConfig

log = logging.getLogger(__name__)

DEFAULT_EMBEDDINGS_TENANT_TOKENS = 2 * protocol.MAX_EMBEDDING_TOKENS
# the embeddings context holds two whole inputs: a full-length one never keeps another
# tenant's input from beginning (embed_batch.py)
EMBEDDING_CONTEXT_CELLS = 2 * protocol.EMBEDDING_N_CTX
EMBEDDINGS_TENANTS_TO_FILL = 4  # one tenant holds at most a quarter of the embeddings queue


class EmbeddingsQueue:
    """The embeddings jobs held here; safe to call from any thread but ``run_one`` and
    ``end_all`` (the loop's, and the stop's once the loop is done with them).
    ``config.max_queue``: the jobs held at most; ``wake``: tells the loop there is work."""

    def __init__(self, engine: Any, config: SchedulerConfig, wake: Callable[[], None],
                 tenant_tokens: int = DEFAULT_EMBEDDINGS_TENANT_TOKENS,
                 tenant_jobs: int | None = None) -> None:
        self.engine = engine
        self.config = config
        self.wake = wake
        self.batcher = EmbeddingBatcher()  # guarded by lock
        self.lock = threading.RLock()
        self.tenant_tokens = tenant_tokens
        self.tenant_jobs = (max(1, config.max_queue // EMBEDDINGS_TENANTS_TO_FILL)
                            if tenant_jobs is None else max(1, tenant_jobs))
        self.tokens_per_s = 100.0  # measured decode by decode (Retry-After)

    def __bool__(self) -> bool:
        """Whether any embeddings job waits or runs (the batcher's own, constant-time test:
        the loop asks at every turn, without the lock)."""
        return bool(self.batcher)

    def check_room(self, scope: str, n_tokens: int = 0) -> None:
        """``InferenceCore.check_embeddings_room``."""
        with self.lock:
            if len(self.batcher) >= self.config.max_queue:
                raise Refusal(errors.QUEUE_FULL, "the embeddings queue is full",
                              max_queue=self.config.max_queue)
            jobs, tokens = self.batcher.held_by(scope)
            per_scope = self.tenant_jobs
            over_jobs = jobs >= per_scope
            over_tokens = jobs > 0 and tokens + max(n_tokens, 1) > self.tenant_tokens
            if over_jobs or over_tokens:
                wait_s = tokens / max(self.tokens_per_s, 1.0)
                raise Refusal(errors.TENANT_QUEUE_FULL,
                              f"this tenant already has {jobs} embeddings requests ({tokens} "
                              f"tokens) in this daemon; at most {per_scope} requests and "
                              f"{self.tenant_tokens} tokens "
                              "(EMBEDDINGS_TENANT_TOKENS) are held per tenant",
                              max_queued=per_scope, max_tokens=self.tenant_tokens,
                              retry_after_s=int(min(60, max(1, math.ceil(wait_s)))))

    def submit(self, request_id: str, inputs: list[list[int]],
               done: Callable[[list[Any] | None, BaseException | None], None],
               deadline: float | None = None, scope: str = "") -> None:
        """``InferenceCore.submit_embeddings``."""
        job = EmbeddingJob(request_id, inputs, done, scope=scope,
                           deadline=None if deadline is None
                           else time.monotonic() + (deadline - time.time()))
        with self.lock:
            self.check_room(scope, job.n_tokens)
            self.batcher.add(job)
        self.wake()

    def cancel(self, request_id: str) -> bool:
        """Mark the job ``request_id`` cancelled (the loop ends it); False: none held."""
        with self.lock:
            job = self.batcher.find(request_id)
            if job is None:
                return False
            job.cancelled = True
        self.wake()
        return True

    def run_one(self) -> bool:
        """One decode of the embeddings jobs (on the loop thread), or a job's end; False if
        there was nothing to do. The batcher chooses the job (tenants' turns) and the
        pieces (within the cells the context holds: ``embed_batch.py``)."""
        with self.lock:
            job = next((j for j in self.batcher.jobs() if j.cancelled or (
                j.deadline is not None and time.monotonic() > j.deadline)), None)
        if job is not None:
            refusal = (Refusal(errors.CANCELLED, "The request was cancelled.") if job.cancelled
                       else Refusal(errors.TIMEOUT, "The request ran past its time limit."))
            self.end(job, None, refusal)
            return True
        embedder = None
        decode = None
        try:
            embedder = self.engine.embedder(n_ctx=EMBEDDING_CONTEXT_CELLS)
            with self.lock:
                decode = self.batcher.plan(embedder.n_ctx, embedder.n_batch,
                                           embedder.n_seq_max)
            if decode is None:
                return False
            t0 = time.monotonic()
            sums = embedder.decode(decode.pieces)
            with self.lock:
                finished = self.batcher.commit(decode, sums)
            rate = decode.n_tokens / max(time.monotonic() - t0, 1e-6)
            self.tokens_per_s += 0.2 * (rate - self.tokens_per_s)
            for seq in finished:
                embedder.forget(seq)
        except Exception as exc:  # this job alone fails
            if decode is None:  # the context could not be made: the oldest job's
                jobs = self.batcher.jobs()
                if not jobs:
                    raise
                job, where = jobs[0], "input"
            else:
                job, where = decode.job, f"input[{decode.inputs[0]}]"
            log.exception("embeddings of request %s failed", job.request_id)
            self.end(job, None, Refusal(
                errors.ENGINE_ERROR, f"llama.cpp failed to embed {where} of this request "
                f"({type(exc).__name__}: {exc})", param=where))
            return True
        if decode.job.finished:
            self.end(decode.job, [decode.job.vectors[i]
                                  for i in range(len(decode.job.inputs))], None)
        return True

    def end(self, job: EmbeddingJob, vectors: list[Any] | None,
            error: Refusal | None) -> None:
        """End ``job`` once: out of the batcher (its open sequences' cells removed), then
        ``done``; an error after work carries the tokens embedded as its ``usage``."""
        with self.lock:
            seqs = self.batcher.remove(job)
        if seqs:  # begun inputs: the embedder exists
            embedder = self.engine.embedder(n_ctx=EMBEDDING_CONTEXT_CELLS)
            for seq in seqs:
                embedder.forget(seq)
        if error is not None and job.embedded_tokens:
            error.details["usage"] = protocol.usage(job.embedded_tokens, 0, 0)
            error.details["embedded_tokens"] = job.embedded_tokens
        try:
            job.done(vectors, error)
        except Exception:  # the callback writes the end: it must not fail the loop
            log.exception("ending the embeddings of request %s failed", job.request_id)

    def end_all(self, hand_back: bool) -> list[str]:
        """At stop, past the grace: the jobs left are handed back (their ids; nothing was
        sent but ``accepted``; only jobs with no work done), or end with ``shutting_down``
        (billed for any work done)."""
        with self.lock:
            left = self.batcher.jobs()
        handed = [job for job in left if hand_back and not job.embedded_tokens]
        with self.lock:
            for job in handed:
                self.batcher.remove(job)
        for job in left:
            if job not in handed:
                self.end(job, None, Refusal(
                    errors.SHUTTING_DOWN, "The daemon stopped before it finished."))
        return [job.request_id for job in handed]
