"""Where daphne's (and the daemon's) time per streamed token goes, by function (py-spy samples).

bench/cost_breakdown.py says how much CPU each process and daemon thread spends per token
(from /proc); this says in what. Our stack as ``make run`` starts it (the service's
defaults), the streamed throughput workload of bench/vs_llama_server.py (``--conc``
concurrent completions, 128 new tokens, the openai SDK), while ``py-spy record`` samples
daphne (``--daemon``: the daemon too) without pausing it (``--nonblocking``). Printed per
process: ms per generated token by the innermost library a sample was in, per thread, and
the top functions by self time; and the Redis commands per token over the same window
(``INFO commandstats``, reset before it: server-wide, so run it on a Redis nothing else
uses). The last line is JSON.

Read it as shares, not as CPU: py-spy counts a sample of a thread whose state is R, which
is running *or runnable*, and on 2 cores that llama.cpp's two threads keep busy a woken
thread often waits for a CPU (a wake from ``epoll`` shows as time in ``selectors.py``).
py-spy's own sampling takes CPU from the same cores (sampling the daemon's eight threads
too slows the workload by a third): tok/s here is not the service's.
Run:  .venv/bin/python bench/web_profile.py [--conc 4] [--batches 3] [--rate 100] [--daemon]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import redis
from _common import machine
from cost_breakdown import PY_SPY
from http_overhead import Stack
from vs_llama_server import NEW_TOKENS, Side, throughput

# a sample belongs to the innermost frame that names a group: (group, substring of a frame)
GROUPS = [
    ("engine decode (llama.cpp)", "LlamaEngine.decode"),
    ("event loop wait (selectors)", "selectors.py"),
    ("json", "json/"),
    ("redis-py", "redis/"),
    ("django", "django/"),
    ("daphne", "daphne/"),
    ("twisted", "twisted/"),
    ("asgiref", "asgiref/"),
    ("channels", "channels/"),
    ("asyncio", "asyncio/"),
    ("ours: inference/", "inference/"),
    ("ours: wire/", "wire/"),
    ("ours: scheduler_daemon/", "scheduler_daemon/"),
]


def group_of(frames: list[str]) -> str:
    """``frames`` from the leaf up."""
    for frame in frames:
        for name, key in GROUPS:
            if key in frame:
                return name
    return "other"


def parse(raw: Path) -> tuple[Counter, Counter, Counter, int]:
    """py-spy's raw (collapsed) output: per group, per leaf function, per thread; total."""
    groups, leaves, threads, total = Counter(), Counter(), Counter(), 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        threads[frames[0]] += n
        groups[group_of(frames[1:][::-1])] += n
        leaves[frames[-1]] += n
    return groups, leaves, threads, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, default=4)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--rate", type=int, default=100)
    parser.add_argument("--daemon", action="store_true", help="sample the daemon too")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="web-profile-"))
    ours = Stack(args.redis_url, 4, 2, f"bench-{secrets.token_hex(3)}", defaults=True)
    report: dict = {"bench": "web_profile", "machine": machine(), "conc": args.conc,
                    "rate": args.rate, "processes": {}}
    try:
        side = Side("ours", f"http://127.0.0.1:{ours.port}", ours.model, ours.open())
        asyncio.run(throughput(side, args.conc, f"warm-{secrets.token_hex(2)}", 1))
        pids = {"daphne": ours.procs[1].pid}
        if args.daemon:
            pids["daemon"] = ours.procs[0].pid
        spies = {name: subprocess.Popen(
            [str(PY_SPY), "record", "--pid", str(pid), "--rate", str(args.rate), "--format",
             "raw", "--threads", "--nonblocking", "--output", str(out / f"{name}.raw")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for name, pid in pids.items()}
        server = redis.Redis.from_url(args.redis_url)
        server.config_resetstat()
        got = asyncio.run(throughput(side, args.conc, f"p-{secrets.token_hex(2)}", args.batches))
        commands = server.info("commandstats")
        for spy in spies.values():
            spy.send_signal(2)  # SIGINT: py-spy writes its output and ends
            spy.wait(60)
        tokens = args.conc * NEW_TOKENS * args.batches
        print(f"machine: {machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"ours (defaults) at conc {args.conc}: {got['tok_s']:.1f} tok/s under the sampler, "
              f"{tokens} tokens, {', '.join(pids)} sampled at {args.rate} Hz")
        for name in pids:
            groups, leaves, threads, total = parse(out / f"{name}.raw")
            per_token = 1000 / args.rate / tokens  # ms sampled (running or runnable), per token
            print(f"\n{name}: {total * per_token:.3f} ms sampled per token in {total} samples")
            for label, n in groups.most_common():
                print(f"  {label:28s} {n * per_token:7.3f} ms/token  {n / total:6.1%}")
            print("  threads: " + ", ".join(f"{t.split(': ', 1)[-1][:30]} {n * per_token:.3f}"
                                            for t, n in threads.most_common(8)))
            print("  top functions by self time:")
            for leaf, n in leaves.most_common(15):
                print(f"    {n * per_token:7.3f} ms/token  {leaf[:110]}")
            report["processes"][name] = {
                "ms_per_token": round(total * per_token, 4),
                "groups": {k: round(v * per_token, 4) for k, v in groups.most_common()},
                "threads": {k: round(v * per_token, 4) for k, v in threads.most_common(12)},
                "top_self": {k: round(v * per_token, 4) for k, v in leaves.most_common(25)}}
        print("\nRedis commands per generated token (every client of the server):")
        calls = sorted(((v["calls"], k.removeprefix("cmdstat_"), v["usec"])
                        for k, v in commands.items()), reverse=True)
        for n, name, usec in calls[:12]:
            print(f"  {name:28s} {n / tokens:6.3f} per token  {usec / tokens:6.1f} us/token "
                  "inside Redis")
        report["redis_per_token"] = {name: round(n / tokens, 4) for n, name, _ in calls}
        report["tok_s"] = round(got["tok_s"], 2)
    finally:
        ours.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
