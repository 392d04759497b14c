"""Where a conc-1 TTFT goes: the client's TTFT against the daemon's own (``ttft_ms`` of the
request's history row: from the daemon's intake to its first token), per request.

The difference is everything outside the daemon: the client's request and parsing, daphne
(Django, DRF, authentication, the limits script, the history row, the enqueue script, the
stream reader), the Redis hops both ways and the writer's flush of the first text. Our
stack as ``make run`` starts it (service defaults, ``--supervise``), sequential streamed
completions of distinct ~90-word prompts, max_tokens 8, greedy.
With the request's events stream read back from Redis (each entry's id is the Redis clock
in ms when the daemon's writer wrote it), the client's TTFT is also split in three, per
request: *to accepted* (the client's send to the ``accepted`` entry: the client and daphne,
the web's path before the enqueue, the enqueue, the daemon's intake and tokenizing),
*prefill* (``accepted`` to the first ``token`` entry) and *delivery* (the first ``token``
entry to the client's first text: the web's stream reader, the SSE frame, the client).
Clocks: the client's ``time.time()`` and Redis's, one machine; ms resolution per request.
Run:  .venv/bin/python bench/ttft_split.py [--requests 16]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import openai
import redis
from _common import machine
from http_overhead import Stack

MODEL = "gemma-3-270m"


def essay(salt: str) -> str:
    """A distinct ~90-word prompt (~157 Gemma tokens)."""
    return (f"Essay {salt} {time.time():.0f} about trains. " + "Write a long and detailed "
            "essay about this subject, its history, its people and what it means to us "
            "today. " * 6)


@dataclass(slots=True)
class Sample:
    """One request as the client and the events stream saw it (times: unix seconds)."""

    request_id: str
    client_ms: float  # the client's TTFT
    daemon_ms: float | None  # the daemon's own ``ttft_ms`` (its history row)
    sent: float
    first_at: float  # the client's first text
    entries: dict[str, float]  # the first ``accepted`` and ``token`` entries (ms resolution)
    timings: dict[str, Any]  # the ``done`` event's
    split: dict[str, float]  # ``phases``, ms


def read_stream(r: redis.Redis, request_id: str) -> tuple[dict[str, float], dict[str, Any]]:
    """The request's first ``accepted`` and ``token`` entries' times (an entry id is Redis's
    clock in ms) and its ``done`` event's timings."""
    entries: dict[str, float] = {}
    timings: dict[str, Any] = {}
    for entry_id, fields in r.xrange(f"llm:events:{request_id}"):
        kind = fields.get(b"type", b"").decode()
        if kind in ("accepted", "token") and kind not in entries:
            entries[kind] = int(entry_id.split(b"-")[0]) / 1000
        elif kind == "done":
            timings = json.loads(fields[b"data"]).get("timings") or {}
    return entries, timings


def phases(entries: dict[str, float], sent: float, first: float,
           created: str | None) -> dict[str, float]:
    """The request's TTFT split at its history row's ``created`` (the web's INSERT, after
    the admission), its events stream's ``accepted`` and first ``token`` entries (ms):
    to the row, the row to accepted, prefill, delivery."""
    if "accepted" not in entries or "token" not in entries:
        return {}
    accepted, token = entries["accepted"] * 1000, entries["token"] * 1000
    split = {"to_accepted": accepted - sent * 1000, "prefill": token - accepted,
             "delivery": first * 1000 - token}
    if created:
        row_ms = datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp() * 1000
        split.update(to_row=row_ms - sent * 1000, row_to_accepted=accepted - row_ms)
    return split


async def measure(base: str, key: str, n: int, redis_url: str) -> list[Sample]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    events = redis.Redis.from_url(redis_url)
    samples = []
    try:
        for i in range(n):
            prompt = essay(str(i))
            t0, first, request_id = time.perf_counter(), None, None
            sent, first_at = time.time(), 0.0
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                     temperature=0, stream=True)
            async for chunk in stream:
                request_id = request_id or chunk.id.removeprefix("cmpl-")
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = (time.perf_counter() - t0) * 1000
                    first_at = time.time()
            await asyncio.sleep(0.3)  # the daemon's history sink writes the row's end
            req = urllib.request.Request(f"{base}/v1/requests/{request_id}",
                                         headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=10) as reply:
                row = json.loads(reply.read())
            entries, timings = read_stream(events, request_id)
            split = phases(entries, sent, first_at, row.get("created"))
            samples.append(Sample(request_id, first, row.get("ttft_ms"), sent, first_at,
                                  entries, timings, split))
            print(f"client {first:.1f} ms, daemon {row.get('ttft_ms')} ms, "
                  + ", ".join(f"{k} {v:.0f}" for k, v in split.items()), flush=True)
    finally:
        await client.close()
        events.close()
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    stack = Stack(args.redis_url, 4, 2, MODEL, defaults=True, supervise=True)
    key = stack.open()
    try:
        rows = asyncio.run(measure(f"http://127.0.0.1:{stack.port}", key, args.requests,
                                   args.redis_url))
    finally:
        stack.close()
    rows = [s for s in rows[2:] if s.daemon_ms is not None]  # the first two warm up
    summary = {"client_p50_ms": statistics.median(s.client_ms for s in rows),
               "daemon_p50_ms": statistics.median(s.daemon_ms for s in rows),
               "outside_p50_ms": statistics.median(s.client_ms - s.daemon_ms for s in rows)}
    for phase in ("to_row", "row_to_accepted", "to_accepted", "prefill", "delivery"):
        values = [s.split[phase] for s in rows if s.split]
        if values:
            summary[f"{phase}_p50_ms"] = statistics.median(values)
    print(f"machine: {machine()}")
    print("p50: client {client_p50_ms:.1f} ms, daemon {daemon_p50_ms:.1f} ms, outside the "
          "daemon {outside_p50_ms:.1f} ms".format(**summary))
    print("p50 split: " + ", ".join(f"{k.removesuffix('_p50_ms')} {v:.1f} ms"
                                   for k, v in summary.items()
                                   if k.startswith(("to_", "row_", "prefill", "delivery"))))
    print(json.dumps({"bench": "ttft_split", "machine": machine(), **summary}))


if __name__ == "__main__":
    main()
