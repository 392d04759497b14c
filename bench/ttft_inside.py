"""A conc-1 TTFT against llama-server's, split into inside and outside, side by side.

Both sides get the same sequential streamed completions of distinct ~90-word prompts
(``ttft_split.measure``'s, max_tokens 8, greedy), taking turns each round (A B, then B A).
llama-server's own ``timings.prompt_ms`` (its prompt's decode) and our daemon's
``ttft_ms - queue_ms`` (from the request's ``done`` event: the prefill decode and the first
token's sampling) are each side's *prefill*; the client's TTFT minus the daemon's
``ttft_ms`` (ours) or minus ``prompt_ms`` (llama-server: its HTTP, tokenizing, sampling and
sending) is each side's *outside*. Per round the medians; at the end the median of the
per-round differences (ours - llama-server) of the client's TTFT, the prefill and the
outside, and our ``queue_ms``. ``--env NAME=VALUE`` sets our stack's settings (its
defaults otherwise: ``make run``'s). llama-server: ``bench/vs_llama_server.py``'s.
``--peer-shared``: llama-server built with shared libraries (as the wheel builds our
engine's llama.cpp; ~5% slower prefill than the static peer, bench/peer_build_ab.py).
Run:  .venv/bin/python bench/ttft_inside.py [--rounds 8] [--env CACHE_PROMPT=false]
      [--peer-shared]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

import openai
import ttft_split
from _common import machine
from http_overhead import Stack
from llama_server_build import build
from vs_llama_server import LlamaServer

PER_ROUND = 10


async def peer_round(url: str, salt: str) -> list[tuple[float, float]]:
    """(client TTFT, prompt_ms) per request, llama-server."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    rows = []
    try:
        for i in range(PER_ROUND):
            prompt = ttft_split.essay(f"{salt}-{i}")
            t0, first, timings = time.perf_counter(), None, None
            stream = await client.completions.create(model="gemma", prompt=prompt,
                                                     max_tokens=8, temperature=0, stream=True)
            async for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].text:
                    first = (time.perf_counter() - t0) * 1000
                timings = (chunk.model_extra or {}).get("timings") or timings
            rows.append((first, float(timings["prompt_ms"])))
            await asyncio.sleep(0.3)  # as ttft_split waits between ours
    finally:
        await client.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE")
    parser.add_argument("--peer-shared", action="store_true",
                        help="llama-server built with shared libraries, as the llama-cpp-python "
                             "wheel builds llama.cpp (bench/peer_build_ab.py)")
    args = parser.parse_args()
    peer = LlamaServer(build(log=lambda line: None, shared=args.peer_shared), args.threads)
    ours = Stack(args.redis_url, 4, args.threads, "gemma-3-270m", defaults=True,
                 env=dict(item.split("=", 1) for item in args.env), supervise=True)
    rounds = []
    try:
        side = peer.start()
        key = ours.open()
        base = f"http://127.0.0.1:{ours.port}"
        print(f"machine: {machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"llama-server{' (shared libraries)' if args.peer_shared else ''}: "
              f"{' '.join(peer.argv[1:])}")
        asyncio.run(peer_round(side.url, "warm"))
        asyncio.run(ttft_split.measure(base, key, 2, args.redis_url))
        for r in range(args.rounds):
            got: dict[str, list] = {}
            for name in (("peer", "ours") if r % 2 == 0 else ("ours", "peer")):
                if name == "peer":
                    got[name] = asyncio.run(peer_round(side.url, f"r{r}"))
                else:
                    samples = asyncio.run(ttft_split.measure(base, key, PER_ROUND,
                                                             args.redis_url))
                    got[name] = [(s.client_ms, s.daemon_ms) for s in samples
                                 if s.daemon_ms is not None]
                    got["queue"] = [s.timings["queue_ms"] for s in samples
                                    if s.timings.get("queue_ms") is not None]
            peer_rows, our_rows = got["peer"], got["ours"]
            q = statistics.median(got["queue"])
            row = {
                "peer_client": statistics.median(c for c, _ in peer_rows),
                "peer_prefill": statistics.median(p for _, p in peer_rows),
                "peer_outside": statistics.median(c - p for c, p in peer_rows),
                "ours_client": statistics.median(c for c, _ in our_rows),
                "ours_prefill": statistics.median(d for _, d in our_rows) - q,
                "ours_outside": statistics.median(c - d for c, d in our_rows),
                "ours_queue": q,
            }
            rounds.append(row)
            print(f"round {r}: llama-server client {row['peer_client']:.1f} prefill "
                  f"{row['peer_prefill']:.1f} outside {row['peer_outside']:.1f} | ours client "
                  f"{row['ours_client']:.1f} prefill {row['ours_prefill']:.1f} outside "
                  f"{row['ours_outside']:.1f} queue {q:.2f} (ms, p50)", flush=True)
    finally:
        ours.close()
        peer.stop()

    def diff(part: str) -> dict:
        values = [r[f"ours_{part}"] - r[f"peer_{part}"] for r in rounds]
        return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
                "max": round(max(values), 1)}

    summary = {part: diff(part) for part in ("client", "prefill", "outside")}
    summary["ours_queue_ms"] = round(statistics.median(r["ours_queue"] for r in rounds), 2)
    summary["peer_outside_ms"] = round(statistics.median(r["peer_outside"] for r in rounds), 1)
    summary["ours_outside_ms"] = round(statistics.median(r["ours_outside"] for r in rounds), 1)
    for part in ("client", "prefill", "outside"):
        d = summary[part]
        print(f"ours - llama-server, {part}: {d['median']:+.1f} ms [{d['min']:+.1f}, "
              f"{d['max']:+.1f}] (median of {len(rounds)} rounds)")
    print(f"outside: ours {summary['ours_outside_ms']} ms, llama-server "
          f"{summary['peer_outside_ms']} ms; our queue_ms {summary['ours_queue_ms']}")
    print(json.dumps({"bench": "ttft_inside", "machine": machine(), "env": args.env,
                      "peer_shared": args.peer_shared,
                      "rounds": len(rounds), **summary}))


if __name__ == "__main__":
    main()
