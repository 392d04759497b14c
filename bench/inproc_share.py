"""The in-process core's share of the machine while it decodes (no web, no Redis, no client).

bench/cost_breakdown.py found our served stack's llama.cpp threads off-CPU ~12% of the time
at conc 4 where llama-server's are busy 96%. This runs the same kind of workload (N
concurrent prompts of ~90 words, 128 new tokens, greedy, ignore_eos, no prefix cache)
straight on an InferenceCore, with the service's engine sizes, and prints tok/s and the CPU
the process used over the machine's (user + system of every thread, from /proc): if it is
as low here, the idle time is in how the process drives llama.cpp, not in the service path.
Run:  .venv/bin/python bench/inproc_share.py [--conc 1 4] [--reps 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

from _common import machine, model_path
from cost_breakdown import thread_cpu

from scheduler_daemon.core import InferenceCore
from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.scheduler import SchedulerConfig
from wire.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=4, n_threads=args.threads))
    core = InferenceCore(engine, SchedulerConfig())
    core.start()
    core.submit(prompt="Warm up.", params=SamplingParams(max_tokens=4)).result(timeout=120)
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    rows = []
    print(f"machine: {machine()}")
    for conc in args.conc:
        for rep in range(args.reps):
            before, t0 = thread_cpu(os.getpid()), time.perf_counter()
            handles = [core.submit(prompt=f"Story {conc}-{rep}-{i} about trains. " + "Write a "
                                   "long and detailed story about this subject, its history. " * 6,
                                   params=params, cache_prompt=False) for i in range(conc)]
            tokens = sum(h.result(timeout=600).finished.stats.completion_tokens for h in handles)
            wall, after = time.perf_counter() - t0, thread_cpu(os.getpid())
            cpu = sum(v[0] - before.get(t, (0.0, 0))[0] for t, v in after.items())
            share = cpu / (wall * 1000 * (os.cpu_count() or 1))
            rows.append({"conc": conc, "tok_s": round(tokens / wall, 2),
                         "cpu_share": round(share, 3)})
            print(f"conc {conc} rep {rep}: {tokens / wall:.1f} tok/s, CPU share {share:.3f}",
                  flush=True)
    core.stop(grace_s=0)
    engine.close()
    print(json.dumps({"bench": "inproc_share", "machine": machine(), "rows": rows}))


if __name__ == "__main__":
    main()
