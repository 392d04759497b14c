"""One OpenMP team or two: what a decode on a second thread costs every later decode.

ggml runs a graph as an OpenMP team whose master is the thread calling ``llama_decode``;
libgomp keeps a pool of workers per master. Until commit 7901a29 the engine's load-time KV
probe decoded with every thread on the thread that built the engine, and the scheduler's
loop then decoded on its own thread: two pools, more threads managed than CPUs, and libgomp
cut its barrier spin from ~300,000 to ~100 iterations, so each op of each decode ended in a
futex sleep. This runs the in-process core (no web, no Redis) both ways in fresh processes,
taking turns: ``two`` repeats the old probe (a multi-threaded decode on the main thread),
``one`` is the engine as it is. Per run: tok/s, the process's CPU share of the machine, its
threads, and voluntary / involuntary context switches per generated token.
Run:  .venv/bin/python bench/openmp_team.py [--conc 4] [--reps 2] [--tokens 96]
The last line printed is JSON: {"bench": "openmp_team", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from _common import ROOT, machine, model_path

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[4])
from cost_breakdown import thread_cpu
import scheduler_daemon.engine as E
from scheduler_daemon.core import InferenceCore
from scheduler_daemon.scheduler import SchedulerConfig
from wire.sampling import SamplingParams

mode, conc, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if mode == "two":  # the probe as it was: a decode with every thread, on the building thread
    def probe(self):
        token = max(0, self.bos_token)
        self.decode([E.BatchRow(0, (token, token), 0, True)])
        self._compute_thread = None  # not warned about: this is the experiment
        two = self.state_size(0)
        self.kv_remove(0, 1, -1)
        one = self.state_size(0)
        self.kv_remove(0, 0, -1)
        return max(0, two - one)
    E.LlamaEngine._measure_kv_bytes_per_token = probe

def switches():
    out = [0, 0]
    for t in os.listdir(f"/proc/{os.getpid()}/task"):
        for line in open(f"/proc/{os.getpid()}/task/{t}/status"):
            if line.startswith("voluntary_ctxt_switches"):
                out[0] += int(line.split()[1])
            elif line.startswith("nonvoluntary_ctxt_switches"):
                out[1] += int(line.split()[1])
    return out

engine = E.LlamaEngine(E.EngineConfig(model_path=sys.argv[5], n_ctx=8192, n_batch=2048,
                                      n_seq_max=4, n_threads=os.cpu_count() or 2))
core = InferenceCore(engine, SchedulerConfig())
core.start()
core.submit(prompt="Warm up.", params=SamplingParams(max_tokens=4)).result(timeout=120)
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
cpu0, t0, s0 = thread_cpu(os.getpid()), time.perf_counter(), switches()
handles = [core.submit(prompt=f"Story {i} {mode} {time.time()} about trains. " + "Write a long "
                       "and detailed story about this subject, its history. " * 6,
                       params=params, cache_prompt=False) for i in range(conc)]
made = sum(h.result(timeout=600).finished.stats.completion_tokens for h in handles)
wall, cpu1, s1 = time.perf_counter() - t0, thread_cpu(os.getpid()), switches()
cpu = sum(v[0] - cpu0.get(t, (0.0, 0))[0] for t, v in cpu1.items())
print(json.dumps({"mode": mode, "tok_s": round(made / wall, 2),
                  "cpu_share": round(cpu / (wall * 1000 * (os.cpu_count() or 1)), 3),
                  "threads": len(os.listdir(f"/proc/{os.getpid()}/task")),
                  "voluntary_per_token": round((s1[0] - s0[0]) / made, 1),
                  "involuntary_per_token": round((s1[1] - s0[1]) / made, 1)}))
core.stop(grace_s=0)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, default=4)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    bench = str(Path(__file__).resolve().parent)
    rows: dict[str, list[dict]] = {"two": [], "one": []}
    print(f"machine: {machine()}")
    print(f"command: {' '.join(sys.argv)}")
    for rep in range(args.reps):
        for mode in ("two", "one") if rep % 2 == 0 else ("one", "two"):
            done = subprocess.run([sys.executable, "-c", CHILD, mode, str(args.conc),
                                   str(args.tokens), bench, model_path()], cwd=ROOT, env=env,
                                  capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rows[mode].append(row)
            print(f"rep {rep} {mode} team(s): {row}", flush=True)
    summary = {mode: {key: statistics.median(r[key] for r in got) for key in got[0]
                      if key != "mode"} for mode, got in rows.items()}
    ratio = summary["one"]["tok_s"] / summary["two"]["tok_s"]
    print(f"median tok/s: two teams {summary['two']['tok_s']:.1f}, one team "
          f"{summary['one']['tok_s']:.1f} ({ratio:.2f}x)")
    print(json.dumps({"bench": "openmp_team", "machine": machine(), "conc": args.conc,
                      "summary": summary, "rows": rows}))


if __name__ == "__main__":
    main()
