"""The longest loop turn legitimate work makes: what TICK_DEADLINE_S must stay far above.

The supervisor kills a daemon whose loop has not completed a turn (a tick, an embeddings
batch, an idle wait) within TICK_DEADLINE_S (docs/daemon.md). This runs the in-process core
with the served defaults (config/settings.py: N_CTX, N_BATCH, CHUNK_SIZE, N_PARALLEL, the
RAM tier) on each model and measures the longest turn (``InferenceCore.longest_turn_s``)
under the heaviest legitimate workloads, each phase alone:

- ``prefill``: N_PARALLEL prompts of one tenant's largest share at once (full N_BATCH ticks
  of prefill at ever deeper positions), 16 tokens each;
- ``embeddings``: a 7 x 2,048-token embeddings job while 2 streams generate;
- ``grammar``: N_PARALLEL JSON-schema requests at once (a nested schema with enums);
- ``all``: the three together.

Run: .venv/bin/python bench/tick_deadline.py [--models smollm2-135m-instruct,gemma-3-270m]
The last line printed is JSON: the longest turn per model and phase, in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
os.environ.setdefault("SECRET_KEY", "bench-" + "x" * 50)

import django  # noqa: E402

django.setup()

from _common import machine  # noqa: E402
from django.conf import settings  # noqa: E402

from config.models import default_path  # noqa: E402
from scheduler_daemon.core import InferenceCore  # noqa: E402
from wire.sampling import SamplingParams  # noqa: E402

SCHEMA = json.dumps({
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["river", "bread", "train", "city", "song", "tree"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "size": {"type": "object", "properties": {"n": {"type": "integer"},
                                                  "unit": {"enum": ["m", "km", "kg"]}}},
    },
    "required": ["name", "kind"],
})


def text_tokens(core: InferenceCore, n: int, seed: int) -> list[int]:
    text = f"Document {seed}: notes on rivers, bread and trains, page {seed}. " * (n // 8)
    return core.engine.tokenize(text)[:n]


def generate(core: InferenceCore, prompts: list[list[int]], params: SamplingParams) -> None:
    handles = [core.submit(prompt=p, params=params, cache_scope=f"t{i}")
               for i, p in enumerate(prompts)]
    for handle in handles:
        finished = handle.result(timeout=600).finished
        if finished.error is not None:
            raise RuntimeError(f"a request failed: {finished.error}")


def embed(core: InferenceCore, inputs: list[list[int]]) -> None:
    done = threading.Event()
    failed: list[BaseException] = []

    def end(_vectors, error) -> None:
        if error is not None:
            failed.append(error)
        done.set()

    core.submit_embeddings(f"bench-{time.monotonic_ns()}", inputs, end, scope="e")
    done.wait(600)
    if failed:
        raise RuntimeError(f"the embeddings job failed: {failed[0]!r}")


def phases(core: InferenceCore) -> dict:
    share = core.scheduler.max_request_tokens - 32
    long_prompts = [text_tokens(core, share, i) for i in range(settings.N_PARALLEL)]
    short = [text_tokens(core, 40, 100 + i) for i in range(2)]
    schema = [core.engine.tokenize(f"Describe thing {i} as JSON:") for i in range(
        settings.N_PARALLEL)]
    inputs = [text_tokens(core, 2048, 200 + i) for i in range(7)]
    return {
        "prefill": [lambda: generate(core, long_prompts, SamplingParams(max_tokens=16))],
        "embeddings": [lambda: embed(core, inputs),
                       lambda: generate(core, short, SamplingParams(max_tokens=200,
                                                                    ignore_eos=True))],
        "grammar": [lambda: generate(core, schema, SamplingParams(max_tokens=64,
                                                                  json_schema=SCHEMA))],
    }


def measure(core: InferenceCore, work: list) -> float:
    core.longest_turn_s = 0.0
    threads = [threading.Thread(target=w) for w in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return round(core.longest_turn_s, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(settings.MODELS))
    parser.add_argument("--phases", default="prefill,embeddings,grammar,all")
    args = parser.parse_args()
    result: dict[str, dict[str, float]] = {}
    for model in args.models.split(","):
        core = InferenceCore.from_settings(model_path=default_path(model))
        core.start()
        try:
            work = phases(core)
            warm = [text_tokens(core, 64, 999)]
            measure(core, [partial(generate, core, warm, SamplingParams(max_tokens=4))])
            chosen = args.phases.split(",")
            result[model] = {name: measure(core, w) for name, w in work.items() if name in chosen}
            if "all" in chosen:
                result[model]["all"] = measure(core, [w for ws in phases(core).values()
                                                      for w in ws])
            print(model, result[model], flush=True)
        finally:
            core.stop(grace_s=0)
            core.engine.close()
    print(json.dumps({"machine": machine(), "n_ctx": settings.N_CTX, "n_batch": settings.N_BATCH,
                      "n_parallel": settings.N_PARALLEL, "longest_turn_s": result}))


if __name__ == "__main__":
    main()
