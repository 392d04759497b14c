"""The same prefill on builds of the same llama.cpp: llama-server static (the peer as
bench/llama_server_build.py builds it), llama-server with shared libraries (position-
independent code, as the llama-cpp-python wheel builds them), optionally a shared build with
more compiler flags (``--cflags``), and our engine on the wheel's libraries and on that
variant's.

The served conc-1 gap is mostly a prefill gap (bench/ttft_inside.py), and our engine alone
(bench/kv_span.py, an empty KV) is slower than llama-server's own ``prompt_ms``; this
separates the build from the rest. Each round, taking turns in a rotating order: 10
distinct ~157-token prompts (``ttft_split.essay``) to each llama-server (``prompt_ms`` of
each, sequential, max_tokens 8), and the same prompts' prefill on ``LlamaEngine`` (the
daemon's engine: unified KV, n_ctx 8192, 2 threads, an empty KV each time), each engine in
a worker process of its own (``LLAMA_CPP_LIB_PATH`` picks its libraries; the worker prints
which libggml-cpu it mapped). Per side the median; per pair of sides the median of the
per-round ratios.
``--served-variant NAME=VALUE``: a second such stack whose daemon gets that environment (the
probe's experiments: ``PROBE_PIN=1``, ``PROBE_NO_ABORT=1``).
``--served``: also our stack as ``make run`` starts it, the same prompts streamed through it,
its daemon's decode of each prompt timed by the gap probe (bench/ttft_gap.py's): the same
engine served against in a bare process (the served side's KV also holds its idle slots'
prefixes, as the peer's does; the bare engine's is empty).
Run:  .venv/bin/python bench/peer_build_ab.py [--rounds 6] [--no-shared] [--served]
          [--cflags "-fno-semantic-interposition -fno-plt"]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import openai
import ttft_split
from _common import machine, model_path
from http_overhead import ROOT, Stack
from llama_server_build import build
from ttft_inside import PER_ROUND, peer_round
from vs_llama_server import LlamaServer

PROBES = Path(__file__).resolve().parent / "phase_probe"


def worker() -> None:
    """One engine, in this process: a salt per line on stdin, its prefill times (ms, JSON)
    per line on stdout. The first line out names the libggml-cpu this process mapped."""
    from scheduler_daemon.engine import EngineConfig, LlamaEngine
    from scheduler_daemon.engine_api import BatchRow

    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=5, n_threads=2))
    maps = Path("/proc/self/maps").read_text().split()
    print(json.dumps(sorted({w for w in maps if "libggml-cpu" in w})), flush=True)
    for line in sys.stdin:
        times = []
        for i in range(PER_ROUND):
            tokens = engine.tokenize(ttft_split.essay(f"{line.strip()}-{i}"))
            engine.kv_remove(0)
            t0 = time.perf_counter()
            if engine.decode([BatchRow(0, tokens, 0, True)]) != 0:
                raise RuntimeError("decode failed")
            times.append((time.perf_counter() - t0) * 1000)
            time.sleep(0.3)  # as the served rounds wait between requests
        print(json.dumps(times), flush=True)
    engine.close()


class EngineWorker:
    """``worker()`` in a process of its own, on the libraries of ``lib_dir`` (None: the
    wheel's)."""

    def __init__(self, lib_dir: Path | None) -> None:
        env = dict(os.environ)
        if lib_dir is not None:
            env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
            env["LD_LIBRARY_PATH"] = str(lib_dir)
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.libs = json.loads(self.proc.stdout.readline())

    def round(self, salt: str) -> list[float]:
        self.proc.stdin.write(salt + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Served:
    """Our stack (``make run``'s settings) with the gap probe: per round the daemon's
    decode wall of each prompt, streamed through daphne like the peer's."""

    def __init__(self, redis_url: str, env: dict[str, str] | None = None) -> None:
        self.gaps = Path(tempfile.mkdtemp(prefix="peer-build-ab-")) / "gap.jsonl"
        self.stack = Stack(redis_url, 4, 2, ttft_split.MODEL, root=ROOT, defaults=True,
                           supervise=True)
        self.stack.daemon_env = {"PYTHONPATH": str(PROBES), "PROBE_GAP_FILE": str(self.gaps),
                                 **(env or {})}
        self.key = self.stack.open()

    def round(self, salt: str) -> list[float]:
        rids = asyncio.run(self._requests(salt))
        decodes = {}
        for line in self.gaps.read_text().splitlines():
            record = json.loads(line)
            start, end = record["decode"]
            decodes[record["rid"]] = (end - start) * 1000
        return [decodes[rid] for rid in rids if rid in decodes]

    async def _requests(self, salt: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.stack.port}/v1",
                                    api_key=self.key, max_retries=0)
        rids = []
        try:
            for i in range(PER_ROUND):
                stream = await client.completions.create(
                    model=ttft_split.MODEL, prompt=ttft_split.essay(f"{salt}-{i}"),
                    max_tokens=8, temperature=0, stream=True)
                rid = None
                async for chunk in stream:
                    rid = chunk.id.removeprefix("cmpl-")
                if rid is not None:  # a stream with no chunk has no decode to read
                    rids.append(rid)
                await asyncio.sleep(0.3)  # as the other sides wait between requests
        finally:
            await client.close()
        return rids

    def stop(self) -> None:
        self.stack.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--cflags", default="",
                        help="a shared build with these compiler flags as well ('tuned')")
    parser.add_argument("--no-shared", action="store_true",
                        help="leave out the shared build with llama.cpp's own flags")
    parser.add_argument("--served", action="store_true",
                        help="also our stack, its daemon's decode of the same prompts")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--served-variant", action="append", default=[], metavar="NAME=VALUE",
                        help="with --served: a second stack ('served-variant', Redis database "
                             "13) whose daemon gets this environment (a probe's experiment, "
                             "e.g. PROBE_PIN=1 or PROBE_NO_ABORT=1)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    servers = {"static": LlamaServer(build(log=print), 2)}
    if not args.no_shared:
        servers["shared"] = LlamaServer(build(log=print, shared=True), 2)
    tuned_dir = None
    if args.cflags:
        tuned = build(log=print, shared=True, cflags=args.cflags)
        servers["tuned"], tuned_dir = LlamaServer(tuned, 2), tuned.parent
    engines = {"engine": EngineWorker(None)}
    if tuned_dir is not None:
        engines["engine-tuned"] = EngineWorker(tuned_dir)
    if args.served:
        engines["served"] = Served(args.redis_url)
        if args.served_variant:
            engines["served-variant"] = Served(
                "redis://127.0.0.1:6379/13",
                dict(item.split("=", 1) for item in args.served_variant))
            print(f"served-variant: {' '.join(args.served_variant)}")
    per: dict[str, list[float]] = {name: [] for name in [*servers, *engines]}
    rounds: list[dict[str, float]] = []
    try:
        sides = {name: server.start() for name, server in servers.items()}
        print(f"machine: {machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"llama-server: {' '.join(servers['static'].argv[1:])}")
        if args.cflags:
            print(f"tuned: shared libraries built with {args.cflags}")
        for name, eng in engines.items():
            if isinstance(eng, EngineWorker):
                print(f"{name} maps {', '.join(eng.libs)}")
        for name in sides:
            asyncio.run(peer_round(sides[name].url, "warm"))
        for eng in engines.values():
            eng.round("warm")
        names = list(per)
        for r in range(args.rounds):
            row = {}
            for name in names[r % len(names):] + names[:r % len(names)]:
                if name in engines:
                    got = engines[name].round(f"r{r}")
                else:
                    got = [p for _, p in asyncio.run(peer_round(sides[name].url, f"r{r}"))]
                per[name] += got
                row[name] = statistics.median(got)
            rounds.append({name: row[name] for name in names})
            print(f"round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in rounds[-1].items())
                  + " (prefill ms, p50)", flush=True)
    finally:
        for server in servers.values():
            server.stop()
        for eng in engines.values():
            eng.stop()

    def ratio(a: str, b: str) -> dict[str, float]:
        values = [row[a] / row[b] for row in rounds]
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    summary = {f"{k}_p50_ms": round(statistics.median(v), 1) for k, v in per.items()}
    pairs = [f"{a}/{b}" for b, a in itertools.combinations(per, 2)]
    summary.update({pair: ratio(*pair.split("/")) for pair in pairs})
    print("prefill p50: " + ", ".join(f"{k.removesuffix('_p50_ms')} {v} ms"
                                      for k, v in summary.items() if k.endswith("_p50_ms")))
    for pair in pairs:
        d = summary[pair]
        print(f"{pair}: {d['median']} [{d['min']}, {d['max']}] (median of {len(rounds)} rounds)")
    print(json.dumps({"bench": "peer_build_ab", "machine": machine(), "rounds": len(rounds),
                      "cflags": args.cflags, "served": args.served,
                      "served_variant": args.served_variant, **summary}))


if __name__ == "__main__":
    main()
