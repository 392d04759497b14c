"""A fleet of daemons of one model: cache-aware routing vs round robin, and what a refusal
costs (issue #17). Not a test: numbers for bench/results/.

The stack: one Redis (a database of the local one, default 14), a temporary SQLite
database, three ``run_scheduler`` daemons of one model (Gemma 3 270M; N_PARALLEL 2,
N_THREADS 1, MAX_QUEUE 4 each) and two daphne web servers on it, one with
``ROUTING=round_robin``, one with ``ROUTING=cache_aware`` (the default). Same daemons,
same run: the modes take turns (A B A B), each round with three fresh tenants, so no
round reuses another's cache (a cache is the tenant's alone).

Conversations: 3 tenants x 8 conversations x 4 turns, streamed, ``max_tokens`` 16; each
tenant has its own system prompt of ~300 tokens; six conversations run at once, started
interleaved across tenants (A1 B1 C1 A2 ...), each conversation's turns one after the
other, each turn sending the whole history and the conversation's ``session``. Per mode:
the cached-token ratio (cached / prompt tokens, from usage), TTFT p50/p90 (client side, to
the first text), requests per daemon and the imbalance (max / mean), 503s.
Targets: cache_aware cached ratio >= 0.85 and far above round_robin's; TTFT p50 <= 0.5 x
round_robin's; imbalance <= 1.5.

Isolation, paired: a tenant sends another tenant's cached system prompt, and (the pair)
an unseen prompt of the same length; TTFT of each, cached tokens of each (0 both).

Refusals: a burst of ``--burst`` concurrent requests (10x what the fleet queues and holds)
with a valid key, and an identical burst with a bad key, taking turns; p99 of the 503s
(``queue_full``, decided by the web) vs p99 of the 401s. Target: within 20 ms. Then the
same two kinds one at a time (200 each, taking turns, and a third: a valid key with an
invalid body, 400 after authentication and validation, no Redis): median latency and the
web's CPU per request of each, which is what a burst queues up on the web's event loop.

Refusals by web processes (``--parts workers``, alone): two web servers on the same
daemons, one of one daphne and one of two (``WEB_WORKERS``, started as ``make run`` starts
them without the door: config/web_procs.py), the fleet held full; bursts of ``--burst`` of
each refusal (401 a bad key, 503 ``queue_full``; a 429 of a tenant's limit is not to be had
with the fleet full: the queue's gate answers first) against each, taking turns for
``--burst-rounds`` rounds. Per setup the median p99 of each refusal and their spread
(target: within 20 ms with two processes), the median over rounds of two processes' p99
over one's, and per burst the CPU of each daphne, the daemons and Redis (which component
the burst waits on).

    .venv/bin/python bench/fleet.py [--rounds 2] [--burst 240] [--redis-url URL]
    .venv/bin/python bench/fleet.py --parts workers [--burst-rounds 4]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx2 as httpx  # what the pinned openai SDK ships with (httpx API)
import redis
from _common import ROOT, cpu_ms, free_port, machine, model_path, model_served

from config import web_procs
from wire import protocol, queue

DAEMONS = 3
BURST_TENANTS = 8
DAEMON_ENV = {"N_PARALLEL": "2", "N_THREADS": "1", "N_CTX": "4096", "MAX_QUEUE": "4",
              "LOCAL_QUEUE": "2"}
TENANTS, CONVERSATIONS, TURNS, AT_ONCE, NEW_TOKENS = 3, 8, 4, 6, 16
MODES = ("round_robin", "cache_aware")
WORDS = ("bread flour oven crust dough yeast butter sugar rye wheat loaf bake knead proof "
         "cake cream honey salt seed grain mill starter batch tray rack shelf").split()


def system_prompt(tag: str) -> str:
    """~300 tokens of a tenant's own instructions (Gemma: ~4 characters a token); nothing
    in common between two tags from the first token on."""
    rng = __import__("random").Random(tag)
    words = " ".join(rng.choice(WORDS) for _ in range(230))
    return f"{tag}: you are the assistant of this bakery. Rules: {words}. Answer briefly."


class Fleet:
    """The processes; ``close`` stops them and drops the model's keys."""

    def __init__(self, redis_url: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
        self.model = f"fleet-{secrets.token_hex(3)}"
        self.redis_url = redis_url
        self.env = {**os.environ, "REDIS_URL": redis_url, "DEBUG": "false", "HTTPS_ONLY": "false",
                    "SECRET_KEY": secrets.token_urlsafe(40), "ALLOWED_HOSTS": "127.0.0.1",
                    "DATABASE_URL": f"sqlite:///{self.tmp / 'db.sqlite3'}",
                    "LOG_LEVEL": "WARNING", "MODEL_PATH": model_path(),
                    "MODEL_NAME": self.model, "MODELS": self.model}
        self.procs: list[subprocess.Popen] = []
        self.ports: dict[str, int] = {}
        self.web_pids: dict[str, list[int]] = {}
        self.daemon_ids = [f"fleet-d{i}-{secrets.token_hex(2)}" for i in range(DAEMONS)]

    def manage(self, *argv: str) -> str:
        return subprocess.run([sys.executable, "manage.py", *argv], cwd=ROOT, env=self.env,
                              check=True, capture_output=True, text=True).stdout

    def start(self, webs: dict[str, tuple[int, dict[str, str]]] | None = None) -> None:
        """The daemons, and the web servers: name -> (processes, settings of their own);
        by default one daphne per routing mode."""
        webs = webs or {mode: (1, {"ROUTING": mode}) for mode in MODES}
        self.manage("migrate", "-v", "0")
        log = (self.tmp / "log.txt").open("ab")
        for daemon_id in self.daemon_ids:
            self.procs.append(subprocess.Popen(
                [sys.executable, "manage.py", "run_scheduler", "--grace", "1",
                 "--daemon-id", daemon_id], cwd=ROOT, env={**self.env, **DAEMON_ENV},
                stdout=log, stderr=subprocess.STDOUT))
        for name, (workers, settings) in webs.items():
            # as make run starts them without the door (config/web_procs.py)
            port = free_port()
            self.ports[name] = port
            procs = web_procs.start_web(workers, host="127.0.0.1", port=port,
                                        env={**self.env, "WEB_WORKERS": str(workers),
                                             **settings}, stdout=log,
                                        stderr=subprocess.STDOUT)
            self.procs += procs
            self.web_pids[name] = [p.pid for p in procs]
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + 300
        while not (all(model_served(p, self.model) for p in self.ports.values())
                   and len(client.hkeys(queue.fleet_key(self.model))) == DAEMONS):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the fleet did not start; see {self.tmp / 'log.txt'}")
            time.sleep(0.5)

    def tenant(self, name: str) -> str:
        self.manage("create_tenant", name)
        return self.manage("create_api_key", name).strip().splitlines()[-1]

    def close(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        client = redis.Redis.from_url(self.redis_url)
        client.delete(*queue.keys_of(self.model),
                      *[queue.routed_key(self.model, d) for d in self.daemon_ids])
        shutil.rmtree(self.tmp, ignore_errors=True)


async def turn(http: httpx.AsyncClient, base: str, key: str, model: str, prompt: str,
               session: str) -> dict[str, Any]:
    """One streamed completion: TTFT, usage, the daemon that served it, the status."""
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "session": session}
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    async with http.stream("POST", f"{base}/v1/completions", json=body,
                           headers={"Authorization": f"Bearer {key}"}) as reply:
        if reply.status_code != 200:
            await reply.aread()
            return {"status": reply.status_code}
        request_id = reply.headers.get("X-Request-Id")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                if choice.get("text"):
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text += choice["text"]
            usage = chunk.get("usage") or usage
    return {"status": 200, "ttft": ttft, "text": text, "usage": usage, "request_id": request_id}


def served_by(client: redis.Redis, request_id: str | None) -> str | None:
    served = None
    for _, fields in client.xrange(protocol.events_stream(request_id or "-")):
        kind, data = protocol.decode_event(fields)
        if kind == protocol.ACCEPTED:
            served = data.get("daemon_id")
    return served


async def conversations(fleet: Fleet, mode: str, round_no: int) -> dict[str, Any]:
    base = f"http://127.0.0.1:{fleet.ports[mode]}"
    tags = [f"{mode[:2]}{round_no}t{t}-{secrets.token_hex(2)}" for t in range(TENANTS)]
    keys = {tag: fleet.tenant(tag) for tag in tags}
    order = [(tags[t], c) for c in range(CONVERSATIONS) for t in range(TENANTS)]  # interleaved
    results: list[dict[str, Any]] = []
    pending = asyncio.Queue()
    for item in order:
        pending.put_nowait(item)
    async with httpx.AsyncClient(timeout=600) as http:

        async def worker() -> None:
            while not pending.empty():
                tag, c = pending.get_nowait()
                prompt, session = system_prompt(tag), f"{tag}-c{c}"
                for t in range(TURNS):
                    prompt += f"\nCustomer {c}: question {t} about the {WORDS[(c + t) % 25]}?\n"
                    result = await turn(http, base, keys[tag], fleet.model, prompt, session)
                    results.append(result)
                    if result["status"] != 200:
                        break
                    prompt += result["text"]

        await asyncio.gather(*(worker() for _ in range(AT_ONCE)))
    client = redis.Redis.from_url(fleet.redis_url)
    ok = [r for r in results if r["status"] == 200]
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in ok if r["usage"])
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in ok if r["usage"])
    per_daemon = Counter(served_by(client, r["request_id"]) for r in ok)
    counts = [per_daemon.get(d, 0) for d in fleet.daemon_ids]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    return {
        "mode": mode, "requests": len(results), "ok": len(ok),
        "refused_503": sum(1 for r in results if r["status"] == 503),
        "cached_ratio": round(cached / prompt_tokens, 3) if prompt_tokens else None,
        "ttft_p50_ms": round(_quantile(ttfts, 0.5) * 1000, 1),
        "ttft_p90_ms": round(_quantile(ttfts, 0.9) * 1000, 1),
        "per_daemon": counts,
        "imbalance": round(max(counts) / statistics.mean(counts), 3) if any(counts) else None,
    }


async def isolation(fleet: Fleet, pairs: int) -> dict[str, Any]:
    """Per pair: tenant A sends a new prompt twice (cached, in A's summary); tenant B sends
    that prompt once, and once an unseen prompt of the same length (alternating which
    first); TTFT and cached tokens of B's. For a reference, A's own second send."""
    base = f"http://127.0.0.1:{fleet.ports['cache_aware']}"
    owner, other = (f"iso-{n}-{secrets.token_hex(2)}" for n in "ab")
    keys = {owner: fleet.tenant(owner), other: fleet.tenant(other)}
    rows: dict[str, list[dict[str, Any]]] = {"seen_by_a": [], "unseen": [], "a_again": []}
    async with httpx.AsyncClient(timeout=600) as http:
        for i in range(pairs):
            cached_prompt = system_prompt(f"a{i}-{secrets.token_hex(2)}") + "\nCustomer: hi?\n"
            await turn(http, base, keys[owner], fleet.model, cached_prompt, "")
            rows["a_again"].append(await turn(http, base, keys[owner], fleet.model,
                                              cached_prompt, ""))
            unseen = system_prompt(f"u{i}-{secrets.token_hex(2)}") + "\nCustomer: hi?\n"
            # the same length in characters as the one A cached
            unseen = (unseen + " " * len(cached_prompt))[:len(cached_prompt)]
            order = [("seen_by_a", cached_prompt), ("unseen", unseen)]
            for name, prompt in order if i % 2 == 0 else order[::-1]:
                rows[name].append(await turn(http, base, keys[other], fleet.model, prompt, ""))
    out = {}
    for name, results in rows.items():
        ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
        out[name] = {"ttft_p50_ms": round(statistics.median(ttfts) * 1000, 1),
                     "cached_tokens": sum(r["usage"]["prompt_tokens_details"]["cached_tokens"]
                                          for r in results if r.get("usage"))}
    out["ttft_diff_ms"] = round(out["seen_by_a"]["ttft_p50_ms"] - out["unseen"]["ttft_p50_ms"], 1)
    return out


async def burst(base: str, keys: list[str], model: str, n: int) -> dict[str, list[float]]:
    """``n`` requests at once (the keys in turn); latency by status."""
    body = {"model": model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    by_status: dict[str, list[float]] = {}
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(key: str) -> None:
            t0 = time.perf_counter()
            try:
                reply = await http.post(f"{base}/v1/completions", json=body,
                                        headers={"Authorization": f"Bearer {key}"})
                status = str(reply.status_code)
            except httpx.TransportError as exc:  # counted: the server dropped the connection
                status = type(exc).__name__
            by_status.setdefault(status, []).append(time.perf_counter() - t0)

        await asyncio.gather(*(one(keys[i % len(keys)]) for i in range(n)))
    return by_status


async def one_by_one(http: httpx.AsyncClient, base: str,
                     kinds: dict[str, tuple[list[str], dict[str, Any]]], n: int,
                     web_pid: int) -> dict[str, Any]:
    """``n`` requests of each kind (kind -> its keys and body), one at a time, the kinds
    taking turns: per kind the median latency and the web process's CPU per request, so
    what a burst costs can be put on the component that costs it (one web process serves
    the burst one request after another on its event loop and thread)."""
    latency: dict[str, list[float]] = {kind: [] for kind in kinds}
    cpu: dict[str, float] = dict.fromkeys(kinds, 0.0)
    statuses: Counter[str] = Counter()
    for i in range(n):
        for kind, (kind_keys, body) in kinds.items():
            auth = {"Authorization": f"Bearer {kind_keys[i % len(kind_keys)]}"}
            before, t0 = cpu_ms(web_pid), time.perf_counter()
            reply = await http.post(f"{base}/v1/completions", json=body, headers=auth)
            latency[kind].append(time.perf_counter() - t0)
            cpu[kind] += cpu_ms(web_pid) - before
            statuses[f"{kind}:{reply.status_code}"] += 1
    return {kind: {"latency_p50_ms": round(statistics.median(latency[kind]) * 1000, 2),
                   "web_cpu_ms": round(cpu[kind] / n, 2)} for kind in kinds} | {
        "statuses": dict(statuses)}


async def fill(http: httpx.AsyncClient, base: str, keys: list[str], model: str,
               n: int) -> list[str]:
    """``n`` long streamed requests (the keys in turn) until the gate refuses: the fleet's
    slots, local queues and Redis queue full. Their request ids (to cancel)."""
    body = {"model": model, "prompt": "Tell me a long story.", "max_tokens": 2000,
            "ignore_eos": True, "temperature": 0, "stream": True}
    ids: list[str] = []

    async def one(key: str) -> None:
        async with http.stream("POST", f"{base}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as reply:
            if reply.status_code == 200:
                ids.append(reply.headers["X-Request-Id"])
                async for _ in reply.aiter_lines():
                    pass  # read on: the request runs until it is cancelled

    tasks = [asyncio.ensure_future(one(keys[i % len(keys)])) for i in range(n)]
    await asyncio.sleep(3)
    fill.tasks = tasks  # type: ignore[attr-defined]
    return ids


async def refusals(fleet: Fleet, n: int, rounds: int) -> dict[str, Any]:
    """Bursts of ``n`` requests at once with valid keys of ``BURST_TENANTS`` tenants (so the
    model's queue fills before any tenant's share of it: 503 ``queue_full``), and the same
    burst with a bad key (401), taking turns, while long requests of other tenants hold
    the fleet full (every slot busy and the queue at its limit): both bursts meet the same
    busy daemons, and every valid request of the burst is refused. The p99 latency of each
    status."""
    base = f"http://127.0.0.1:{fleet.ports['cache_aware']}"
    keys = [fleet.tenant(f"burst{i}-{secrets.token_hex(2)}") for i in range(BURST_TENANTS)]
    fillers = [fleet.tenant(f"fill{i}-{secrets.token_hex(2)}") for i in range(BURST_TENANTS)]
    bad = ["sk-nope.not-a-key"]
    p99: dict[str, list[float]] = {}
    counts: Counter[str] = Counter()
    async with httpx.AsyncClient(timeout=600) as http:
        held = await fill(http, base, fillers, fleet.model, 2 * DAEMONS * 8)
        counts["fill:running"] = len(held)
        for r in range(rounds):
            for which in (("bad", "good") if r % 2 == 0 else ("good", "bad")):
                got = await burst(base, bad if which == "bad" else keys, fleet.model, n)
                for status, latencies in got.items():
                    counts[f"{which}:{status}"] += len(latencies)
                    if status != "200":
                        p99.setdefault(status, []).append(_quantile(sorted(latencies), 0.99))
                await asyncio.sleep(2)
        # The same two kinds one at a time: where the burst's difference comes from.
        body = {"model": fleet.model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        kinds = {"bad": (bad, body), "good": (keys, body),
                 "invalid": (keys, {**body, "max_tokens": -1})}  # 400 after auth and parse
        single = await one_by_one(http, base, kinds, 200, fleet.web_pids["cache_aware"][0])
        for task in fill.tasks:  # type: ignore[attr-defined]
            task.cancel()  # their readers gone, the daemons cancel them (the resume grace)
    out: dict[str, Any] = {"burst": n, "rounds": rounds, "statuses": dict(counts),
                           "one_at_a_time": single,
                           **{f"p99_{s}_ms": [round(v * 1000, 1) for v in vs]
                              for s, vs in sorted(p99.items())}}
    if p99.get("503") and p99.get("401"):
        out["p99_diff_ms_median"] = round(
            (statistics.median(p99["503"]) - statistics.median(p99["401"])) * 1000, 1)
    return out


WORKER_SETUPS = {"w1": 1, "w2": 2}  # WEB_WORKERS of the two web servers compared
REFUSALS = {"bad": "401", "good": "503"}


def redis_pid(url: str) -> int | None:
    """The Redis server's pid when it runs on this machine (its CPU is counted too)."""
    pid = redis.Redis.from_url(url).info("server").get("process_id")
    return int(pid) if pid and Path(f"/proc/{pid}").exists() else None


async def refusals_by_workers(fleet: Fleet, n: int, rounds: int) -> dict[str, Any]:
    """The refusals of a burst of ``n`` (401 a bad key, 503 ``queue_full`` with valid keys
    of ``BURST_TENANTS`` tenants), the fleet held full, against WEB_WORKERS=1 and
    WEB_WORKERS=2 (two web servers on the same daemons, Redis and database), taking turns:
    rounds alternate which setup goes first and which kind. Per burst: p99 latency of its
    refusal and the CPU each component spent (each daphne, the daemons, Redis). A 429 of a
    tenant's limits cannot be had here: with the fleet full the model's queue is looked at
    first (wire/lua/admit.lua), so a tenant over its requests a minute gets 503 too (the
    probe before the rounds shows each kind's code)."""
    keys = [fleet.tenant(f"burst{i}-{secrets.token_hex(2)}") for i in range(BURST_TENANTS)]
    limited_tenants = [f"rpm1-{i}-{secrets.token_hex(2)}" for i in range(2)]
    limited = [fleet.tenant(t) for t in limited_tenants]  # probed only (see above)
    fleet.manage("shell", "-c", "from accounts.models import Tenant; Tenant.objects.filter("
                 f"slug__in={limited_tenants!r}).update(requests_per_minute=1)")
    fillers = [fleet.tenant(f"fill{i}-{secrets.token_hex(2)}") for i in range(BURST_TENANTS)]
    kinds = {"bad": ["sk-nope.not-a-key"], "good": keys}
    daemon_pids = [p.pid for p in fleet.procs if p.pid not in
                   {pid for pids in fleet.web_pids.values() for pid in pids}]
    rpid = redis_pid(fleet.redis_url)
    rows: list[dict[str, Any]] = []
    counts: Counter[str] = Counter()
    base = {name: f"http://127.0.0.1:{fleet.ports[name]}" for name in WORKER_SETUPS}
    async with httpx.AsyncClient(timeout=600) as http:
        held = await fill(http, base["w1"], fillers, fleet.model, 2 * DAEMONS * 8)
        counts["fill:running"] = len(held)
        body = {"model": fleet.model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        for which, which_keys in {**kinds, "limited": limited}.items():  # each one's code
            reply = await http.post(f"{base['w1']}/v1/completions", json=body,
                                    headers={"Authorization": f"Bearer {which_keys[0]}"})
            code = (reply.json().get("error") or {}).get("code")
            counts[f"probe:{which}:{reply.status_code}:{code}"] += 1
        order = list(REFUSALS)
        for r in range(rounds):
            for setup in (("w1", "w2") if r % 2 == 0 else ("w2", "w1")):
                for which in order if r % 2 == 0 else order[::-1]:
                    web_pids = fleet.web_pids[setup]
                    pids = {"web": web_pids, "daemons": daemon_pids,
                            "redis": [rpid] if rpid else [], "client": [os.getpid()]}
                    before = {k: [cpu_ms(p) for p in v] for k, v in pids.items()}
                    t0 = time.perf_counter()
                    got = await burst(base[setup], kinds[which], fleet.model, n)
                    wall = time.perf_counter() - t0
                    cpu = {k: [round(cpu_ms(p) - b, 1) for p, b in zip(v, before[k],
                                                                         strict=True)]
                           for k, v in pids.items()}
                    for status, latencies in got.items():
                        counts[f"{setup}:{which}:{status}"] += len(latencies)
                    refused = sorted(got.get(REFUSALS[which], []))
                    rows.append({"round": r, "setup": setup, "kind": which,
                                 "p99_ms": round(_quantile(refused, 0.99) * 1000, 1),
                                 "p50_ms": round(_quantile(refused, 0.5) * 1000, 1),
                                 "wall_ms": round(wall * 1000), "web_cpu_ms": cpu["web"],
                                 "daemons_cpu_ms": round(sum(cpu["daemons"])),
                                 "redis_cpu_ms": round(sum(cpu["redis"])),
                                 "client_cpu_ms": round(sum(cpu["client"]))})
                    print(f"  {json.dumps(rows[-1])}", flush=True)
                    await asyncio.sleep(2)
        for task in fill.tasks:  # type: ignore[attr-defined]
            task.cancel()
    return {"burst": n, "rounds": rounds, "statuses": dict(counts), "bursts": rows,
            "summary": summarize_workers(rows)}


def summarize_workers(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per setup: the median p99 of each refusal, and its spread (largest - smallest);
    per refusal: the median over rounds of w2's p99 / w1's p99; per setup the median web
    CPU of a burst (all its processes) and the largest process's share of it."""
    out: dict[str, Any] = {}
    for setup in WORKER_SETUPS:
        mine = [r for r in rows if r["setup"] == setup]
        p99 = {REFUSALS[k]: statistics.median(r["p99_ms"] for r in mine if r["kind"] == k)
               for k in REFUSALS}
        web_cpu = [sum(r["web_cpu_ms"]) for r in mine]
        busiest = [max(r["web_cpu_ms"]) / max(sum(r["web_cpu_ms"]), 1) for r in mine]
        out[setup] = {"p99_ms": p99, "p99_spread_ms": round(max(p99.values())
                                                            - min(p99.values()), 1),
                      "web_cpu_ms_per_burst": statistics.median(web_cpu),
                      "busiest_process_share": round(statistics.median(busiest), 2),
                      "daemons_cpu_ms_per_burst": statistics.median(
                          r["daemons_cpu_ms"] for r in mine),
                      "redis_cpu_ms_per_burst": statistics.median(
                          r["redis_cpu_ms"] for r in mine),
                      "client_cpu_ms_per_burst": statistics.median(
                          r["client_cpu_ms"] for r in mine),
                      "wall_ms": statistics.median(r["wall_ms"] for r in mine)}
    ratios = {}
    for kind, status in REFUSALS.items():
        per_round = []
        for r in sorted({row["round"] for row in rows}):
            pair = {row["setup"]: row["p99_ms"] for row in rows
                    if row["round"] == r and row["kind"] == kind}
            if pair.get("w1") and pair.get("w2"):
                per_round.append(pair["w2"] / pair["w1"])
        ratios[status] = round(statistics.median(per_round), 3) if per_round else None
    out["p99_ratio_w2_over_w1"] = ratios
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def print_workers(result: dict[str, Any]) -> None:
    summary = result["summary"]
    print(f"{'setup':<6} {'p99 401':>8} {'p99 503':>8} {'spread':>7} "
          f"{'web cpu':>8} {'busiest':>8} {'daemons':>8} {'redis':>6} {'client':>7} "
          f"{'wall':>6}")
    for setup in WORKER_SETUPS:
        s = summary[setup]
        p99 = s["p99_ms"]
        print(f"{setup:<6} {p99['401']:>8} {p99['503']:>8} "
              f"{s['p99_spread_ms']:>7} {s['web_cpu_ms_per_burst']:>8} "
              f"{s['busiest_process_share']:>8} {s['daemons_cpu_ms_per_burst']:>8} "
              f"{s['redis_cpu_ms_per_burst']:>6} {s['client_cpu_ms_per_burst']:>7} "
              f"{s['wall_ms']:>6}")
    print(f"p99 w2/w1 (median of rounds): {summary['p99_ratio_w2_over_w1']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds per routing mode")
    parser.add_argument("--burst", type=int, default=240)
    parser.add_argument("--burst-rounds", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=6, help="isolation pairs")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--parts", nargs="+", default=["conversations", "isolation", "refusals"],
                        help="or 'workers' alone: the refusals at WEB_WORKERS=1 vs 2")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"command: bench/fleet.py {' '.join(sys.argv[1:])}".rstrip())
    print(f"daemons: {DAEMONS} x {DAEMON_ENV}; workload: {TENANTS} tenants x {CONVERSATIONS} "
          f"conversations x {TURNS} turns, {AT_ONCE} at once, {NEW_TOKENS} new tokens")
    fleet = Fleet(args.redis_url)
    try:
        if args.parts == ["workers"]:
            # the bad key's burst measures a 401's cost, not the address's throttle (429)
            fleet.start({name: (n, {"AUTH_FAILURES_PER_MINUTE": "0"})
                         for name, n in WORKER_SETUPS.items()})
            by_workers = asyncio.run(refusals_by_workers(fleet, args.burst, args.burst_rounds))
            print_workers(by_workers)
            print(json.dumps({"bench": "fleet-web-workers", "machine": machine(),
                              "refusals_by_workers": by_workers}))
            return
        fleet.start()
        runs: list[dict[str, Any]] = []
        for r in range(args.rounds if "conversations" in args.parts else 0):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                result = asyncio.run(conversations(fleet, mode, r))
                runs.append(result)
                print(f"round {r} {mode}: {json.dumps(result)}", flush=True)
        iso = asyncio.run(isolation(fleet, args.pairs)) if "isolation" in args.parts else {}
        print(f"isolation: {json.dumps(iso)}", flush=True)
        refused = (asyncio.run(refusals(fleet, args.burst, args.burst_rounds))
                   if "refusals" in args.parts else {})
        print(f"refusals: {json.dumps(refused)}", flush=True)
    finally:
        fleet.close()
    summary: dict[str, Any] = {}
    for mode in MODES if runs else ():
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {name: statistics.median([r[name] for r in mine if r[name] is not None])
                         for name in ("cached_ratio", "ttft_p50_ms", "ttft_p90_ms", "imbalance",
                                      "refused_503")}
    if runs:
        rr, ca = summary["round_robin"], summary["cache_aware"]
        summary["ttft_p50_ratio"] = round(ca["ttft_p50_ms"] / rr["ttft_p50_ms"], 3)
        print(f"{'mode':<12} {'cached':>7} {'ttft p50':>9} {'ttft p90':>9} {'imbal.':>7} "
              f"{'503s':>5}")
        for mode in MODES:
            s = summary[mode]
            print(f"{mode:<12} {s['cached_ratio']:>7} {s['ttft_p50_ms']:>9} "
                  f"{s['ttft_p90_ms']:>9} {s['imbalance']:>7} {s['refused_503']:>5}")
        print(f"cache_aware / round_robin TTFT p50: {summary['ttft_p50_ratio']}")
    print(f"isolation TTFT diff {iso.get('ttft_diff_ms')} ms; "
          f"503 p99 - 401 p99: {refused.get('p99_diff_ms_median')} ms")
    print(json.dumps({"bench": "fleet", "machine": machine(), "runs": runs, "summary": summary,
                      "isolation": iso, "refusals": refused}))


if __name__ == "__main__":
    main()
