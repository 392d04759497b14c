"""Our served stack against llama-server, side by side: the same OpenAI client, alternating rounds.

Both servers run at once on this machine, over the same Gemma file, and each round runs
every workload on one, then on the other (A B, then B A, ...), so that drift hits both
alike; the result per workload is the median over rounds of the per-round ratio, with its
spread (min-max). Workloads, each through the official ``openai`` SDK (AsyncOpenAI,
streamed, as a user would call either server):

- ``tput_cN``: N concurrent streamed completions (N = 1, 4, 8) of distinct ~90-word prompts
  (fresh every round, so no prefix cache helps either side), 128 new tokens, greedy,
  ``ignore_eos``; aggregate generated tokens / wall time of the batch. At N = 1 also the
  TTFT p50 (request sent -> first chunk with text) and the gap between two chunks with
  text a client receives (p50, the streaming interval as the client sees it).
- ``ttft``: TTFT alone, 10 sequential streamed requests of distinct prompts (4 new tokens)
  per side and round; p50, and the per-round difference of the two p50s ("TTFT added").
- ``prefix``: the seed prefix scenario (bench/prefix_cache.py): 8 conversations x 4 turns,
  two at a time, the ~300-token shared system prompt (salted per round), 16 new tokens,
  greedy; TTFT p50/p90 and the cached share of prompt tokens (ours: usage's
  ``cached_tokens``; llama-server: its ``timings.cache_n``).

llama-server: built once by bench/llama_server_build.py (the llama.cpp vendored in the
pinned llama-cpp-python, this CPU's flags), run as ``-c 8192 -np 4 -kvu --swa-full -t
<threads>``. Ours: started as ``make run`` starts it (``run_scheduler --supervise`` and
daphne, the service's defaults), on a temporary SQLite database and Redis database 14.
``--baseline ROOT``: a third side, "before", our stack from another checkout (the code
before a change), taking its turn in every round too; the table adds its medians and the
median ratio ours / before.
Run:  .venv/bin/python bench/vs_llama_server.py [--rounds 3] [--workloads tput_c1 ...]
      [--env NAME=VALUE ...]  (settings for our stack, e.g. STREAM_INTERVAL_MS=50)
      [--baseline ROOT]
      [--parallel N] [--ctx N] [--gpu-layers N]  (both sides: slots, context, layers on
      the GPU; any tput_cN names a concurrency: bench/gpu_check.sh runs tput_c64)
The last line printed is JSON: {"bench": "vs_llama_server", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
from _common import ROOT, Stack, free_port, machine, model_path
from llama_server_build import build
from prefix_cache import SYSTEM, scenario

TOPICS = ["rivers", "mountains", "trains", "bread", "stars", "gardens", "cities", "music"]
NEW_TOKENS = 128
PREFIX_NEW_TOKENS = 16
TTFT_REQUESTS = 10  # per side and round, one at a time


def prompt(salt: str, i: int) -> str:
    """A distinct prompt of ~90 words."""
    topic = TOPICS[i % len(TOPICS)]
    return (f"Essay {salt}-{i} about {topic}. " + "Write a long and detailed essay about this "
            "subject, its history, its people and what it means to us today. " * 6).strip()


class Side:
    """One server under test: its name, base URL, model name and key."""

    def __init__(self, name: str, url: str, model: str, key: str) -> None:
        self.name, self.url, self.model, self.key = name, url, model, key

    def openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0,
                                  timeout=600)


def _extra(chunk: Any, name: str) -> Any:
    return (chunk.model_extra or {}).get(name)


def _tokens(usage: Any, timings: dict | None) -> tuple[int, int, int]:
    """(completion, prompt, cached) tokens from the final chunk's usage or llama-server's
    timings; a stream with neither is an error (never a silent zero)."""
    if timings:  # llama-server: prompt_n counts what it computed, cache_n what it reused
        return (int(timings["predicted_n"]), int(timings["prompt_n"]) + int(timings["cache_n"]),
                int(timings["cache_n"]))
    if usage is not None:
        details = usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        return usage.completion_tokens, usage.prompt_tokens, cached
    raise RuntimeError("a stream ended without usage or timings")


async def stream(client: openai.AsyncOpenAI, side: Side, chat: list | None, text: str | None,
                 max_tokens: int, user: str | None = None) -> dict:
    """One streamed request: TTFT, the gaps between text chunks, its text and token counts."""
    common: dict[str, Any] = {
        "model": side.model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True, "cache_prompt": True},
    }
    if user:
        common["user"] = user
    t0 = time.perf_counter()
    if chat is not None:
        response = await client.chat.completions.create(messages=chat, **common)
    else:
        response = await client.completions.create(prompt=text, **common)
    ttft, last, gaps, parts = None, None, [], []
    usage, timings = None, None
    async for chunk in response:
        usage = chunk.usage or usage
        timings = _extra(chunk, "timings") or timings
        for choice in chunk.choices or []:
            piece = choice.delta.content if chat is not None else choice.text
            if piece:
                now = time.perf_counter()
                if ttft is None:
                    ttft = now - t0
                else:
                    gaps.append(now - last)
                last = now
                parts.append(piece)
    if ttft is None:
        raise RuntimeError(f"{side.name}: a stream ended without text")
    completion, prompt_tokens, cached = _tokens(usage, timings)
    return {"ttft_s": ttft, "gaps_s": gaps, "text": "".join(parts),
            "completion_tokens": completion, "prompt_tokens": prompt_tokens,
            "cached_tokens": cached}


async def throughput(side: Side, conc: int, salt: str, batches: int) -> dict:
    client = side.openai()
    rates, ttfts, gaps = [], [], []
    try:
        for b in range(batches):
            t0 = time.perf_counter()
            results = await asyncio.gather(*(
                stream(client, side, None, prompt(f"{salt}-{b}", i), NEW_TOKENS)
                for i in range(conc)))
            wall = time.perf_counter() - t0
            if any(r["completion_tokens"] != NEW_TOKENS for r in results):
                raise RuntimeError(f"{side.name}: a stream stopped short of {NEW_TOKENS} tokens")
            rates.append(sum(r["completion_tokens"] for r in results) / wall)
            ttfts += [r["ttft_s"] for r in results]
            gaps += [g for r in results for g in r["gaps_s"]]
    finally:
        await client.close()
    return {"tok_s": statistics.median(rates), "ttft_p50_ms": statistics.median(ttfts) * 1000,
            "gap_p50_ms": statistics.median(gaps) * 1000 if gaps else None}


async def ttft(side: Side, salt: str, requests: int = TTFT_REQUESTS) -> dict:
    """TTFT alone: sequential streamed requests of distinct prompts, 4 new tokens each."""
    client = side.openai()
    got = []
    try:
        for i in range(requests):
            try:
                got.append(await stream(client, side, None, prompt(f"{salt}-t", i), 4))
            except openai.APIConnectionError as exc:
                # llama-server (cpp-httplib) closes a kept-alive connection after a few
                # requests, racing the client's next one: that request alone is sent again,
                # its clock started afresh (the broken try is not a TTFT)
                print(f"  {side.name} ttft: request {i}: {exc.__cause__!r}; sent again",
                      flush=True)
                got.append(await stream(client, side, None, prompt(f"{salt}-t2", i), 4))
    finally:
        await client.close()
    return {"ttft_p50_ms": statistics.median(r["ttft_s"] for r in got) * 1000}


async def prefix(side: Side, salt: str) -> dict:
    client = side.openai()
    system = f"Conversation set {salt}. {SYSTEM}"
    chats = [[{"role": "system", "content": system}] for _ in range(8)]
    results = []
    try:
        for pair in scenario(8, 4):
            for i, question in pair:
                chats[i].append({"role": "user", "content": question})
            answers = await asyncio.gather(*(
                stream(client, side, list(chats[i]), None, PREFIX_NEW_TOKENS,
                       user=f"conv-{salt}-{i}") for i, _ in pair))
            for (i, _), answer in zip(pair, answers, strict=True):
                chats[i].append({"role": "assistant", "content": answer["text"]})
                results.append(answer)
    finally:
        await client.close()
    ttft = sorted(r["ttft_s"] * 1000 for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    return {"ttft_p50_ms": statistics.median(ttft),
            "ttft_p90_ms": statistics.quantiles(ttft, n=10, method="inclusive")[8],
            "cached_ratio": sum(r["cached_tokens"] for r in results) / prompt_tokens}


WORKLOADS = ["tput_c1", "tput_c4", "tput_c8", "ttft", "prefix"]


def run_workload(side: Side, name: str, salt: str) -> dict:
    """One workload on one side; run again whole (fresh prompts) if the connection broke.

    Seen once in 12 prefix runs: llama-server (cpp-httplib) closed a kept-alive connection
    as the client sent its next request ("Server disconnected without sending a response").
    """
    try:
        return _run_workload(side, name, salt)
    except openai.APIConnectionError as exc:
        print(f"  {side.name} {name}: {exc} ({exc.__cause__!r}); running it again", flush=True)
        return _run_workload(side, name, f"{salt}-again")


def _run_workload(side: Side, name: str, salt: str) -> dict:
    if name.startswith("tput_c"):
        conc = int(name[len("tput_c"):])
        return asyncio.run(throughput(side, conc, salt, batches=3 if conc == 1 else 2))
    if name == "ttft":
        return asyncio.run(ttft(side, salt))
    return asyncio.run(prefix(side, salt))


class LlamaServer:
    def __init__(self, binary: Path, threads: int, parallel: int = 4, ctx: int = 8192,
                 gpu_layers: int | None = None) -> None:
        self.port = free_port()
        self.log = Path(f"/tmp/vs-llama-server-{self.port}.log")
        self.argv = [str(binary), "-m", model_path(), "-c", str(ctx), "-np", str(parallel),
                     "-kvu", "--swa-full", "-t", str(threads), "--host", "127.0.0.1",
                     "--port", str(self.port), "--no-webui"]
        if gpu_layers is not None:
            self.argv += ["-ngl", "all" if gpu_layers < 0 else str(gpu_layers)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Side:
        # a shared build's libraries lie beside its binary (llama_server_build.py --shared)
        env = {**os.environ, "LD_LIBRARY_PATH": str(Path(self.argv[0]).parent)}
        self.proc = subprocess.Popen(self.argv, stdout=self.log.open("wb"),
                                     stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not start; see {self.log}")
            time.sleep(0.5)
        return Side("llama-server", f"http://127.0.0.1:{self.port}", "gemma", "none")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, type=_workload,
                        help=f"{' '.join(WORKLOADS)}, or tput_cN for any N")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                        help="settings for our stack (its defaults otherwise)")
    parser.add_argument("--root", type=Path, default=ROOT,
                        help="the checkout whose daphne and daemon run (another commit's)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="another checkout's stack as a third side, 'before'")
    parser.add_argument("--parallel", type=int, help="slots on both sides (default 4)")
    parser.add_argument("--ctx", type=int, help="context on both sides (default 8192)")
    parser.add_argument("--gpu-layers", type=int,
                        help="layers on the GPU, both sides (-1: all; needs CUDA builds)")
    args = parser.parse_args()
    binary = build(log=lambda line: print(line, flush=True))
    overrides = dict(item.split("=", 1) for item in args.env)
    for name, value in (("N_PARALLEL", args.parallel), ("N_CTX", args.ctx),
                        ("N_GPU_LAYERS", args.gpu_layers)):
        if value is not None:
            overrides[name] = str(value)
    peer = LlamaServer(binary, args.threads, args.parallel or 4, args.ctx or 8192,
                       args.gpu_layers)
    stacks = {"ours": Stack(args.redis_url, 4, args.threads, f"bench-{secrets.token_hex(3)}",
                            root=args.root, defaults=True, env=overrides, supervise=True)}
    if args.baseline is not None:
        stacks["before"] = Stack(args.redis_url, 4, args.threads,
                                 f"bench-{secrets.token_hex(3)}", root=args.baseline,
                                 defaults=True, env=overrides, supervise=True)
    rows: dict[str, list[dict[str, dict]]] = {w: [] for w in args.workloads}
    try:
        sides = [peer.start()] + [Side(name, f"http://127.0.0.1:{stack.port}", stack.model,
                                       stack.open()) for name, stack in stacks.items()]
        print(f"machine: {machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"llama-server: {' '.join(peer.argv[1:])}")
        print(f"ours: run_scheduler --supervise + daphne from {args.root}, defaults"
              f"{' + ' + ' '.join(args.env) if args.env else ''}")
        if args.baseline is not None:
            print(f"before: the same from {args.baseline}")
        for side in sides:  # warm each (first decode, first request's imports)
            asyncio.run(throughput(side, 1, f"warm-{secrets.token_hex(2)}", 1))
        for r in range(args.rounds):
            for name in args.workloads:
                salt = f"r{r}-{secrets.token_hex(3)}"
                order = sides[r % len(sides):] + sides[:r % len(sides)]  # each goes first in turn
                got = {side.name: run_workload(side, name, salt) for side in order}
                rows[name].append(got)
                print(f"round {r} {name}: " + " | ".join(
                    f"{side.name} {_short(got[side.name])}" for side in sides), flush=True)
    finally:
        for stack in stacks.values():
            stack.close()
        peer.stop()
    summary = summarize(rows)
    print_table(summary)
    print(json.dumps({"bench": "vs_llama_server", "machine": machine(), "rounds": args.rounds,
                      "root": str(args.root),
                      "threads": args.threads, "env": overrides, "workloads": summary}))


def _workload(name: str) -> str:
    if name in WORKLOADS or (name.startswith("tput_c") and name[6:].isdigit()
                             and int(name[6:]) > 0):
        return name
    raise argparse.ArgumentTypeError(f"{name}: not one of {', '.join(WORKLOADS)}, tput_cN")


def _short(result: dict) -> str:
    return " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in result.items())


def summarize(rows: dict[str, list[dict[str, dict]]]) -> dict:
    """Per workload and metric: each side's spread over rounds, the per-round ratio ours /
    llama-server (``ratio``) and, with a baseline, ours / before (``ratio_before``)."""
    out = {}
    for name, rounds in rows.items():
        peer = [got["llama-server"] for got in rounds]
        ours = [got["ours"] for got in rounds]
        before = [got["before"] for got in rounds if "before" in got]
        entry: dict[str, Any] = {}
        for metric in peer[0]:
            if peer[0][metric] is None or ours[0][metric] is None:
                continue
            entry[metric] = {
                "llama_server": spread([p[metric] for p in peer]),
                "ours": spread([o[metric] for o in ours]),
                "ratio": spread([o[metric] / p[metric] for p, o in zip(peer, ours, strict=True)]),
            }
            if before:
                entry[metric]["before"] = spread([b[metric] for b in before])
                entry[metric]["ratio_before"] = spread(
                    [o[metric] / b[metric] for b, o in zip(before, ours, strict=True)])
        if name == "ttft":
            entry["added_ms"] = spread([o["ttft_p50_ms"] - p["ttft_p50_ms"]
                                        for p, o in zip(peer, ours, strict=True)])
        out[name] = entry
    return out


def print_table(summary: dict) -> None:
    print(f"{'workload':>9} {'metric':>12} {'llama-server':>14} {'ours':>10} "
          f"{'ratio (ours/peer) median [min, max]':>36}")
    for name, entry in summary.items():
        for metric, cell in entry.items():
            if metric == "added_ms":
                continue
            r = cell["ratio"]
            print(f"{name:>9} {metric:>12} {cell['llama_server']['median']:>14.2f} "
                  f"{cell['ours']['median']:>10.2f} {r['median']:>14.3f} "
                  f"[{r['min']:.3f}, {r['max']:.3f}]")
            if "before" in cell:
                b = cell["ratio_before"]
                print(f"{'':>9} {'':>12} {'before':>14} {cell['before']['median']:>10.2f} "
                      f"{b['median']:>14.3f} [{b['min']:.3f}, {b['max']:.3f}] (ours/before)")
        if name == "ttft" and "added_ms" in entry:
            a = entry["added_ms"]
            print(f"{'':>9} TTFT added at conc 1: {a['median']:+.1f} ms "
                  f"[{a['min']:+.1f}, {a['max']:+.1f}] (per-round differences of the p50s)")
        if "tok_s" in entry and name == "tput_c1":
            t = entry["ttft_p50_ms"]
            print(f"{'':>9} TTFT added at conc 1: "
                  f"{t['ours']['median'] - t['llama_server']['median']:+.1f} ms (medians)")


if __name__ == "__main__":
    main()
