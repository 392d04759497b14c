"""Where a conc-1 TTFT goes: the client's TTFT against the daemon's own (``ttft_ms`` of the
request's history row: from the daemon's intake to its first token), per request.

The difference is everything outside the daemon: the client's request and parsing, daphne
(Django, DRF, authentication, the limits script, the history row, the enqueue script, the
stream reader), the Redis hops both ways and the writer's flush of the first text. Our
stack as ``make run`` starts it (service defaults, ``--supervise``), sequential streamed
completions of distinct ~90-word prompts, max_tokens 8, greedy.
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

import openai
from _common import machine
from http_overhead import Stack

MODEL = "gemma-3-270m"


async def measure(base: str, key: str, n: int) -> list[tuple[float, float | None]]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    rows = []
    try:
        for i in range(n):
            prompt = (f"Essay {i} {time.time():.0f} about trains. " + "Write a long and detailed "
                      "essay about this subject, its history, its people and what it means "
                      "to us today. " * 6)
            t0, first, request_id = time.perf_counter(), None, None
            stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                                     temperature=0, stream=True)
            async for chunk in stream:
                request_id = request_id or chunk.id.removeprefix("cmpl-")
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = (time.perf_counter() - t0) * 1000
            await asyncio.sleep(0.3)  # the daemon's history sink writes the row's end
            req = urllib.request.Request(f"{base}/v1/requests/{request_id}",
                                         headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(req, timeout=10) as r:
                daemon = json.loads(r.read()).get("ttft_ms")
            rows.append((first, daemon))
            print(f"client {first:.1f} ms, daemon {daemon} ms", flush=True)
    finally:
        await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    stack = Stack(args.redis_url, 4, 2, MODEL, defaults=True, supervise=True)
    key = stack.open()
    try:
        rows = asyncio.run(measure(f"http://127.0.0.1:{stack.port}", key, args.requests))
    finally:
        stack.close()
    rows = [(c, d) for c, d in rows[2:] if d is not None]  # the first two warm up
    summary = {"client_p50_ms": statistics.median(c for c, _ in rows),
               "daemon_p50_ms": statistics.median(d for _, d in rows),
               "outside_p50_ms": statistics.median(c - d for c, d in rows)}
    print(f"machine: {machine()}")
    print("p50: client {client_p50_ms:.1f} ms, daemon {daemon_p50_ms:.1f} ms, outside the "
          "daemon {outside_p50_ms:.1f} ms".format(**summary))
    print(json.dumps({"bench": "ttft_split", "machine": machine(), **summary}))


if __name__ == "__main__":
    main()
