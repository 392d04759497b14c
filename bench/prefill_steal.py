"""What else runs while a conc-1 prefill decodes, and what it takes from the engine.

On a 2-core box llama.cpp's two threads (the loop thread and its OpenMP worker) own both
cores during a prefill; any other task that runs then takes a core from one of them, and
the other waits at the next barrier. The daemon's probe (``phase_probe/sitecustomize.py``,
``$PROBE_STEAL_FILE``) reads every task's ``/proc/<pid>/task/<tid>/schedstat`` (ns on a
CPU, ns runnable but waiting for one) before and after the decode of each tick that admits
a request (its prefill; the tick's commit, which sends the first token, is outside): the
daemon's threads by name, the engine's (``engine:loop``, ``engine:native``: the OpenMP
worker), the supervisor, daphne (``web``), redis-server and this client, and the machine's
busy and steal time (``/proc/stat``, 10 ms ticks). Per component the mean CPU ms during a
prefill tick; the engine's wait ms is the time its threads were ready but off a CPU; how
many times each got a CPU (schedstat's third field) and, for the daemon's threads, how many
times it moved to another CPU (``se.nr_migrations``).
Workload: ``ttft_split.measure``'s sequential streamed completions (~157-token prompts,
max_tokens 8). Our stack as ``make run`` starts it; ``--baseline DIR`` runs another
checkout's stack beside it (its own Redis database), taking turns per round.
``--this-env NAME=VALUE`` gives this checkout's daemon more environment (``PROBE_PIN=1``:
the probe pins the engine's threads each to a CPU of its own, an experiment).
Run:  .venv/bin/python bench/prefill_steal.py [--requests 12] [--rounds 3] [--baseline DIR]
          [--this-env PROBE_PIN=1]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from collections import defaultdict
from pathlib import Path

import ttft_split
from _common import machine
from http_overhead import ROOT, Stack

MODEL = "gemma-3-270m"
PROBES = Path(__file__).resolve().parent / "phase_probe"
WARM = 2  # the first requests of a round warm up


def open_stack(root: Path, redis_url: str, steal_file: Path,
               env: dict[str, str] | None = None) -> tuple[Stack, str]:
    stack = Stack(redis_url, 4, 2, MODEL, root=root, defaults=True, supervise=True)
    stack.daemon_env = {"PYTHONPATH": str(PROBES), "PROBE_STEAL_FILE": str(steal_file),
                        "PROBE_CLIENT_PID": str(os.getpid()),
                        "PROBE_WEB_MARKER": f"tcp:port={stack.port}:", **(env or {})}
    return stack, stack.open()


def summarize(ticks: list[dict], samples: list[ttft_split.Sample]) -> dict:
    """Per component the mean run and wait ms over the warm requests' prefill ticks."""
    run: dict[str, list[float]] = defaultdict(list)
    wait: dict[str, list[float]] = defaultdict(list)
    slices: dict[str, list[float]] = defaultdict(list)
    moves: dict[str, list[float]] = defaultdict(list)
    for tick in ticks:
        for name in set(tick["run_ms"]) | set(tick["wait_ms"]):
            run[name].append(tick["run_ms"].get(name, 0.0))
            wait[name].append(tick["wait_ms"].get(name, 0.0))
            slices[name].append(tick.get("slices", {}).get(name, 0))
            moves[name].append(tick.get("moves", {}).get(name, 0))
    n = len(ticks)

    def mean(values: list[float]) -> float:
        return round(sum(values) / n, 3) if n else 0.0

    engine = ("engine:loop", "engine:native")
    others = [name for name in run if name not in engine]
    return {
        "prefill_ticks": n,
        "wall_p50_ms": round(statistics.median(t["wall_ms"] for t in ticks), 2) if n else None,
        "client_p50_ms": round(statistics.median(s.client_ms for s in samples), 2),
        "engine_wait_ms": round(sum(mean(wait[name]) for name in engine if name in wait), 3),
        "others_run_ms": round(sum(mean(run[name]) for name in others), 3),
        "machine_busy_ms": mean([t["machine_busy_ms"] for t in ticks]),
        "steal_ms": mean([t["steal_ms"] for t in ticks]),
        "run_ms": {name: mean(values) for name, values in sorted(run.items())},
        "wait_ms": {name: mean(values) for name, values in sorted(wait.items())},
        "slices": {name: mean(values) for name, values in sorted(slices.items())},
        "moves": {name: mean(values) for name, values in sorted(moves.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12, help="per round and stack")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--baseline-redis-url", default="redis://127.0.0.1:6379/12")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout (a git worktree of the commit before a change)")
    parser.add_argument("--this-env", action="append", default=[], metavar="NAME=VALUE",
                        help="more environment for this checkout's daemon (an experiment "
                             "in the probe, e.g. PROBE_PIN=1)")
    args = parser.parse_args()
    this_env = dict(item.split("=", 1) for item in args.this_env)
    tmp = Path(tempfile.mkdtemp(prefix="prefill-steal-"))
    sides = {"this": (ROOT, args.redis_url)}
    if args.baseline:
        sides["baseline"] = (args.baseline.resolve(), args.baseline_redis_url)
    stacks: dict[str, tuple[Stack, str]] = {}
    samples: dict[str, list[ttft_split.Sample]] = defaultdict(list)
    try:
        for name, (root, redis_url) in sides.items():
            stacks[name] = open_stack(root, redis_url, tmp / f"{name}.jsonl",
                                      this_env if name == "this" else None)
        for round_no in range(args.rounds):
            order = list(sides) if round_no % 2 == 0 else list(reversed(sides))
            for name in order:
                stack, key = stacks[name]
                print(f"round {round_no + 1}: {name}", flush=True)
                got = asyncio.run(ttft_split.measure(f"http://127.0.0.1:{stack.port}", key,
                                                     args.requests + WARM, sides[name][1]))
                samples[name].extend(got[WARM:])
    finally:
        for stack, _ in stacks.values():
            stack.close()
    report = {"bench": "prefill_steal", "machine": machine(), "requests": args.requests,
              "rounds": args.rounds, "this_env": this_env}
    print(f"machine: {machine()}")
    for name in sides:
        warm = {s.request_id for s in samples[name]}
        ticks = [json.loads(line) for line in (tmp / f"{name}.jsonl").read_text().splitlines()]
        ticks = [t for t in ticks if len(t["rids"]) == 1 and t["rids"][0] in warm]
        result = summarize(ticks, samples[name])
        report[name] = {"root": str(sides[name][0]), **result}
        print(f"{name} ({sides[name][0]}): {result['prefill_ticks']} prefill ticks, wall p50 "
              f"{result['wall_p50_ms']} ms, client TTFT p50 {result['client_p50_ms']} ms")
        print(f"  engine's threads waiting for a CPU: {result['engine_wait_ms']:.2f} ms per "
              f"prefill; everything else on a CPU meanwhile: {result['others_run_ms']:.2f} ms; "
              f"machine busy {result['machine_busy_ms']:.1f} ms, steal {result['steal_ms']:.1f}")
        for component, ms in result["run_ms"].items():
            print(f"  {component:28s} run {ms:7.2f} ms  wait {result['wait_ms'][component]:6.2f}"
                  f"  on a CPU {result['slices'][component]:6.1f} times"
                  f"  moved {result['moves'][component]:5.1f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
