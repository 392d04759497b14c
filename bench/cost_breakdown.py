"""Where the served throughput goes: CPU per generated token of every process and thread.

The same streamed workload as bench/vs_llama_server.py's ``tput_cN`` (N concurrent
completions of 128 new tokens, the openai SDK), on our stack and on llama-server,
alternating rounds. Around each round, from /proc: the CPU (user + system) of daphne, of the
daemon's threads (named by ``py-spy dump``: the tick loop, the event writer, the intake...;
the threads py-spy does not list are llama.cpp's own workers), of redis-server and of this
client process; and the involuntary context switches of the decoding threads (how often
the scheduler took their core away: on 2 cores every other runnable process does).
Printed per side: tok/s, CPU ms per generated token per component, and the share of the
machine's CPU each took. The last line is JSON.
Run:  .venv/bin/python bench/cost_breakdown.py [--conc 1] [--rounds 3] [--env NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import redis
from _common import ROOT, Stack, machine
from llama_server_build import build
from vs_llama_server import LlamaServer, Side, throughput

TICKS = os.sysconf("SC_CLK_TCK")
PY_SPY = Path(sys.executable).with_name("py-spy")


def thread_cpu(pid: int) -> dict[int, tuple[float, int]]:
    """tid -> (CPU ms so far, involuntary context switches so far)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:
            continue
        switches = int(re.search(r"nonvoluntary_ctxt_switches:\s+(\d+)", status).group(1))
        out[int(tid)] = ((int(stat[11]) + int(stat[12])) * 1000 / TICKS, switches)
    return out


def python_threads(pid: int) -> dict[int, str]:
    """tid -> Python thread name, from py-spy (threads it does not list are native)."""
    dump = subprocess.run([str(PY_SPY), "dump", "--pid", str(pid)], capture_output=True,
                          text=True, check=True).stdout
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r'^Thread (?:0x)?(\w+) \(\w+\): "([^"]*)"', dump, re.M)}


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return (usage.ru_utime + usage.ru_stime) * 1000


class Probe:
    """CPU and switches of named groups of threads, between ``start`` and ``stop``."""

    def __init__(self, groups: dict[str, tuple[int, set[int] | None]]) -> None:
        self.groups = groups  # name -> (pid, tids or None for all of the process's)

    def read(self) -> dict[str, tuple[float, int]]:
        out = {}
        for name, (pid, tids) in self.groups.items():
            threads = thread_cpu(pid)
            chosen = [v for t, v in threads.items() if tids is None or t in tids]
            out[name] = (sum(c for c, _ in chosen), sum(s for _, s in chosen))
        out["client"] = (self_cpu(), 0)
        return out


def daemon_groups(pid: int) -> dict[str, tuple[int, set[int] | None]]:
    names = python_threads(pid)
    tids = set(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    groups: dict[str, set[int]] = {}
    for tid, name in names.items():
        if tid not in tids:
            continue
        label = {"MainThread": "daemon main"}.get(name, f"daemon {name}")
        groups.setdefault(label, set()).add(tid)
    groups["daemon llama.cpp workers"] = tids - set(names)
    return {label: (pid, members) for label, members in groups.items()}


def redis_pid(url: str) -> int:
    return int(redis.Redis.from_url(url).info("server")["process_id"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--root", type=Path, default=ROOT)
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.env)
    peer = LlamaServer(build(), args.threads)
    ours = Stack(args.redis_url, 4, args.threads, f"bench-{secrets.token_hex(3)}",
                 root=args.root, defaults=True, env=overrides)
    try:
        a = peer.start()
        b = Side("ours", f"http://127.0.0.1:{ours.port}", ours.model, ours.open())
        for side in (a, b):
            asyncio.run(throughput(side, args.conc, f"warm-{secrets.token_hex(2)}", 1))
        daemon, daphne = ours.procs[0].pid, ours.procs[1].pid
        probes = {
            "llama-server": Probe({"llama-server": (peer.proc.pid, None),
                                   "redis": (redis_pid(args.redis_url), None)}),
            "ours": Probe({"daphne": (daphne, None), **daemon_groups(daemon),
                           "redis": (redis_pid(args.redis_url), None)}),
        }
        decoding = {"llama-server": "llama-server", "ours": "daemon llama.cpp workers"}
        rows: dict[str, list[dict]] = {"llama-server": [], "ours": []}
        for r in range(args.rounds):
            for side in ((a, b) if r % 2 == 0 else (b, a)):
                probe = probes[side.name]
                before, t0 = probe.read(), time.perf_counter()
                result = asyncio.run(throughput(side, args.conc, f"r{r}-{secrets.token_hex(3)}",
                                                args.batches))
                wall, after = time.perf_counter() - t0, probe.read()
                tokens = result["tok_s"] * wall  # median batch rate x wall: close enough
                cpu = {k: after[k][0] - before[k][0] for k in after}
                rows[side.name].append({
                    "tok_s": result["tok_s"], "wall_s": wall,
                    "cpu_ms_per_token": {k: v / tokens for k, v in cpu.items()},
                    "cpu_share": {k: v / (wall * 1000 * (os.cpu_count() or 1))
                                  for k, v in cpu.items()},
                    "preempted_per_token": (after[decoding[side.name]][1]
                                            - before[decoding[side.name]][1]) / tokens,
                })
                print(f"round {r} {side.name}: {result['tok_s']:.2f} tok/s", flush=True)
    finally:
        ours.close()
        peer.stop()
    summary = {}
    print(f"machine: {machine()}\ncommand: {' '.join(sys.argv)}  (conc {args.conc})")
    for name, results in rows.items():
        keys = results[0]["cpu_ms_per_token"].keys()
        summary[name] = {
            "tok_s": statistics.median(x["tok_s"] for x in results),
            "cpu_ms_per_token": {k: round(statistics.median(x["cpu_ms_per_token"][k]
                                                            for x in results), 3) for k in keys},
            "cpu_share": {k: round(statistics.median(x["cpu_share"][k] for x in results), 3)
                          for k in keys},
            "preempted_per_token": round(statistics.median(x["preempted_per_token"]
                                                           for x in results), 2),
        }
        s = summary[name]
        print(f"{name}: {s['tok_s']:.2f} tok/s, decoding threads preempted "
              f"{s['preempted_per_token']:.2f} times per token")
        for k in keys:
            print(f"  {k:28} {s['cpu_ms_per_token'][k]:8.3f} ms/token "
                  f"{100 * s['cpu_share'][k]:6.1f}% of the machine")
    print(json.dumps({"bench": "cost_breakdown", "machine": machine(), "conc": args.conc,
                      "env": overrides, "root": str(args.root), "sides": summary}))


if __name__ == "__main__":
    main()
