"""TTFT and cached-token ratio of interleaved chat conversations, with and without prefix caching.

The scenario: 8 interleaved conversations x 4 turns on 4 slots, one tenant, a shared system
prompt of ~300 tokens, 16 new tokens per turn (greedy, ignore_eos). Requests arrive two at a
time: conversations 0 and 1 send a turn together, then (once both are answered) 2 and 3, ...
6 and 7, then 0 and 1 again with their next turn. So every slot is reused by other
conversations between two turns of the same one. Three modes, each on a fresh scheduler
over the same model:

- off:      no prefix cache at all (cache_prompt false);
- per_slot: a slot reuses its own cached prefix only (no cross-slot copy, no RAM tier, no sessions);
- full:     per-slot + cross-slot adoption + RAM prompt cache + session affinity.

Run:  .venv/bin/python bench/prefix_cache.py   (--quick: 4 conversations x 2 turns, a smoke run)
The last line printed is JSON: {"bench": "prefix_cache", "modes": {"off": {...}, ...}}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator

from _common import command, machine, model_path

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
from wire.sampling import SamplingParams

SYSTEM = (
    "You are Harbor, the customer assistant of Northwind Outfitters, a shop that sells outdoor "
    "clothing, tents, sleeping bags, stoves and climbing gear online and in twelve stores. "
    "Answer in a friendly, plain and concise way, in the customer's language. Never invent "
    "prices, stock levels or delivery dates: when you do not know, say so and offer to connect "
    "the customer with a human colleague. Orders ship within two working days; standard "
    "delivery takes three to five working days and is free above fifty euros. Returns are "
    "accepted within thirty days if the item is unused and in its original packaging; the "
    "customer prints a return label from their account page. Tents and sleeping bags carry a "
    "two-year warranty; stoves one year; climbing hardware is never taken back once used, for "
    "safety reasons. Gift cards never expire and cannot be exchanged for cash. Loyalty members "
    "collect one point per euro and get ten euros off for every five hundred points. Do not "
    "discuss competitors. Do not give medical, legal or financial advice. If a customer is "
    "upset, acknowledge it first, then solve the problem. Keep every answer under one hundred "
    "words unless the customer asks for detail. Use metric units. If you recommend a product, "
    "name one that fits the customer's stated use and budget, and say why in one sentence. "
    "Store opening hours are nine to seven on weekdays and ten to six on Saturdays; stores are "
    "closed on Sundays and public holidays. Repairs of zips, seams and tent poles are done in "
    "the Lyon workshop and take about two weeks."
)
TOPICS = [
    "a two-person tent",
    "a winter sleeping bag",
    "a camping stove",
    "climbing shoes",
    "a rain jacket",
    "hiking boots",
    "a gift card",
    "a repair of my tent pole",
]
QUESTIONS = [
    "Hello! I have a question about {topic}.",
    "Which one would you recommend for a weekend trip in spring?",
    "How long would delivery take, and can I return it if it does not fit?",
    "Thanks. Is there anything else I should know before I order?",
]

MODES = {  # name: (scheduler config, send a session per conversation)
    "off": (SchedulerConfig(cache_prompt=False, cross_slot=False, ram_cache_bytes=0), False),
    "per_slot": (SchedulerConfig(cache_prompt=True, cross_slot=False, ram_cache_bytes=0), False),
    "full": (SchedulerConfig(cache_prompt=True, cross_slot=True, ram_cache_bytes=256 << 20), True),
}


def scenario(conversations: int, turns: int) -> Iterator[list[tuple[int, str]]]:
    """The arrival order: per turn, conversations two at a time -> [(conversation, question)]."""
    for turn in range(turns):
        for first in range(0, conversations, 2):
            yield [
                (i, QUESTIONS[turn % len(QUESTIONS)].format(topic=TOPICS[i % len(TOPICS)]))
                for i in range(first, min(first + 2, conversations))
            ]


def summarize(results: list[dict]) -> dict:
    """TTFT median and p90, cached-token ratio of requests with ttft_ms/prompt/cached tokens."""
    ttft = sorted(r["ttft_ms"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r["cached_tokens"] for r in results)
    return {
        "requests": len(results),
        "ttft_ms_median": round(statistics.median(ttft), 1),
        "ttft_ms_p90": round(statistics.quantiles(ttft, n=10, method="inclusive")[8], 1),
        "cached_ratio": round(cached / prompt, 3) if prompt else 0.0,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
    }


def run_mode(engine: LlamaEngine, mode: str, args: argparse.Namespace) -> dict:
    config, sessions = MODES[mode]
    core = InferenceCore(engine, config)
    core.start()
    params = SamplingParams(max_tokens=2)
    core.submit(prompt="Warm-up.", params=params, cache_prompt=False).result(timeout=120)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    results: list[dict] = []
    t0 = time.perf_counter()
    for pair in scenario(args.conversations, args.turns):
        handles = {}
        for i, question in pair:
            chats[i].append({"role": "user", "content": question})
            handles[i] = core.submit(
                messages=chats[i],
                params=params,
                cache_scope="tenant-1",
                session=f"conv-{i}" if sessions else None,
            )
        for i, handle in handles.items():
            done = handle.result(timeout=600)
            stats = done.finished.stats
            results.append(
                {
                    "ttft_ms": stats.ttft_ms,
                    "prompt_tokens": stats.prompt_tokens,
                    "cached_tokens": stats.cached_tokens,
                }
            )
            chats[i].append({"role": "assistant", "content": done.text})
    wall_s = time.perf_counter() - t0
    counters = dict(core.scheduler.counters)
    core.stop(grace_s=0)
    return {
        **summarize(results),
        "wall_s": round(wall_s, 2),
        "ram_saves": counters.get("ram_save", 0),
        "ram_restores": counters.get("ram_restore", 0),
        "cross_slot_hit_tokens": counters.get("cache_hit_tokens_cross_slot", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--quick", action="store_true", help="4 conversations x 2 turns")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns = 4, 2
    logging.basicConfig(level=logging.WARNING)
    engine = LlamaEngine(
        EngineConfig(
            model_path=model_path(),
            n_ctx=8192,
            n_batch=2048,
            n_seq_max=args.slots,
            n_threads=args.threads,
        )
    )
    system_tokens = len(engine.tokenize(SYSTEM, add_special=False))
    print(f"machine: {machine()}")
    print(f"command: {command()}")
    print(
        f"model: {engine.model_path}  threads={args.threads} slots={args.slots} "
        f"system prompt={system_tokens} tokens  {args.conversations} conversations x "
        f"{args.turns} turns, {args.new_tokens} new tokens, two at a time"
    )
    modes = {}
    print(f"{'mode':>9} {'ttft p50 ms':>12} {'ttft p90 ms':>12} {'cached':>7} {'wall s':>7}")
    for mode in args.modes:
        row = modes[mode] = run_mode(engine, mode, args)
        print(
            f"{mode:>9} {row['ttft_ms_median']:>12.1f} {row['ttft_ms_p90']:>12.1f} "
            f"{row['cached_ratio']:>7.3f} {row['wall_s']:>7.2f}",
            flush=True,
        )
    engine.close()
    print(
        json.dumps(
            {
                "bench": "prefix_cache",
                "machine": machine(),
                "conversations": args.conversations,
                "turns": args.turns,
                "slots": args.slots,
                "system_tokens": system_tokens,
                "new_tokens": args.new_tokens,
                "modes": modes,
            }
        )
    )


if __name__ == "__main__":
    main()
