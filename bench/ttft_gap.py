"""Where the daemon's own TTFT goes around the prefill's decode, at conc 1, by timestamps.

The probe (``phase_probe/sitecustomize.py``, ``PROBE_GAP_FILE``) wraps the scheduler's
``submit``, ``schedule``, ``_assign`` and ``run`` and the engine's ``decode`` and writes, per
admitting tick, the clocks of each step for each request it admits: its arrival (the core's
intake: before tokenizing), its submit to the scheduler (tokenized), the loop's schedule,
its slot's assignment (the prefix cache's ``prepare``) and ``t_started`` after it, the
tick's run, the decode's start and end, and the first token (the commit's clock). No
``/proc`` read falls inside the window (bench/prefill_steal.py's probe reads every task's
``schedstat`` around the decode: a few ms of its own). Per step the p50 over the requests,
and the client's TTFT minus the daemon's (the outside).
Workload: ``ttft_split.measure``'s sequential streamed completions (~157-token prompts,
max_tokens 8), our stack as ``make run`` starts it.
Run:  .venv/bin/python bench/ttft_gap.py [--requests 24] [--env NAME=VALUE ...]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import ttft_split
from _common import machine
from http_overhead import ROOT, Stack

PROBES = Path(__file__).resolve().parent / "phase_probe"
WARM = 2  # the first requests warm up
STEPS = [  # (name, from, to): clocks of the probe's record
    ("tokenize and checks", "arrival", "submitted"),
    ("loop wakes to schedule", "submitted", "schedule"),
    ("schedule to the slot", "schedule", "assign"),
    ("the slot's prepare", "assign", "started"),
    ("started to the decode", "started", "decode_start"),
    ("decode", "decode_start", "decode_end"),
    ("decode to the first token", "decode_end", "first"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="more settings for our stack")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="ttft-gap-")) / "gap.jsonl"
    stack = Stack(args.redis_url, 4, 2, ttft_split.MODEL, root=ROOT, defaults=True,
                  env=dict(item.split("=", 1) for item in args.env), supervise=True)
    stack.daemon_env = {"PYTHONPATH": str(PROBES), "PROBE_GAP_FILE": str(out)}
    key = stack.open()
    try:
        samples = asyncio.run(ttft_split.measure(f"http://127.0.0.1:{stack.port}", key,
                                                 args.requests, args.redis_url))
    finally:
        stack.close()
    records = {}
    for line in out.read_text().splitlines():
        record = json.loads(line)
        record["decode_start"], record["decode_end"] = record.pop("decode")
        records[record["rid"]] = record
    steps: dict[str, list[float]] = {name: [] for name, _, _ in STEPS}
    steps["queue_ms (arrival to started)"], steps["outside"] = [], []
    for sample in samples[WARM:]:
        record = records.get(sample.request_id)
        if record is None or record.get("first") is None or "submitted" not in record:
            continue
        for name, start, end in STEPS:
            steps[name].append((record[end] - record[start]) * 1000)
        steps["queue_ms (arrival to started)"].append(
            (record["started"] - record["arrival"]) * 1000)
        steps["outside"].append(sample.client_ms - (record["first"] - record["arrival"]) * 1000)
    n = len(steps["decode"])
    if not n:
        raise SystemExit(f"no request was recorded whole; see {out}")
    report = {"bench": "ttft_gap", "machine": machine(), "requests": n, "env": args.env,
              "p50_ms": {name: round(statistics.median(v), 3) for name, v in steps.items()},
              "max_ms": {name: round(max(v), 3) for name, v in steps.items()}}
    print(f"machine: {machine()}")
    print(f"command: {' '.join(sys.argv)}")
    print(f"{n} requests (after {WARM} warm-up), p50 and max per step:")
    for name, values in steps.items():
        print(f"  {name:32s} p50 {statistics.median(values):8.2f} ms  max {max(values):8.2f}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
