"""CPU the web process (daphne) and the daemon spend per request, read from /proc.

On a 2-core machine every millisecond the web spends is taken from llama.cpp's threads, so
this is the number behind bench/http_overhead.py's TTFT and throughput gaps, and it is far
less noisy than either: CPU time does not depend on what else the machine is doing (much).
Sequential requests, one at a time, through the same stack http_overhead.py starts
(daphne + run_scheduler + Redis, service defaults):
  short:  POST /v1/completions, max_tokens 1, streamed (SSE) and not;
  stream: max_tokens N streamed, so (stream - short) / (N - 1) is the cost per token.
Run:  .venv/bin/python bench/web_cpu.py [--requests 40] [--new-tokens 64]
      [--baseline ../other-checkout]   (both stacks, taking turns: a fair before/after)
The last line printed is JSON. CPU time comes in 10 ms ticks: use 100+ requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
from pathlib import Path

from _common import ROOT, cpu_ms, machine  # (also puts the project on sys.path)
from http_overhead import Stack, one_stream


async def plain(port: int, key: str, body: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: "
        + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    data = await reader.read()
    if b" 200 " not in data.split(b"\r\n", 1)[0]:
        raise RuntimeError(data[:300])
    writer.close()


Stacks = dict[str, tuple[Stack, str]]  # name -> (stack, API key)


def measure(stacks: Stacks, n: int, max_tokens: int, stream: bool) -> dict[str, dict]:
    """Mean CPU per request of each stack; the stacks take turns, request by request, so
    that what else the machine does weighs on each alike."""
    per: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in stacks}
    for _ in range(n):
        for name, (stack, key) in stacks.items():
            body = json.dumps({
                "model": stack.model, "prompt": "The history of bread",
                "max_tokens": max_tokens, "stream": stream, "temperature": 0,
                "ignore_eos": True, "cache_prompt": False,
            }).encode()
            web, daemon = stack.procs[1].pid, stack.procs[0].pid
            w0, d0 = cpu_ms(web), cpu_ms(daemon)
            if stream:
                asyncio.run(one_stream(stack.port, key, body))
            else:
                asyncio.run(plain(stack.port, key, body))
            per[name][0].append(cpu_ms(web) - w0)
            per[name][1].append(cpu_ms(daemon) - d0)
    return {name: {"web_ms": round(statistics.mean(w), 2),
                   "daemon_ms": round(statistics.mean(d), 2)} for name, (w, d) in per.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout (e.g. a git worktree of the commit before a "
                             "change): its stack runs too, taking turns with this one's")
    args = parser.parse_args()
    roots = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    stacks: Stacks = {}
    try:
        for name, root in roots.items():
            stack = Stack(args.redis_url, 4, os.cpu_count(), f"bench-{secrets.token_hex(3)}",
                          root=root)
            stacks[name] = (stack, stack.open())
        measure(stacks, 5, 1, True)  # warm up imports, connections, caches
        by_row = {
            "short_json": measure(stacks, args.requests, 1, False),
            "short_sse": measure(stacks, args.requests, 1, True),
            "stream_sse": measure(stacks, max(args.requests // 4, 5), args.new_tokens, True),
        }
    finally:
        for stack, _key in stacks.values():
            stack.close()
    print(f"machine: {machine()}")
    report = {"bench": "web_cpu", "machine": machine(), "requests": args.requests,
              "new_tokens": args.new_tokens}
    for name, root in roots.items():
        rows = {row: results[name] for row, results in by_row.items()}
        per_token = {
            side: round((rows["stream_sse"][side] - rows["short_sse"][side])
                        / (args.new_tokens - 1), 3)
            for side in ("web_ms", "daemon_ms")
        }
        print(f"{name}: {root}")
        print(f"{'':12} {'web ms':>8} {'daemon ms':>10}")
        for row, values in rows.items():
            print(f"{row:12} {values['web_ms']:>8.2f} {values['daemon_ms']:>10.2f}")
        print(f"{'per token':12} {per_token['web_ms']:>8.3f} {per_token['daemon_ms']:>10.3f}")
        if name == "this":
            report.update(rows=rows, per_token=per_token)
        else:
            report[name] = {"root": str(root), "rows": rows, "per_token": per_token}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
