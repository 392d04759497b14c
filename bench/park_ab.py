"""The prefix cache's park (``SchedulerConfig.park_seq``) on and off, taking turns, in process.

The TTFT workload's shape: sequential completions of distinct ~110-token prompts, so once
the slots are full every admission evicts a slot's prefix, whose state goes to the RAM
tier. Without the park that save (``llama_state_seq_get_data``) runs before the new
prompt's prefill; with it, after the tick's decode. Prints per mode the median of the
daemon's own ``queue_ms`` (arrival to the slot's first decode) and ``ttft_ms`` over the
requests made after the slots are full, and per round the paired difference.
Run:  .venv/bin/python bench/park_ab.py [--rounds 6] [--requests 12]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

from _common import machine, model_path

from scheduler_daemon.core import InferenceCore
from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.scheduler import SchedulerConfig
from wire.sampling import SamplingParams

SLOTS = 4


def one_mode(engine: LlamaEngine, park: bool, requests: int, tag: str) -> dict[str, float]:
    core = InferenceCore(engine, SchedulerConfig(chunk_size=512, max_queue=16, park_seq=park))
    core.start()
    queue_ms, ttft_ms = [], []
    try:
        for i in range(requests + SLOTS):
            prompt = (f"Essay {tag} {i} {time.time_ns()} about trains. " + "Write a long and "
                      "detailed essay about this subject, its history, its people and what "
                      "it means to us today. " * 6)
            handle = core.submit(prompt=prompt, params=SamplingParams(temperature=0.0,
                                 max_tokens=8), cache_scope="tenant")
            stats = list(handle.events(timeout=120))[-1].stats
            if i >= SLOTS:  # every slot holds an earlier prompt: this admission evicts one
                queue_ms.append(stats.queue_ms)
                ttft_ms.append(stats.ttft_ms)
        saves = core.scheduler.counters["ram_save"]
    finally:
        core.stop(grace_s=0)
    return {"queue_ms": statistics.median(queue_ms), "ttft_ms": statistics.median(ttft_ms),
            "ram_saves": saves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=SLOTS + 1, n_threads=args.threads))
    print(f"machine: {machine()}")
    print(f"command: bench/park_ab.py --rounds {args.rounds} --requests {args.requests} "
          f"--threads {args.threads}  (park: {SLOTS} slots and the park; off: all {SLOTS + 1} "
          "sequences are slots, so its first measured request finds an empty one)")
    rows: dict[str, list[dict[str, float]]] = {"park": [], "no_park": []}
    for r in range(args.rounds):
        for park in ((True, False) if r % 2 == 0 else (False, True)):
            name = "park" if park else "no_park"
            row = one_mode(engine, park, args.requests, f"{r}{name}")
            rows[name].append(row)
            print(f"round {r} {name:8s} queue_ms p50 {row['queue_ms']:6.2f}  ttft_ms p50 "
                  f"{row['ttft_ms']:7.2f}  ram saves {row['ram_saves']}", flush=True)
    engine.close()
    summary = {}
    for metric in ("queue_ms", "ttft_ms"):
        diffs = [p[metric] - n[metric] for p, n in zip(rows["park"], rows["no_park"], strict=True)]
        summary[metric] = {"park": statistics.median(x[metric] for x in rows["park"]),
                           "no_park": statistics.median(x[metric] for x in rows["no_park"]),
                           "paired_diff_median": statistics.median(diffs),
                           "paired_diff_min": min(diffs), "paired_diff_max": max(diffs)}
        s = summary[metric]
        print(f"{metric}: park {s['park']:.2f}, no park {s['no_park']:.2f}, park - no park "
              f"{s['paired_diff_median']:+.2f} [{s['paired_diff_min']:+.2f}, "
              f"{s['paired_diff_max']:+.2f}] ms (median of the paired rounds)")
    print(json.dumps({"bench": "park_ab", "machine": machine(), "rounds": args.rounds,
                      **summary}))


if __name__ == "__main__":
    main()
