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

Two more modes run with the service's cache settings (RAM tier, idle slots to RAM, the park
sequence, tenant shares 0.5, the disk tier's 256-token minimum), each variant on a fresh
scheduler, the variants taking turns (A B / B A) for ``--rounds``:

- restart:  the scenario's turns 1-2, a restart (a new scheduler over the same engine, which
            empties every sequence; RAM gone), then turn 3: its TTFT p50 and cached ratio
            with the disk tier (a new ``DiskCache`` over the same folder) against none (cold);
- flood:    tenant A sends a turn of one conversation every ``--flood-per-turn`` prompts of
            tenant B, whose distinct ~``--flood-tokens`` prompts overflow small RAM and disk
            budgets: A's cached ratio with the tenant share 0.5 against 1.0 (no quota).

And one through the service itself (daphne and ``run_scheduler`` with the service's
settings, ``_common.Stack``):

- continue: conversations of ``--continue-turns`` turns (a ~300-token system prompt, one
            question a turn, ``--new-tokens`` tokens a reply, streamed), two at a time: one
            sends its whole history every turn, the other only its new turn
            (``"continue": true`` on a session), taking turns (A B / B A), one request at a
            time, each round a new tenant. Per turn: web + daemon CPU of the request (the two
            processes' CPU time across it) and TTFT (to the first text), the continued one's
            against the full one's (median of the rounds' ratios).

Run:  .venv/bin/python bench/prefix_cache.py   (--quick: 4 conversations x 2 turns, a smoke run)
The last line printed is JSON: {"bench": "prefix_cache", "modes": {"off": {...}, ...}}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from _common import Stack, command, cpu_ms, machine, model_path

from scheduler_daemon.core.disk_cache import DiskCache
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
# The service's defaults (config/settings.py, InferenceCore.from_settings) where they shape the
# cache; the engine then has one sequence more than the slots, the park.
SERVICE = {
    "cache_prompt": True, "cross_slot": True, "ram_cache_bytes": 256 << 20,  # PROMPT_CACHE_RAM_MB
    "idle_slots_to_ram": True, "park_seq": True, "kv_scope_share": 0.5,  # KV_TENANT_SHARE
    "ram_tenant_share": 0.5, "disk_min_tokens": 256,  # PROMPT_CACHE_TENANT_SHARE, _DISK_MIN_TOKENS
}
DISK_MB = 2048  # PROMPT_CACHE_DISK_MB
SERVICE_MODES = ("restart", "flood")
STACK_MODES = ("continue",)
WARM_UP = SamplingParams(max_tokens=2)


def scenario(conversations: int, turns: int, first: int = 0) -> Iterator[list[tuple[int, str]]]:
    """The arrival order: per turn, conversations two at a time -> [(conversation, question)]."""
    for turn in range(first, turns):
        for pair in range(0, conversations, 2):
            yield [
                (i, QUESTIONS[turn % len(QUESTIONS)].format(topic=TOPICS[i % len(TOPICS)]))
                for i in range(pair, min(pair + 2, conversations))
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


def outcome(handle) -> dict:
    """One finished request's numbers (and its text, for the conversation's history)."""
    done = handle.result(timeout=600)
    stats = done.finished.stats
    return {
        "ttft_ms": stats.ttft_ms,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "tier": stats.cache_tier,
        "text": done.text,
    }


def new_chats(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM}] for _ in range(n)]


def converse(core: InferenceCore, chats: list[list[dict]], arrivals, params: SamplingParams,
             sessions: bool) -> list[dict]:
    """Send each group of turns together and wait for all of it; the answers join the chats."""
    results: list[dict] = []
    for group in arrivals:
        handles = {}
        for i, question in group:
            chats[i].append({"role": "user", "content": question})
            handles[i] = core.submit(messages=chats[i], params=params, cache_scope="tenant-1",
                                     session=f"conv-{i}" if sessions else None)
        for i, handle in handles.items():
            results.append(outcome(handle))
            chats[i].append({"role": "assistant", "content": results[-1]["text"]})
    return results


def start_core(engine: LlamaEngine, config: SchedulerConfig,
               disk: DiskCache | None = None) -> InferenceCore:
    core = InferenceCore(engine, config, disk=disk)
    core.start()
    core.submit(prompt="Warm-up.", params=WARM_UP, cache_prompt=False).result(timeout=120)
    return core


def open_disk(engine: LlamaEngine, folder: Path, budget_mb: int, share: float) -> DiskCache:
    """A disk tier over ``folder`` as ``InferenceCore.from_settings`` makes it."""
    disk = DiskCache(folder, engine.cache_identity, budget_mb << 20, max_tokens=engine.n_ctx,
                     tenant_share=share, partial_max_tokens=engine.n_swa)
    disk.open()
    return disk


def run_mode(engine: LlamaEngine, mode: str, args: argparse.Namespace) -> dict:
    config, sessions = MODES[mode]
    core = start_core(engine, config)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = converse(core, new_chats(args.conversations),
                       scenario(args.conversations, args.turns), params, sessions)
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


# -- restart: turn 3 after a restart, with the disk tier against none ------------------------


def restart_variant(engine: LlamaEngine, args: argparse.Namespace, disk_on: bool) -> dict:
    """Turns 1-2, a restart (a new core over the same engine: empty sequences, no RAM
    entries; with ``disk_on`` a new disk tier over the same folder), then turn 3."""
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    config = SchedulerConfig(**SERVICE)
    folder = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
    try:
        chats = new_chats(args.conversations)
        disk = open_disk(engine, folder, DISK_MB, SERVICE["ram_tenant_share"]) if disk_on else None
        core = start_core(engine, config, disk)
        before = converse(core, chats, scenario(args.conversations, 2), params, True)
        core.stop(grace_s=0)  # with the disk tier, its shutdown saves run here
        disk = open_disk(engine, folder, DISK_MB, SERVICE["ram_tenant_share"]) if disk_on else None
        core = start_core(engine, config, disk)
        after = converse(core, chats, scenario(args.conversations, 3, first=2), params, True)
        counters = dict(core.scheduler.counters)
        core.stop(grace_s=0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    half = len(before) // 2
    return {
        **summarize(after),
        "min_prompt_tokens": [min(r["prompt_tokens"] for r in turn)
                              for turn in (before[:half], before[half:], after)],
        "tiers": {t: sum(r["tier"] == t for r in after) for t in {r["tier"] for r in after}},
        "disk_restores": counters.get("disk_restore", 0),
    }


def run_restart(engine: LlamaEngine, args: argparse.Namespace) -> dict:
    print(f"restart: turn 3 after a restart, disk tier ({DISK_MB} MB) against none (cold); "
          f"{args.conversations} conversations, rounds alternate A B / B A")
    print(f"{'round':>5} {'first':>5} {'disk p50 ms':>12} {'cold p50 ms':>12} {'ratio':>6} "
          f"{'cached disk':>12} {'cached cold':>12}  turn 1/2/3 min prompt tokens")
    rounds = []
    for r in range(args.rounds):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {on: restart_variant(engine, args, on) for on in order}
        disk, cold = got[True], got[False]
        ratio = disk["ttft_ms_median"] / cold["ttft_ms_median"]
        rounds.append({"first": "disk" if order[0] else "cold", "ratio": round(ratio, 3),
                       "disk": disk, "cold": cold})
        print(f"{r:>5} {rounds[-1]['first']:>5} {disk['ttft_ms_median']:>12.1f} "
              f"{cold['ttft_ms_median']:>12.1f} {ratio:>6.3f} {disk['cached_ratio']:>12.3f} "
              f"{cold['cached_ratio']:>12.3f}  {disk['min_prompt_tokens']} "
              f"tiers {disk['tiers']} / {cold['tiers']}", flush=True)
    ratios = [row["ratio"] for row in rounds]
    cached = [row["disk"]["cached_ratio"] for row in rounds]
    out = {
        "ttft_ratio_median": round(statistics.median(ratios), 3),
        "ttft_ratio_min": min(ratios), "ttft_ratio_max": max(ratios),
        "disk_ttft_ms_median": statistics.median(r["disk"]["ttft_ms_median"] for r in rounds),
        "cold_ttft_ms_median": statistics.median(r["cold"]["ttft_ms_median"] for r in rounds),
        "disk_cached_ratio_median": statistics.median(cached), "disk_cached_ratio_min": min(cached),
        "rounds": rounds,
    }
    print(f"restart: turn 3 TTFT p50 disk / cold median {out['ttft_ratio_median']:.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}] (target <= 0.35); cached with the disk tier "
          f"{out['disk_cached_ratio_median']:.3f} (min {min(cached):.3f}; target >= 0.85)")
    return out


# -- flood: a warm conversation against another tenant's distinct prompts ------------------


def flood_prompts(engine: LlamaEngine, n: int, n_tokens: int) -> list[list[int]]:
    """``n`` distinct prompts of ``n_tokens`` tokens (the same every run): no two share a prefix."""
    words = sorted(set(SYSTEM.replace(",", "").replace(".", "").lower().split()))
    rng = random.Random(34)
    prompts = []
    for k in range(n):
        text = f"Report {k}: " + " ".join(rng.choice(words) for _ in range(n_tokens))
        prompts.append(engine.tokenize(text)[:n_tokens])
    return prompts


def flood_variant(engine: LlamaEngine, args: argparse.Namespace, share: float,
                  prompts: list[list[int]]) -> dict:
    """Tenant A's conversation, one turn per ``flood_per_turn`` of B's prompts (sent two at a
    time, A's turn with the first pair), under small RAM and disk budgets."""
    config = SchedulerConfig(**{**SERVICE, "ram_cache_bytes": args.flood_ram_mb << 20,
                                "ram_tenant_share": share})
    chat = new_chats(1)[0]
    a_params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    b_params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    folder = Path(tempfile.mkdtemp(prefix="bench-prompt-cache-"))
    a_turns = []
    try:
        core = start_core(engine, config, open_disk(engine, folder, args.flood_disk_mb, share))
        b = iter(prompts)
        for turn in range(args.flood_turns):
            chat.append({"role": "user", "content": f"Question {turn + 1}: "
                         + QUESTIONS[turn % len(QUESTIONS)].format(topic=TOPICS[0])})
            a = core.submit(messages=chat, params=a_params, cache_scope="tenant-a", session="a")
            for step in range(0, args.flood_per_turn, 2):
                flood = [core.submit(prompt=next(b), params=b_params, cache_scope="tenant-b")
                         for _ in range(min(2, args.flood_per_turn - step))]
                if step == 0:
                    a_turns.append(outcome(a))
                    chat.append({"role": "assistant", "content": a_turns[-1]["text"]})
                for handle in flood:
                    outcome(handle)
        counters = dict(core.scheduler.counters)
        core.stop(grace_s=0)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    later = a_turns[1:]  # the first turn has nothing to reuse
    prompt = sum(r["prompt_tokens"] for r in later)
    return {
        "a_cached_ratio": round(sum(r["cached_tokens"] for r in later) / prompt, 3),
        "a_turns": [(r["prompt_tokens"], r["cached_tokens"], r["tier"]) for r in a_turns],
        **{name: counters.get(name, 0) for name in (
            "ram_evict", "ram_reject", "disk_evictions", "disk_rejects", "disk_save_dropped",
            "cache_hit_tokens_ram", "cache_hit_tokens_disk")},
    }


def run_flood(engine: LlamaEngine, args: argparse.Namespace) -> dict:
    per_turn = args.flood_per_turn
    prompts = flood_prompts(engine, args.flood_turns * per_turn, args.flood_tokens)
    b_bytes = (args.flood_tokens + 3) * engine.kv_bytes_per_token
    print(f"flood: tenant A one conversation, a turn per {per_turn} distinct {args.flood_tokens}"
          f"-token prompts of tenant B (~{b_bytes / 2**20:.1f} MB of state each); RAM "
          f"{args.flood_ram_mb} MB, disk {args.flood_disk_mb} MB; {args.flood_turns} turns of A; "
          "tenant share 0.5 (the default) against 1.0 (no quota), alternating")
    print(f"{'round':>5} {'share':>5} {'A cached':>9} {'ram evict':>9} {'disk evict':>10}  "
          "A's turns (prompt, cached, tier)")
    rounds = []
    for r in range(args.flood_rounds):
        order = (0.5, 1.0) if r % 2 == 0 else (1.0, 0.5)
        got = {share: flood_variant(engine, args, share, prompts) for share in order}
        for share in order:
            row = got[share]
            print(f"{r:>5} {share:>5} {row['a_cached_ratio']:>9.3f} {row['ram_evict']:>9} "
                  f"{row['disk_evictions']:>10}  {row['a_turns']}", flush=True)
        rounds.append({str(share): got[share] for share in (0.5, 1.0)})
    out = {
        share: statistics.median(row[share]["a_cached_ratio"] for row in rounds)
        for share in ("0.5", "1.0")
    }
    print(f"flood: A's cached ratio, share 0.5 {out['0.5']:.3f} (target >= 0.8), "
          f"share 1.0 {out['1.0']:.3f}")
    return {"a_cached_ratio": out, "rounds": rounds}


def load_engine(args: argparse.Namespace, n_seq_max: int) -> LlamaEngine:
    return LlamaEngine(
        EngineConfig(
            model_path=model_path(),
            n_ctx=8192,
            n_batch=2048,
            n_seq_max=n_seq_max,
            n_threads=args.threads,
        )
    )


def _turn(client, url: str, key: str, body: dict, pids: list[int]) -> dict:
    """One streamed chat request, alone: its text, usage, TTFT and the web's and daemon's
    CPU across it."""
    before = [cpu_ms(pid) for pid in pids]
    t0 = time.perf_counter()
    ttft, text, usage, session_id = None, [], None, None
    with client.stream("POST", url, json={**body, "stream": True,
                                          "stream_options": {"include_usage": True}},
                       headers={"Authorization": f"Bearer {key}"}) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"{reply.status_code}: {reply.read()[:300]!r}")
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            session_id = chunk.get("session_id", session_id)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(piece)
            usage = chunk.get("usage") or usage
    after = [cpu_ms(pid) for pid in pids]
    return {"text": "".join(text), "usage": usage, "session_id": session_id,
            "ttft_ms": 1000 * (ttft if ttft is not None else time.perf_counter() - t0),
            "web_cpu_ms": after[1] - before[1], "daemon_cpu_ms": after[0] - before[0]}


def run_continue(args: argparse.Namespace) -> dict:
    """The ``continue`` mode (module docstring): the real web and daemon."""
    import httpx2 as httpx  # what the pinned openai SDK ships with (httpx API)

    tmp = Path(tempfile.mkdtemp(prefix="bench-continue-"))
    (tmp / "stack").mkdir()
    stack = Stack(args.redis_url, args.slots, args.threads, "bench-continue", defaults=True,
                  env={"PROMPT_CACHE_DIR": str(tmp / "cache"), "N_THREADS": str(args.threads)},
                  tmp=tmp / "stack")
    stack.open()
    pids = [stack.procs[0].pid, stack.procs[1].pid]  # the daemon, daphne
    url = f"http://127.0.0.1:{stack.port}/v1/chat/completions"
    per_turn: dict[int, dict[str, list[float]]] = {}
    params = {"model": stack.model, "max_tokens": args.new_tokens, "temperature": 0,
              "ignore_eos": True}
    try:
        with httpx.Client(timeout=300) as client:
            for r in range(args.continue_rounds):
                key = stack.create_key(f"continue-{r}")  # a tenant per round: no shared cache
                topics = (TOPICS[(2 * r) % len(TOPICS)], TOPICS[(2 * r + 1) % len(TOPICS)])
                history = [[{"role": "system", "content": SYSTEM}] for _ in range(2)]
                session = None
                for turn in range(args.continue_turns):
                    order = (0, 1) if (r + turn) % 2 == 0 else (1, 0)
                    rows = {}
                    for who in order:  # 0: the full history, 1: the new turn only
                        question = {"role": "user", "content": QUESTIONS[
                            turn % len(QUESTIONS)].format(topic=topics[who])}
                        history[who].append(question)
                        if who == 0:
                            body = {**params, "messages": history[0]}
                        elif session is None:
                            body = {**params, "messages": history[1], "session_id": "new"}
                        else:
                            body = {**params, "messages": [question], "session_id": session,
                                    "continue": True}
                        rows[who] = _turn(client, url, key, body, pids)
                        history[who].append({"role": "assistant", "content": rows[who]["text"]})
                        if who == 1:
                            session = rows[who]["session_id"]
                    stats = per_turn.setdefault(turn + 1, {"cpu": [], "ttft": [], "web": [],
                                                           "daemon": [], "prompt": []})
                    full, cont = rows[0], rows[1]
                    cpu = [x["web_cpu_ms"] + x["daemon_cpu_ms"] for x in (full, cont)]
                    stats["cpu"].append(cpu[1] / cpu[0] if cpu[0] else float("nan"))
                    stats["ttft"].append(cont["ttft_ms"] / full["ttft_ms"])
                    stats["web"].append(cont["web_cpu_ms"] - full["web_cpu_ms"])
                    stats["daemon"].append(cont["daemon_cpu_ms"] - full["daemon_cpu_ms"])
                    stats["prompt"].append(full["usage"]["prompt_tokens"])
                print(f"round {r + 1}: turn {args.continue_turns} cpu ratio "
                      f"{per_turn[args.continue_turns]['cpu'][-1]:.3f}, ttft ratio "
                      f"{per_turn[args.continue_turns]['ttft'][-1]:.3f}", flush=True)
    finally:
        stack.close()
        shutil.rmtree(tmp, ignore_errors=True)
    skipped = history_cost(args, history[0])
    render, parse = skipped["render_tokenize_ms"], skipped["web_parse_ms"]
    print(f"what a continued turn skips at turn {args.continue_turns} "
          f"({skipped['history_tokens']} tokens of history), in process: the daemon's render + "
          f"tokenize {render['full']} ms -> {render['continue']} ms; the web's parse "
          f"{parse['full']} ms -> {parse['continue']} ms", flush=True)
    table = {}
    for turn, stats in sorted(per_turn.items()):
        table[turn] = {
            "prompt_tokens": int(statistics.median(stats["prompt"])),
            "cpu_ratio": round(statistics.median(stats["cpu"]), 3),
            "cpu_ratio_range": [round(min(stats["cpu"]), 3), round(max(stats["cpu"]), 3)],
            "ttft_ratio": round(statistics.median(stats["ttft"]), 3),
            "ttft_ratio_range": [round(min(stats["ttft"]), 3), round(max(stats["ttft"]), 3)],
            "web_cpu_ms_saved": round(-statistics.median(stats["web"]), 1),
            "daemon_cpu_ms_saved": round(-statistics.median(stats["daemon"]), 1),
        }
        row = table[turn]
        print(f"turn {turn}: prompt {row['prompt_tokens']} tokens; continued / full: cpu "
              f"{row['cpu_ratio']} {row['cpu_ratio_range']}, ttft {row['ttft_ratio']} "
              f"{row['ttft_ratio_range']}; saved web {row['web_cpu_ms_saved']} ms, daemon "
              f"{row['daemon_cpu_ms_saved']} ms", flush=True)
    return {"rounds": args.continue_rounds, "turns": table, "skipped": skipped}


def history_cost(args: argparse.Namespace, history: list[dict]) -> dict:
    """In process, one thread: what the daemon does with a turn's messages (render with the
    model's template, tokenize) and the web (parse and check the body), for the whole history
    against the new turn alone (medians of 200 runs, ms)."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
    os.environ.setdefault("DEBUG", "true")
    django.setup()
    from inference.openai_request import load_json, parse_request
    from scheduler_daemon.core.chat import ChatRenderer, message_pairs

    engine = LlamaEngine(EngineConfig(model_path=model_path(), n_ctx=4096, n_batch=512,
                                      n_seq_max=1, n_threads=1))
    chat = ChatRenderer(engine)
    pairs = message_pairs(history)

    def median_ms(call) -> float:
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            call()
            times.append(time.perf_counter() - t0)
        return round(1000 * statistics.median(times), 3)

    full = json.dumps({"model": "m", "messages": history, "max_tokens": 16, "stream": True})
    cont = json.dumps({"model": "m", "messages": history[-1:], "max_tokens": 16, "stream": True,
                       "session_id": "sess_" + "a" * 43, "continue": True})
    out = {
        "history_tokens": len(engine.tokenize_segments(chat.segments(pairs))),
        "render_tokenize_ms": {
            "full": median_ms(lambda: engine.tokenize_segments(chat.segments(pairs))),
            "continue": median_ms(lambda: engine.tokenize_segments(
                chat.continuation_segments(pairs[-1:]), bos=False)),
        },
        "web_parse_ms": {
            "full": median_ms(lambda: parse_request("chat", load_json(full))),
            "continue": median_ms(lambda: parse_request("chat", load_json(cont))),
        },
    }
    engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    every = [*MODES, *SERVICE_MODES, *STACK_MODES]
    parser.add_argument("--modes", nargs="+", default=every, choices=every)
    parser.add_argument("--rounds", type=int, default=6, help="restart: rounds of both variants")
    parser.add_argument("--flood-rounds", type=int, default=2)
    parser.add_argument("--flood-turns", type=int, default=6, help="tenant A's turns")
    parser.add_argument("--flood-per-turn", type=int, default=8, help="B's prompts per A turn")
    parser.add_argument("--flood-tokens", type=int, default=320, help="tokens of a B prompt")
    parser.add_argument("--flood-ram-mb", type=int, default=24)
    parser.add_argument("--flood-disk-mb", type=int, default=32)
    parser.add_argument("--continue-rounds", type=int, default=4)
    parser.add_argument("--continue-turns", type=int, default=8)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14",
                        help="continue: the stack's Redis (a database of its own)")
    parser.add_argument("--quick", action="store_true",
                        help="4 conversations x 2 turns, 2 restart rounds, 1 flood round of 3")
    args = parser.parse_args()
    if args.quick:
        args.conversations, args.turns, args.rounds = 4, 2, 2
        args.flood_rounds, args.flood_turns = 1, 3
    logging.basicConfig(level=logging.WARNING)
    print(f"machine: {machine()}")
    print(f"command: {command()}")
    modes: dict = {}
    system_tokens = 0
    seeded = [m for m in args.modes if m in MODES]
    if seeded:
        engine = load_engine(args, args.slots)
        system_tokens = len(engine.tokenize(SYSTEM, add_special=False))
        print(
            f"model: {engine.model_path}  threads={args.threads} slots={args.slots} "
            f"system prompt={system_tokens} tokens  {args.conversations} conversations x "
            f"{args.turns} turns, {args.new_tokens} new tokens, two at a time"
        )
        print(f"{'mode':>9} {'ttft p50 ms':>12} {'ttft p90 ms':>12} {'cached':>7} {'wall s':>7}")
        for mode in seeded:
            row = modes[mode] = run_mode(engine, mode, args)
            print(
                f"{mode:>9} {row['ttft_ms_median']:>12.1f} {row['ttft_ms_p90']:>12.1f} "
                f"{row['cached_ratio']:>7.3f} {row['wall_s']:>7.2f}",
                flush=True,
            )
        engine.close()
    serviced = [m for m in args.modes if m in SERVICE_MODES]
    if serviced:
        engine = load_engine(args, args.slots + 1)  # the park
        system_tokens = len(engine.tokenize(SYSTEM, add_special=False))
        print(f"model: {engine.model_path}  threads={args.threads} slots={args.slots} + the park; "
              f"{engine.kv_bytes_per_token} bytes of state per token; the service's cache "
              f"settings: {SERVICE}")
        for mode in serviced:
            t0 = time.perf_counter()
            modes[mode] = (run_restart if mode == "restart" else run_flood)(engine, args)
            modes[mode]["wall_s"] = round(time.perf_counter() - t0, 1)
        engine.close()
    if "continue" in args.modes:
        t0 = time.perf_counter()
        modes["continue"] = run_continue(args)
        modes["continue"]["wall_s"] = round(time.perf_counter() - t0, 1)
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
