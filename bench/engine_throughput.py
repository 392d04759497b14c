"""Aggregate generated tokens/s of the scheduler core versus plain llama_decode loops.

For each concurrency N: N distinct ~100-token prompts, 64 new tokens each, ignore_eos,
greedy. "ours" submits them to the in-process core (scheduler thread, chunked prefill,
per-request samplers, text streams, events); "raw" runs the same batch shapes by hand
(one prefill decode of the N prompts, then one decode of N tokens per step, numpy argmax).
Both include prefill; each figure is the best of --reps interleaved runs (other load on a
shared machine only ever slows a run down). Each side runs in a process of its own (the
bench talks to both over pipes, one run at a time): in one process the raw loop on the main
thread and the core's loop thread would be two OpenMP teams, and libgomp throttles every
team's barrier spin once it manages more threads than CPUs (docs/performance.md), which
would slow both sides alike. ``--logprobs N``: ours asks for log probabilities
with N alternatives per token (what such a request costs; without it, the default run is
the hot path every other request takes). Run:  .venv/bin/python bench/engine_throughput.py
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from _common import command, machine, model_path

from scheduler_daemon.core.engine_api import BatchRow
from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
from wire.sampling import SamplingParams

PROMPT_TOKENS = 100


def make_prompts(engine: LlamaEngine, n: int) -> list[list[int]]:
    topics = ["rivers", "mountains", "trains", "bread", "stars", "gardens", "cities", "music"]
    prompts = []
    for i in range(n):
        text = (
            f"Essay {i} about {topics[i % len(topics)]}. "
            * 3
            + "Write a long, careful and detailed essay about this subject, covering its history, "
            "its present and its future, with examples from many countries and periods. " * 4
        )
        prompts.append(engine.tokenize(text)[:PROMPT_TOKENS])
    return prompts


def run_ours(core: InferenceCore, prompts: list[list[int]], new_tokens: int,
             logprobs: int | None = None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                            logprobs=logprobs)
    t0 = time.perf_counter()
    handles = [core.submit(prompt=p, params=params, cache_prompt=False) for p in prompts]
    generated = sum(h.result(timeout=600).finished.stats.completion_tokens for h in handles)
    return generated / (time.perf_counter() - t0)


def run_raw(engine: LlamaEngine, prompts: list[list[int]], new_tokens: int) -> float:
    for seq in range(len(prompts)):
        engine.kv_remove(seq)
    t0 = time.perf_counter()
    rows = [BatchRow(seq, p, 0, True) for seq, p in enumerate(prompts)]
    if engine.decode(rows) != 0:
        raise RuntimeError("raw prefill failed")
    offsets = [sum(len(p) for p in prompts[: i + 1]) - 1 for i in range(len(prompts))]
    last = [int(engine.logits_row(o).argmax()) for o in offsets]
    for step in range(1, new_tokens):
        rows = [
            BatchRow(seq, (last[seq],), PROMPT_TOKENS + step - 1, True)
            for seq in range(len(prompts))
        ]
        if engine.decode(rows) != 0:
            raise RuntimeError("raw decode failed")
        last = [int(engine.logits_row(i).argmax()) for i in range(len(prompts))]
    elapsed = time.perf_counter() - t0
    for seq in range(len(prompts)):
        engine.kv_remove(seq)
    return len(prompts) * new_tokens / elapsed


def worker(side: str, n_seq: int, threads: int, logprobs: int | None = None) -> None:
    """One side in its own process: reads "conc new_tokens" lines, answers tok/s lines."""
    logging.basicConfig(level=logging.WARNING)
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=n_seq, n_threads=threads))
    prompts = make_prompts(engine, n_seq)
    core = None
    if side == "ours":
        core = InferenceCore(engine, SchedulerConfig(chunk_size=512))
        core.start()
    run = (lambda c, n: run_ours(core, prompts[:c], n, logprobs)) if core else (
        lambda c, n: run_raw(engine, prompts[:c], n))
    run(1, 8)  # warm-up
    print("ready", flush=True)
    for line in sys.stdin:
        conc, new_tokens = map(int, line.split())
        print(run(conc, new_tokens), flush=True)
    if core:
        core.stop(grace_s=0)
    engine.close()


class Side:
    def __init__(self, side: str, n_seq: int, threads: int, logprobs: int | None = None) -> None:
        extra = ["--logprobs", str(logprobs)] if logprobs is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", side, "--conc", str(n_seq),
             "--threads", str(threads), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the {side} worker did not start")

    def run(self, conc: int, new_tokens: int) -> float:
        self.proc.stdin.write(f"{conc} {new_tokens}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--logprobs", type=int, default=None,
                        help="ours asks for logprobs with this many alternatives per token")
    parser.add_argument("--worker", choices=["raw", "ours"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    n_seq = max(args.conc)
    if args.worker:
        worker(args.worker, n_seq, args.threads, args.logprobs)
        return
    raw_side = Side("raw", n_seq, args.threads)
    ours_side = Side("ours", n_seq, args.threads, args.logprobs)
    print(f"machine: {machine()}")
    print(f"command: {command()}")
    print(f"model: {model_path()}  threads={args.threads} n_ctx=8192 n_batch=2048 "
          f"n_seq_max={n_seq}; each side in its own process"
          + (f"; ours asks logprobs={args.logprobs}" if args.logprobs is not None else ""))
    rows = []
    print(f"{'conc':>4} {'ours tok/s':>11} {'raw tok/s':>10} {'ratio':>6}")
    try:
        for conc in args.conc:
            ours, raw = [], []
            for _ in range(args.reps):  # interleaved, so drift hits both alike
                raw.append(raw_side.run(conc, args.new_tokens))
                ours.append(ours_side.run(conc, args.new_tokens))
            row = {"conc": conc, "ours_tok_s": round(max(ours), 2),
                   "raw_tok_s": round(max(raw), 2)}
            row["ratio"] = round(row["ours_tok_s"] / row["raw_tok_s"], 3)
            rows.append(row)
            print(f"{conc:>4} {row['ours_tok_s']:>11.2f} {row['raw_tok_s']:>10.2f} "
                  f"{row['ratio']:>6.3f}", flush=True)
    finally:
        raw_side.close()
        ours_side.close()
    print(json.dumps({"bench": "engine_throughput", "machine": machine(),
                      "new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS,
                      "logprobs": args.logprobs,
                      "reps": args.reps, "rows": rows}))


if __name__ == "__main__":
    main()
