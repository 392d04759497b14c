"""What idle slots' kept prefixes cost a fresh prompt's prefill, in process.

One ~157-token prefill into the last of five sequences, with the other four empty
(``empty``: the KV's attention span, llama.cpp's ``n_kv``, is one 256-cell pad) or each
holding a ~165-token prompt (``held``: as our idle slots keep their prefixes for the prefix
cache; the span grows to 1024 cells), taking turns, on one engine (``LlamaEngine``, the
daemon's: unified KV, n_ctx 8192, 2 threads). llama-server saves idle slots to its RAM
prompt cache and clears them when a new task starts (its ``cache_idle_slots`` with a
unified KV, the vendored ``tools/server/server-context.cpp``), so its prefill runs over the
small span. Prints each mode's p50 and the paired difference.
Run:  .venv/bin/python bench/kv_span.py [--reps 16]
The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import machine, model_path

from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.engine_api import BatchRow


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=16)
    args = parser.parse_args()
    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=8192, n_batch=2048,
                                      n_seq_max=5, n_threads=2))

    def prompt(i: int) -> list[int]:
        return engine.tokenize(f"Essay {i} {time.time():.0f} about trains. " + "Write a long "
                               "and detailed essay about this subject, its history, its "
                               "people and what it means to us today. " * 6)

    def prefill(seq: int, tokens: list[int]) -> float:
        t0 = time.perf_counter()
        if engine.decode([BatchRow(seq, tokens, 0, True)]) != 0:
            raise RuntimeError("decode failed")
        return (time.perf_counter() - t0) * 1000

    times: dict[str, list[float]] = {"empty": [], "held": []}
    for rep in range(args.reps):
        for mode in (("empty", "held") if rep % 2 == 0 else ("held", "empty")):
            for seq in range(5):
                engine.kv_remove(seq)
            if mode == "held":
                for seq in range(4):
                    prefill(seq, prompt(1000 + seq))
            times[mode].append(prefill(4, prompt(rep)))
    n_tokens = len(prompt(0))
    engine.close()
    pairs = [h - e for e, h in zip(times["empty"], times["held"], strict=True)]
    ratio = statistics.median(h / e for e, h in zip(times["empty"], times["held"], strict=True))
    summary = {"tokens": n_tokens,
               "empty_p50_ms": round(statistics.median(times["empty"]), 1),
               "held_p50_ms": round(statistics.median(times["held"]), 1),
               "paired_ms": round(statistics.median(pairs), 1), "ratio": round(ratio, 3)}
    print(f"machine: {machine()}")
    print("prefill of {tokens} tokens: empty {empty_p50_ms} ms, held {held_p50_ms} ms, paired "
          "{paired_ms:+} ms (ratio {ratio})".format(**summary))
    print(json.dumps({"bench": "kv_span", "machine": machine(), "reps": args.reps, **summary}))


if __name__ == "__main__":
    main()
