"""Tenant adapters: what serving four LoRA adapters beside the base model costs the core.

The in-process core on Gemma 3 270M (the same scheduler, engine and adapter registry a
daemon runs), 20 slots. Two loads, alternating round by round:

- ``base``: 20 streams on the base model;
- ``mixed``: the same 20 streams as 5 groups of 4: the base model and 4 tenants, each with
  its own adapter (tests/fixtures/lora_adapter.py, rank 8 on every block's attn_q, attn_v
  and ffn_up; loaded before the rounds).

Each stream sends ``--turns`` requests one after another (closed loop: the next when the
last ended, after a think time of 0 to 0.3 s, the same per stream in both loads), each a
distinct ~100-token prompt and ``--tokens`` new tokens (ignore_eos, greedy, no prefix
cache). Per round: aggregate generated tokens/s and, for ``mixed``, each group's
TTFT p50 and the adapter switches. Reported: the median of the per-round ratios
mixed / base (target >= 0.8), each group's median TTFT p50 against the fastest group's
(target <= 1.5; groups ``g0``, the base model, to ``g4``; the same five sets of streams in
the base load give the workload's own spread), and the first request to an adapter not
loaded yet: its TTFT against the same request once the adapter is loaded, with the load's
own time (copy + check + hash + ``llama_adapter_lora_init``). ``--decode-costs-only``:
where the time goes instead, one ``llama_decode``'s ms for 20 and 4 rows, with and without
an adapter, and right after a switch. Run: .venv/bin/python bench/adapters.py [--rounds 4]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import statistics
import threading
import time
from pathlib import Path

from _common import command, machine, model_path

from scheduler_daemon.core.engine_api import BatchRow
from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
from tests.fixtures.lora_adapter import write_lora
from wire.sampling import SamplingParams

STREAMS_PER_GROUP = 4
TENANTS = 4
PROMPT_TOKENS = 100
TOPICS = ["rivers", "mountains", "trains", "bread", "stars", "gardens", "cities", "music"]


def prompts(engine: LlamaEngine, n: int, salt: str) -> list[list[int]]:
    out = []
    for i in range(n):
        text = (f"Essay {salt}-{i} about {TOPICS[i % len(TOPICS)]}. " * 3
                + "Write a long, careful and detailed essay about this subject, covering its "
                "history, its present and its future, with examples from many places. " * 4)
        out.append(engine.tokenize(text)[:PROMPT_TOKENS])
    return out


def spec(path: Path, n: int) -> dict:
    return {"id": f"ad_{n:016x}", "path": str(path), "scale": 1.0,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def run(core: InferenceCore, load: list[tuple[list[list[int]], dict | None]], new_tokens: int,
        ) -> tuple[float, dict[str, float], dict]:
    """Closed-loop streams: each sends its prompts one after another (the next when the last
    has ended, after a think time). Aggregate generated tokens/s, each group's TTFT p50
    (ms), and the ticks: how many, the median decode-only tick's llama_decode ms and rows,
    the seconds inside llama_decode against the wall."""
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    done: list[tuple[object, dict | None, int]] = []
    lock = threading.Lock()

    def stream(i: int, turns: list[list[int]], adapter: dict | None) -> None:
        pause = random.Random(i)  # the same think times in both loads
        time.sleep(pause.uniform(0, 0.3))  # streams do not start, nor go on, in lockstep
        for p in turns:
            h = core.submit(prompt=p, params=params, cache_prompt=False,
                            cache_scope=str(i % 5), adapter=adapter)
            stats = h.result(timeout=900).finished.stats
            with lock:
                done.append((stats, adapter, i % 5))
            time.sleep(pause.uniform(0, 0.3))  # a client's think time

    ticks: list = []
    core.tick_listeners.append(ticks.append)
    threads = [threading.Thread(target=stream, args=(i, turns, a))
               for i, (turns, a) in enumerate(load)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    core.tick_listeners.remove(ticks.append)
    decode_only = [t for t in ticks if t.prefill_tokens == 0]
    decode = {"ticks": len(ticks), "decode_only_ticks": len(decode_only),
              "decode_ms_median": round(statistics.median(t.eval_ms for t in decode_only), 1)
              if decode_only else None,
              "rows_median": statistics.median(t.decode_tokens for t in decode_only)
              if decode_only else None,
              "eval_s": round(sum(t.eval_ms for t in ticks) / 1000, 2),
              "wall_s": round(elapsed, 2)}
    ttft: dict[str, list[float]] = {}
    for stats, _adapter, group in done:
        # by the stream's group (i % 5): the mixed load's groups, and the same five sets
        # of streams in the base load (their spread there is the workload's own)
        ttft.setdefault(f"g{group}", []).append(stats.ttft_ms)
    return (sum(s.completion_tokens for s, _, _ in done) / elapsed,
            {g: statistics.median(v) for g, v in ttft.items()}, decode)


def first_load(core: InferenceCore, path: Path, n: int, prompt: list[int]) -> dict:
    """TTFT of one request whose adapter is not loaded, then of the same once it is."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    adapter = spec(path, n)
    cold = core.submit(prompt=prompt, params=params, cache_prompt=False, adapter=adapter)
    cold_ms = cold.result(timeout=300).finished.stats.ttft_ms
    warm = core.submit(prompt=prompt, params=params, cache_prompt=False, adapter=adapter)
    warm_ms = warm.result(timeout=300).finished.stats.ttft_ms
    # ttft counts from the start of the submit, whose check, hash and load it includes
    return {"load_ms": core.adapters.summary()["load_ms"][adapter["id"]],
            "cold_ttft_ms": round(cold_ms, 1), "warm_ttft_ms": round(warm_ms, 1)}


def decode_costs(engine: LlamaEngine, path: Path, reps: int = 12) -> dict[str, float]:
    """One llama_decode's median ms (the engine alone, no scheduler): 20 rows and 4 rows on
    the base model, 4 rows under an adapter, and 4 rows right after the adapter set changed
    (llama.cpp re-reserves its compute graph then). Uses the sequences 0-19 of ``engine``."""
    handle = engine.load_adapter(str(path))
    prompt = engine.tokenize("Hello there, how are you today? " * 20)[:100]
    pos = [len(prompt)] * 20
    engine.use_adapters([])
    for seq in range(20):
        engine.kv_remove(seq, 0, -1)
        engine.decode([BatchRow(seq, prompt, 0, True)])

    def decode(seqs: range) -> float:
        rows = [BatchRow(s, [prompt[5]], pos[s], True) for s in seqs]
        t0 = time.perf_counter()
        engine.decode(rows)
        for s in seqs:
            pos[s] += 1
        return (time.perf_counter() - t0) * 1000

    times: dict[str, list[float]] = {"base_20_rows": [], "base_4_rows": [],
                                     "adapter_4_rows": [], "adapter_4_rows_after_switch": []}
    try:
        for _ in range(reps):
            engine.use_adapters([])
            decode(range(4))
            times["base_20_rows"].append(decode(range(20)))
            times["base_4_rows"].append(decode(range(4)))
            engine.use_adapters([(handle, 1.0)])
            decode(range(4))
            times["adapter_4_rows"].append(decode(range(4, 8)))
            engine.use_adapters([])
            decode(range(8, 12))
            engine.use_adapters([(handle, 1.0)])
            times["adapter_4_rows_after_switch"].append(decode(range(4, 8)))
    finally:
        engine.use_adapters([])
        engine.free_adapter(handle)
        for seq in range(20):
            engine.kv_remove(seq, 0, -1)
    return {k: round(statistics.median(v), 1) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3, help="requests per stream, in a row")
    parser.add_argument("--decode-costs-only", action="store_true",
                        help="only the llama_decode timings (no core, no rounds)")
    parser.add_argument("--folder", default="var/bench-adapters",
                        help="where the generated adapters are kept between runs")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    base_path = model_path()
    files = []
    for seed in range(TENANTS + 1):  # the last one is the cold-load probe
        path = folder / f"gemma-lora-{seed}.gguf"
        if not path.exists():
            write_lora(base_path, path, seed=seed)
        files.append(path)
    n = STREAMS_PER_GROUP * (TENANTS + 1)
    engine = LlamaEngine(EngineConfig(model_path=base_path, n_ctx=8192, n_batch=512,
                                      n_seq_max=n + 1, n_threads=os.cpu_count() or 1))
    if args.decode_costs_only:
        print(json.dumps({"decode_ms": decode_costs(engine, files[0]),
                          "machine": machine(), "command": command()}))
        return
    core = InferenceCore(engine, SchedulerConfig(chunk_size=512, max_queue=64, park_seq=True),
                         max_loaded_adapters=TENANTS + 2)
    core.start()
    try:
        adapters = [spec(files[t], t + 1) for t in range(TENANTS)]
        for a in adapters:  # loaded before the rounds (first_load measures a cold one)
            core.submit(prompt=[1, 2, 3], params=SamplingParams(max_tokens=1),
                        adapter=a, cache_prompt=False).result(timeout=300)
        rows = []
        for r in range(args.rounds):
            ps = prompts(engine, n * args.turns, f"r{r}")
            turns = [ps[i::n] for i in range(n)]  # stream i's prompts
            base_load = [(t, None) for t in turns]
            mixed_load = [(t, None if i % 5 == 0 else adapters[i % 5 - 1])
                          for i, t in enumerate(turns)]
            order = ["base", "mixed"] if r % 2 == 0 else ["mixed", "base"]
            got = {}
            for kind in order:
                switches = core.scheduler.counters["adapter_switches"]
                got[kind] = run(core, base_load if kind == "base" else mixed_load, args.tokens)
                got[kind + "_switches"] = core.scheduler.counters["adapter_switches"] - switches
            ttft, base_ttft = got["mixed"][1], got["base"][1]
            row = {"round": r, "base_tok_s": round(got["base"][0], 1),
                   "mixed_tok_s": round(got["mixed"][0], 1),
                   "ratio": round(got["mixed"][0] / got["base"][0], 3),
                   "base_ttft_p50_ms": {g: round(v, 1) for g, v in sorted(base_ttft.items())},
                   "mixed_ttft_p50_ms": {g: round(v, 1) for g, v in sorted(ttft.items())},
                   "base_ttft_spread": round(max(base_ttft.values()) / min(base_ttft.values()),
                                             3),
                   "ttft_spread": round(max(ttft.values()) / min(ttft.values()), 3),
                   "switches": got["mixed_switches"],
                   "base_ticks": got["base"][2], "mixed_ticks": got["mixed"][2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        cold = first_load(core, files[TENANTS], 99, prompts(engine, 1, "cold")[0])
        print(json.dumps({"first_load": cold}), flush=True)
    finally:
        core.stop(grace_s=0)
    groups = rows[0]["mixed_ttft_p50_ms"].keys()
    per_group = {g: statistics.median(r["mixed_ttft_p50_ms"][g] for r in rows) for g in groups}
    per_base = {g: statistics.median(r["base_ttft_p50_ms"][g] for r in rows) for g in groups}
    print(json.dumps({
        "bench": "adapters", "machine": machine(), "command": command(),
        "rounds": args.rounds, "streams": n, "new_tokens": args.tokens,
        "median_ratio_mixed_vs_base": statistics.median(r["ratio"] for r in rows),
        "median_base_tok_s": statistics.median(r["base_tok_s"] for r in rows),
        "median_mixed_tok_s": statistics.median(r["mixed_tok_s"] for r in rows),
        "median_ttft_p50_by_group_ms": per_group,
        "ttft_p50_spread": round(max(per_group.values()) / min(per_group.values()), 3),
        "base_median_ttft_p50_by_group_ms": per_base,
        "base_ttft_p50_spread": round(max(per_base.values()) / min(per_base.values()), 3),
        "median_switches_per_mixed_round": statistics.median(r["switches"] for r in rows),
        "first_load": cold,
    }))


if __name__ == "__main__":
    main()
