"""Embeddings tokens/s of the in-process core (Gemma 3 270M), no generation running.

Three workloads, submitted with ``InferenceCore.submit_embeddings`` and timed from the
submit to the last end: ``short`` (one job of 16 inputs of 60 tokens: several inputs share
each decode), ``long`` (one job of 2 inputs of 600 tokens: each over several decodes) and
``tenants`` (the ``long`` job of one tenant and 4 one-input jobs of 60 tokens of four
others, all at once: the turns between tenants). Each figure is the best of
--reps rounds (other load on a shared machine only ever slows a run down). Run:
  .venv/bin/python bench/embeddings_throughput.py [--reps 3]
The last line printed is JSON: tokens/s per workload.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

from _common import machine, model_path

from scheduler_daemon.core import InferenceCore
from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.scheduler import SchedulerConfig


def ids(engine: LlamaEngine, n_tokens: int, seed: int) -> list[int]:
    text = f"Document {seed}: notes on rivers, bread and trains, page {seed}. " * 400
    return engine.tokenize(text)[:n_tokens]


def run(core: InferenceCore, jobs: list[tuple[str, list[list[int]]]]) -> float:
    """Submit every job at once; tokens/s until the last one ended."""
    left = threading.Semaphore(0)
    failed: list[BaseException] = []

    def done(vectors, error) -> None:
        if error is not None:
            failed.append(error)
        left.release()

    t0 = time.monotonic()
    for i, (scope, inputs) in enumerate(jobs):
        core.submit_embeddings(f"bench-{time.monotonic_ns()}-{i}", inputs, done, scope=scope)
    for _ in jobs:
        left.acquire()
    elapsed = time.monotonic() - t0
    if failed:
        raise RuntimeError(f"an embeddings job failed: {failed[0]!r}")
    return sum(len(t) for _, inputs in jobs for t in inputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    args = parser.parse_args()
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=4096, n_batch=1024,
                                      n_seq_max=4, n_threads=args.threads))
    core = InferenceCore(engine, SchedulerConfig(max_queue=64))
    core.start()
    workloads = {
        "short": [("a", [ids(engine, 60, i) for i in range(16)])],
        "long": [("a", [ids(engine, 600, i) for i in range(2)])],
        "tenants": [("a", [ids(engine, 600, i) for i in range(2)])]
        + [(f"t{i}", [ids(engine, 60, 100 + i)]) for i in range(4)],
    }
    run(core, [("warm", [ids(engine, 60, 0)])])  # the embeddings context is made here
    best: dict[str, float] = {}
    for _ in range(args.reps):
        for name, jobs in workloads.items():
            rate = run(core, jobs)
            best[name] = max(best.get(name, 0.0), rate)
            print(f"{name}: {rate:.1f} tokens/s", flush=True)
    core.stop(grace_s=0)
    print(json.dumps({"machine": machine(), "threads": args.threads,
                      "tokens_per_s": {k: round(v, 1) for k, v in best.items()}}))


if __name__ == "__main__":
    main()
