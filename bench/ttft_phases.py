"""Where a conc-1 TTFT goes outside the prefill, step by step: wall-clock marks along the
web's path (``phase_probe/web_probe.py``, loaded as daphne's application), along the daemon's
(``phase_probe/sitecustomize.py``, on the daemon's PYTHONPATH) and at the events stream's
entries (their ids are Redis's clock), for sequential streamed completions of distinct
~90-word prompts (``ttft_split.measure``: max_tokens 8, greedy). The probes wrap this
project's functions only; they cost a few microseconds per mark. One machine, one clock
(``time.time()``); an events-stream entry has ms resolution (a step that starts or ends at
one reads ~0.5 ms short or long). Our stack as ``make run`` starts it, probed.
Run:  .venv/bin/python bench/ttft_phases.py [--requests 30]
The last line printed is JSON (each step's p50 in ms).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
from pathlib import Path

import ttft_split
from _common import machine
from http_overhead import ROOT, Stack

MODEL = "gemma-3-270m"
PROBES = Path(__file__).resolve().parent / "phase_probe"
# (from, to): each step of the path, in order; the client's marks are "sent" and "first"
STEPS = [
    ("sent", "app"), ("app", "view"), ("view", "admit_start"), ("admit_start", "admit_end"),
    ("admit_end", "row_start"), ("row_start", "row_end"), ("row_end", "enqueue_start"),
    ("enqueue_start", "enqueue_end"), ("enqueue_end", "bell"), ("bell", "take_start"),
    ("take_start", "take_end"), ("take_end", "start"), ("start", "checks_end"),
    ("checks_end", "core_start"), ("core_start", "core_end"), ("core_end", "planned"),
    ("accepted_xadd", "accepted_read"), ("token_xadd", "token_read"),
    ("token_read", "first_send"), ("first_send", "first_sent"), ("first_sent", "first"),
]


class ProbedStack(Stack):
    """``Stack`` with daphne serving ``web_probe:application`` and the daemon probed."""

    def __init__(self, redis_url: str, marks: Path) -> None:
        super().__init__(redis_url, 4, 2, MODEL, defaults=True, supervise=True)
        self.web_marks, self.daemon_marks = marks / "web.jsonl", marks / "daemon.jsonl"
        self.application = "web_probe:application"
        self.web_env = {"PYTHONPATH": f"{PROBES}{os.pathsep}{ROOT}",
                        "PROBE_FILE": str(self.web_marks)}
        self.daemon_env = {"PYTHONPATH": str(PROBES),
                           "PROBE_DAEMON_FILE": str(self.daemon_marks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    marks_dir = Path(tempfile.mkdtemp(prefix="ttft-phases-"))
    stack = ProbedStack(args.redis_url, marks_dir)
    key = stack.open()
    try:
        samples = asyncio.run(ttft_split.measure(f"http://127.0.0.1:{stack.port}", key,
                                                 args.requests, args.redis_url))
    finally:
        stack.close()
    marks = {s.request_id: {"sent": s.sent, "first": s.first_at,
                            **{f"{kind}_xadd": t for kind, t in s.entries.items()}}
             for s in samples}
    for line in stack.web_marks.read_text().splitlines():
        record = json.loads(line)
        marks.get(record.pop("id"), {}).update(record)
    by_entry: dict[str, str] = {}
    daemon_lines = [json.loads(line) for line in stack.daemon_marks.read_text().splitlines()]
    for record in daemon_lines:
        if "eid" in record and "rid" in record:
            by_entry[record["eid"]] = record["rid"]
    for record in daemon_lines:
        request_id = record.pop("rid", None) or by_entry.get(record.get("eid", ""))
        record.pop("eid", None)
        if request_id in marks:
            marks[request_id].update(record)
    warm = list(marks.values())[2:]  # the first two warm up
    summary: dict[str, float] = {}
    print(f"machine: {machine()}")
    for a, b in STEPS:
        values = [(m[b] - m[a]) * 1000 for m in warm if a in m and b in m]
        if values:
            summary[f"{a}->{b}"] = round(statistics.median(values), 2)
            print(f"{a + ' -> ' + b:32s} p50 {summary[f'{a}->{b}']:6.2f} ms  (n={len(values)})")
    client = statistics.median(s.client_ms for s in samples[2:])
    daemon = statistics.median(s.daemon_ms for s in samples[2:] if s.daemon_ms is not None)
    print(f"p50: client {client:.1f} ms, daemon {daemon:.1f} ms")
    print(json.dumps({"bench": "ttft_phases", "machine": machine(), "client_p50_ms": client,
                      "daemon_p50_ms": daemon, "steps_p50_ms": summary}))


if __name__ == "__main__":
    main()
