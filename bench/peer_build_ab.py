"""The same prefill on three builds of the same llama.cpp: llama-server static (the peer as
bench/llama_server_build.py builds it), llama-server with shared libraries (position-
independent code, as the llama-cpp-python wheel builds them) and our engine in process.

The served conc-1 gap is mostly a prefill gap (bench/ttft_inside.py), and our engine alone
(bench/kv_span.py, an empty KV) is slower than llama-server's own ``prompt_ms``; this
separates the build from the rest. Each round, taking turns in a rotating order: 10
distinct ~157-token prompts (``ttft_split.essay``) to each llama-server (``prompt_ms`` of
each, sequential, max_tokens 8), and the same prompts' prefill on ``LlamaEngine`` (the
daemon's engine: unified KV, n_ctx 8192, 2 threads, an empty KV each time). Per side the
median; per pair of sides the median of the per-round ratios.
Run:  .venv/bin/python bench/peer_build_ab.py [--rounds 6]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import ttft_split
from _common import machine, model_path
from llama_server_build import build
from ttft_inside import PER_ROUND, peer_round
from vs_llama_server import LlamaServer

from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.engine_api import BatchRow


def engine_round(engine: LlamaEngine, salt: str) -> list[float]:
    """Each prompt's prefill (ms) into an empty KV, in process."""
    times = []
    for i in range(PER_ROUND):
        tokens = engine.tokenize(ttft_split.essay(f"{salt}-{i}"))
        engine.kv_remove(0)
        t0 = time.perf_counter()
        if engine.decode([BatchRow(0, tokens, 0, True)]) != 0:
            raise RuntimeError("decode failed")
        times.append((time.perf_counter() - t0) * 1000)
        time.sleep(0.3)  # as the served rounds wait between requests
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    static_bin, shared_bin = build(log=lambda line: None), build(log=print, shared=True)
    static = LlamaServer(static_bin, 2)
    shared = LlamaServer(shared_bin, 2)
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=5, n_threads=2))
    per: dict[str, list[float]] = {"static": [], "shared": [], "engine": []}
    rounds: list[dict[str, float]] = []
    try:
        sides = {"static": static.start(), "shared": shared.start()}
        print(f"machine: {machine()}")
        print(f"command: {' '.join(sys.argv)}")
        print(f"llama-server: {' '.join(static.argv[1:])}")
        for name in ("static", "shared"):
            asyncio.run(peer_round(sides[name].url, "warm"))
        engine_round(engine, "warm")
        names = list(per)
        for r in range(args.rounds):
            row = {}
            for name in names[r % 3:] + names[:r % 3]:
                if name == "engine":
                    got = engine_round(engine, f"r{r}")
                else:
                    got = [p for _, p in asyncio.run(peer_round(sides[name].url, f"r{r}"))]
                per[name] += got
                row[name] = statistics.median(got)
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
                  + " (prefill ms, p50)", flush=True)
    finally:
        static.stop()
        shared.stop()
        engine.close()

    def ratio(a: str, b: str) -> dict[str, float]:
        values = [row[a] / row[b] for row in rounds]
        return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
                "max": round(max(values), 3)}

    summary = {f"{k}_p50_ms": round(statistics.median(v), 1) for k, v in per.items()}
    summary.update({"shared/static": ratio("shared", "static"),
                    "engine/static": ratio("engine", "static"),
                    "engine/shared": ratio("engine", "shared")})
    print("prefill p50: " + ", ".join(f"{k.removesuffix('_p50_ms')} {v} ms"
                                      for k, v in summary.items() if k.endswith("_p50_ms")))
    for pair in ("shared/static", "engine/static", "engine/shared"):
        d = summary[pair]
        print(f"{pair}: {d['median']} [{d['min']}, {d['max']}] (median of {len(rounds)} rounds)")
    print(json.dumps({"bench": "peer_build_ab", "machine": machine(), "rounds": len(rounds),
                      **summary}))


if __name__ == "__main__":
    main()
