"""The web tier's capacity, with a stand-in engine: how many streams, how fast, at what cost.

The real web tier (daphne, Redis, the real daemon process with its intake, scheduler, event
writer and transport) serves streams whose tokens come from ``tests/standin_engine.py``
(``ENGINE_STANDIN``: no model; one decode call per ``1 / rate`` seconds, so every stream
gets ``rate`` tokens a second and the engine costs next to nothing). A redis-server of the
benchmark's own (a free port) keeps other work's commands out of its counts.

Modes (``--modes``):

- ``streams``: for each rate R (``--rates``), transport (``--transports``: sse, ws) and
  stream count N (``--streams``), N streams open together (one connection each), each
  asking for ``R * --seconds`` tokens; measured over the window where all N are streaming:
  delivered tokens/s, the gap between two chunks a client receives (p50/p99, against
  ``STREAM_INTERVAL_MS``), TTFT p50/p99 (request sent -> first chunk with text), the CPU
  of each process (web, daemon, redis, the client) per streamed token and as a share of
  one core, and Redis commands per token (INFO commandstats). A point *holds* when p99 gap
  <= 2 x STREAM_INTERVAL_MS, every stream ended with all its tokens, and the delivered
  rate is >= 95% of N x R; the first component to saturate is the one with the largest
  share of a core.
- ``idle``: ``--idle`` authenticated websockets held open on the web; the web processes'
  RSS before and after, per connection.
- ``compare``: the ``streams`` points on ``--candidate`` (A, this checkout by default)
  and ``--baseline`` (B) side by side, each round A then B (B then A on odd rounds); per
  point the median over rounds of the ratio A / B of the web's and the daemon's CPU per
  token, Redis commands per token, p99 gap and TTFT p50.
- ``requests``: short non-streamed requests (max_tokens 1; the stand-in at 1000 ticks/s)
  sent open-loop at rising rates; the highest rate whose p99 latency is <= 100 ms.

``--workers N``: N web processes (WEB_WORKERS) behind one port, as ``make run`` starts them.
Run:  .venv/bin/python bench/web_capacity.py [--modes streams idle requests]
      [--rates 20 100] [--streams 64 256 1024] [--transports sse ws] [--workers 1]
The last line printed is JSON: {"bench": "web_capacity", ...}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _common import ROOT, Stack, cpu_ms, free_port, machine, model_path

STANDIN = "tests.standin_engine:make_engine"
MODEL = "standin"
HOLD_GAP_FACTOR = 2.0  # a point holds at p99 gap <= this x STREAM_INTERVAL_MS


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    """``pid`` and its descendants (a supervisor's daemon, a parent's daphnes)."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    kids: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        kids.setdefault(pp, []).append(p)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += kids.get(p, [])
    return found


class Redis:
    """A redis-server of the benchmark's own, on a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="bench-redis-"))
        self.proc = subprocess.Popen(
            [shutil.which("redis-server") or "redis-server", "--port", str(self.port), "--bind",
             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def commands(self) -> dict[str, int]:
        """Calls so far by command (INFO commandstats)."""
        return {k.removeprefix("cmdstat_"): v["calls"]
                for k, v in self.client.info("commandstats").items()}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


# -- the client: one process per share of the streams --------------------------------------

async def sse_stream(port: int, key: str, max_tokens: int, t_start: float, out: dict) -> None:
    """One streamed chat completion over a raw socket: arrival times of the reads that
    carry text, the usage's completion tokens."""
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
                       "max_tokens": max_tokens, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    while time.monotonic() < t_start:
        await asyncio.sleep(t_start - time.monotonic())
    sent = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port, limit=2**20)
    writer.write(head + body)
    arrivals: list[float] = []
    tail = b""
    status = None
    try:
        while True:
            data = await reader.read(65536)
            if not data:
                break
            now = time.monotonic()
            if status is None:
                status = int(data.split(b" ", 2)[1])
            if b'"content"' in data:
                arrivals.append(now)
            tail = (tail + data)[-4096:]
    finally:
        writer.close()
    tokens = 0
    marker = tail.rfind(b'"completion_tokens":')
    if marker >= 0:
        tokens = int(tail[marker + 20:].split(b",", 1)[0].split(b"}", 1)[0])
    out["streams"].append({"sent": sent, "arrivals": arrivals, "tokens": tokens,
                           "status": status})


async def ws_stream(port: int, key: str, max_tokens: int, t_start: float, out: dict) -> None:
    from websockets.asyncio.client import connect

    while time.monotonic() < t_start:
        await asyncio.sleep(t_start - time.monotonic())
    sent = time.monotonic()
    arrivals: list[float] = []
    tokens, status = 0, None
    async with connect(f"ws://127.0.0.1:{port}/ws/v1/stream", open_timeout=60,
                       additional_headers={"Authorization": f"Bearer {key}"},
                       max_queue=None) as ws:
        await ws.send(json.dumps({"type": "chat.completions", "id": 1, "model": MODEL,
                                  "messages": [{"role": "user", "content": "Hi there"}],
                                  "max_tokens": max_tokens}))
        async for message in ws:
            now = time.monotonic()
            if '"token"' in message[:20]:
                arrivals.append(now)
                continue
            event = json.loads(message)
            if event["type"] == "done":
                tokens, status = event["usage"]["completion_tokens"], 200
                break
            if event["type"] == "error":
                status = event.get("status", 500)
                break
        await ws.close()
    out["streams"].append({"sent": sent, "arrivals": arrivals, "tokens": tokens,
                           "status": status})


def client_main(transport: str, port: int, key: str, n: int, max_tokens: int,
                t_start: float, spread_s: float, queue: Any) -> None:
    out: dict = {"streams": [], "errors": []}

    async def main() -> None:
        stream = sse_stream if transport == "sse" else ws_stream

        async def one(i: int) -> None:
            try:
                await stream(port, key, max_tokens, t_start + spread_s * i / max(n, 1), out)
            except Exception as exc:  # noqa: BLE001 - counted, the point then fails
                out["errors"].append(repr(exc)[:200])

        await asyncio.gather(*(one(i) for i in range(n)))

    t0 = time.process_time()
    asyncio.run(main())
    out["cpu_ms"] = (time.process_time() - t0) * 1000
    queue.put(out)


# -- the stack ----------------------------------------------------------------------------

class StandinStack:
    """``bench/_common.Stack`` with the stand-in engine at ``rate`` ticks/s and room for
    ``max_streams`` streams, on the benchmark's own Redis."""

    def __init__(self, redis: Redis, rate: float, max_streams: int, workers: int,
                 interval_ms: int, env: dict[str, str], root: Path = ROOT) -> None:
        per_stream = 64 + int(rate * 40)
        self.redis = redis
        self.stack = Stack(redis.url, n_parallel=max_streams, threads=1, model=MODEL,
                           root=root, workers=workers, env={
            "ENGINE_STANDIN": STANDIN, "ENGINE_STANDIN_RATE": str(rate),
            "MODEL_PATH": model_path(), "N_PARALLEL": str(max_streams),
            "LOCAL_QUEUE": str(max_streams), "N_CTX": str(max_streams * per_stream),
            "N_BATCH": str(max(2048, max_streams * 16)), "CHUNK_SIZE": "512",
            "MAX_QUEUE": str(max_streams * 4), "MAX_QUEUE_PER_TENANT": str(max_streams * 4),
            "WEB_MAX_STREAMS": str(max_streams * 2), "WEB_TENANT_STREAMS": str(max_streams * 2),
            "WEB_WORKERS": str(workers), "PREEMPTION": "false", "EMBEDDINGS": "false",
            "STREAM_INTERVAL_MS": str(interval_ms), "KV_TENANT_SHARE": "1.0",
            # a GPU's setting: every arrival's prefill in the next tick (the CPU default, 1,
            # would admit one stream per tick)
            "PREFILL_PROMPTS_PER_TICK": "0",
            **env})
        self.workers = workers

    def open(self) -> str:
        return self.stack.open()

    @property
    def port(self) -> int:
        return self.stack.port

    def pids(self) -> dict[str, list[int]]:
        daemon, web = self.stack.procs[0], self.stack.procs[1:]
        return {"web": [pid for proc in web for pid in children(proc.pid)],
                "daemon": children(daemon.pid), "redis": [self.redis.proc.pid]}

    def close(self) -> None:
        self.stack.close()


def cpu_of(pids: dict[str, list[int]]) -> dict[str, float]:
    total = {}
    for name, group in pids.items():
        ms = 0.0
        for pid in group:
            try:
                ms += cpu_ms(pid)
            except OSError:
                pass
        total[name] = ms
    return total


def run_streams(stack: StandinStack, key: str, transport: str, n: int, rate: float,
                seconds: float, interval_ms: int, clients: int, profile: str | None = None
                ) -> dict[str, Any]:
    """One point: ``n`` streams at ``rate`` tokens/s each."""
    max_tokens = int(rate * seconds)
    spread_s = min(2.0, n / 500)  # connections opened over this long (a burst, not a storm)
    t_start = time.monotonic() + 0.5
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    shares = [n // clients + (1 if i < n % clients else 0) for i in range(clients)]
    pids = stack.pids()
    cpu0, cmd0, wall0 = cpu_of(pids), stack.redis.commands(), time.monotonic()
    spies = [subprocess.Popen(  # sampled stacks of each process, for the breakdown
        [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"), "record",
         "--threads", "--format", "raw", "-r", "100", "-d", str(int(seconds + 3)), "-o",
         str(Path(profile) / f"{name}-{transport}-{n}-{i}.txt"), "-p", str(pid)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for name in ("web", "daemon") for i, pid in enumerate(pids[name])] if profile else []
    procs = [ctx.Process(target=client_main, args=(transport, stack.port, key, share,
                                                   max_tokens, t_start, spread_s, queue))
             for share in shares if share]
    for p in procs:
        p.start()
    samples: list[tuple[float, dict[str, float]]] = []  # (time, CPU so far), each second
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(1.0):
            samples.append((time.monotonic(), cpu_of(pids)))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results = [queue.get(timeout=seconds * 4 + 120) for _ in procs]
    stop.set()
    sampler.join()
    for p in procs:
        p.join()
    for spy in spies:
        spy.wait()
    wall = time.monotonic() - wall0
    cpu1, cmd1 = cpu_of(pids), stack.redis.commands()
    by_command = {k: n - cmd0.get(k, 0) for k, n in cmd1.items() if n > cmd0.get(k, 0)}
    streams = [s for r in results for s in r["streams"]]
    errors = [e for r in results for e in r["errors"]]
    client_cpu = sum(r["cpu_ms"] for r in results)
    # the window where every stream is streaming: from the last first chunk to the first end
    firsts = [s["arrivals"][0] for s in streams if s["arrivals"]]
    lasts = [s["arrivals"][-1] for s in streams if s["arrivals"]]
    w0, w1 = (max(firsts), min(lasts)) if firsts else (0, 0)
    gaps, ttfts = [], []
    for s in streams:
        a = s["arrivals"]
        if a:
            ttfts.append((a[0] - s["sent"]) * 1000)
        gaps += [(y - x) * 1000 for x, y in zip(a, a[1:], strict=False) if x >= w0 and y <= w1]
    tokens = sum(s["tokens"] for s in streams)
    complete = sum(1 for s in streams if s["tokens"] == max_tokens)
    window = max(w1 - w0, 1e-9)
    # tokens delivered in the window: each stream's share of its tokens in that window
    in_window = sum(s["tokens"] * sum(1 for t in s["arrivals"] if w0 <= t <= w1)
                    / max(len(s["arrivals"]), 1) for s in streams)
    delivered = in_window / window if w1 > w0 else 0.0
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    cpu["client"] = client_cpu
    share = {k: round(v / wall / 10, 1) for k, v in cpu.items()}  # % of one core
    # each process's share of a core over the seconds inside the window (the steady state)
    steady = [(t1 - t0, {k: c1[k] - c0[k] for k in c1})
              for (t0, c0), (t1, c1) in zip(samples, samples[1:], strict=False)
              if t0 >= w0 and t1 <= w1]
    steady_share = {k: round(sum(d[k] for _, d in steady) / sum(t for t, _ in steady) / 10, 1)
                    for k in cpu0} if steady else {}
    gap_p99 = percentile(gaps, 0.99)
    holds = (not errors and complete == n and w1 > w0
             and gap_p99 <= HOLD_GAP_FACTOR * interval_ms and delivered >= 0.95 * n * rate)
    point = {
        "transport": transport, "streams": n, "rate": rate, "holds": holds,
        "complete": complete, "errors": len(errors), "error_sample": errors[:3],
        "statuses": sorted({s["status"] for s in streams if s["status"] != 200}),
        "delivered_tok_s": round(delivered, 1), "target_tok_s": n * rate,
        "window_s": round(w1 - w0, 2),
        "gap_p50_ms": round(percentile(gaps, 0.5), 1), "gap_p99_ms": round(gap_p99, 1),
        "ttft_p50_ms": round(percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(percentile(ttfts, 0.99), 1),
        "cpu_ms_per_token": {k: round(v / max(tokens, 1), 4) for k, v in cpu.items()},
        "core_share_pct": share,
        "steady_core_share_pct": steady_share,
        "saturating": max((k for k in share if k != "client"),
                          key=(steady_share or share).get),
        "redis_cmds_per_token": round(sum(by_command.values()) / max(tokens, 1), 3),
        "redis_cmds_per_token_by_command": {
            k: round(n / max(tokens, 1), 4)
            for k, n in sorted(by_command.items(), key=lambda kv: -kv[1])[:8]},
        "tokens": tokens,
    }
    print(json.dumps(point), flush=True)
    return point


async def hold_idle(port: int, key: str, n: int, ready: Any, release: Any) -> None:
    from websockets.asyncio.client import connect

    sockets = []
    for _ in range(n):
        ws = await connect(f"ws://127.0.0.1:{port}/ws/v1/stream", open_timeout=60,
                           additional_headers={"Authorization": f"Bearer {key}"})
        sockets.append(ws)
    ready.set()
    while not release.is_set():
        await asyncio.sleep(0.1)
    for ws in sockets:
        await ws.close()


def idle_main(port: int, key: str, n: int, ready: Any, release: Any) -> None:
    asyncio.run(hold_idle(port, key, n, ready, release))


def run_idle(stack: StandinStack, key: str, n: int) -> dict[str, Any]:
    web = stack.pids()["web"]
    time.sleep(1)
    before = sum(rss_kb(p) for p in web)
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=idle_main, args=(stack.port, key, n, ready, release))
    proc.start()
    if not ready.wait(300):
        proc.kill()
        raise RuntimeError("the idle websockets did not open")
    time.sleep(2)
    after = sum(rss_kb(p) for p in web)
    release.set()
    proc.join(60)
    point = {"idle_websockets": n, "web_rss_before_kb": before, "web_rss_after_kb": after,
             "kb_per_connection": round((after - before) / n, 1)}
    print(json.dumps(point), flush=True)
    return point


async def fire(port: int, key: str, rate: float, seconds: float) -> list[tuple[int, float]]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                       "max_tokens": 1}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    results: list[tuple[int, float]] = []

    async def one() -> None:
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            data = await reader.read()
            writer.close()
            results.append((int(data.split(b" ", 2)[1]), (time.monotonic() - t0) * 1000))
        except (OSError, IndexError, ValueError):
            results.append((0, (time.monotonic() - t0) * 1000))

    tasks = []
    t_start = time.monotonic()
    for i in range(int(rate * seconds)):
        delay = t_start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return results


def run_requests(stack: StandinStack, key: str, rates: list[float], seconds: float
                 ) -> dict[str, Any]:
    points, best = [], 0.0
    for rate in rates:
        results = asyncio.run(fire(stack.port, key, rate, seconds))
        ok = [ms for status, ms in results if status == 200]
        p99 = percentile([ms for _, ms in results], 0.99)
        point = {"rate_rps": rate, "ok": len(ok), "sent": len(results),
                 "p50_ms": round(percentile(ok, 0.5), 1), "p99_ms": round(p99, 1)}
        print(json.dumps(point), flush=True)
        points.append(point)
        if len(ok) == len(results) and p99 <= 100:
            best = rate
        else:
            break
    return {"points": points, "capacity_rps_p99_le_100ms": best}


def compare(redis: Redis, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    """This checkout (A) against ``--baseline`` (B), side by side: each round runs every
    point on A then B (B then A on odd rounds); per point, the median over rounds of the
    per-round ratio A/B of the web's CPU per token, Redis commands per token and p99 gap."""
    sides = {"A": (args.candidate or ROOT).resolve(), "B": args.baseline.resolve()}
    rows: dict[tuple, dict[str, list[dict]]] = {}
    for r in range(args.rounds):
        for side in (["A", "B"] if r % 2 == 0 else ["B", "A"]):
            for rate in args.rates:
                stack = StandinStack(redis, rate, max(args.streams), args.workers,
                                     args.interval_ms, env, root=sides[side])
                key = stack.open()
                try:
                    for transport in args.transports:
                        for n in args.streams:
                            point = run_streams(stack, key, transport, n, rate, args.seconds,
                                                args.interval_ms, args.clients)
                            point["side"], point["round"] = side, r
                            rows.setdefault((transport, rate, n), {}).setdefault(
                                side, []).append(point)
                finally:
                    stack.close()
    out = []
    for (transport, rate, n), by_side in rows.items():
        ratios: dict[str, list[float]] = {}
        for a, b in zip(by_side["A"], by_side["B"], strict=True):
            for name, value in (("web_cpu_per_token", lambda p: p["cpu_ms_per_token"]["web"]),
                                ("daemon_cpu_per_token",
                                 lambda p: p["cpu_ms_per_token"]["daemon"]),
                                ("redis_cmds_per_token", lambda p: p["redis_cmds_per_token"]),
                                ("gap_p99", lambda p: p["gap_p99_ms"]),
                                ("ttft_p50", lambda p: p["ttft_p50_ms"])):
                if value(b):
                    ratios.setdefault(name, []).append(value(a) / value(b))
        summary = {"transport": transport, "rate": rate, "streams": n,
                   "A_holds": [p["holds"] for p in by_side["A"]],
                   "B_holds": [p["holds"] for p in by_side["B"]],
                   **{f"{k}_A_over_B": {"median": round(statistics.median(v), 3),
                                         "min": round(min(v), 3), "max": round(max(v), 3)}
                      for k, v in ratios.items()},
                   "A": {k: [p[k] for p in by_side["A"]] for k in SUMMARY_KEYS},
                   "B": {k: [p[k] for p in by_side["B"]] for k in SUMMARY_KEYS}}
        print(json.dumps(summary), flush=True)
        out.append(summary)
    return {"candidate": str(sides["A"]), "baseline": str(sides["B"]), "rounds": args.rounds,
            "points": out}


SUMMARY_KEYS = ("gap_p50_ms", "gap_p99_ms", "ttft_p50_ms", "delivered_tok_s",
                "redis_cmds_per_token")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", default=["streams", "idle", "requests"])
    parser.add_argument("--rates", nargs="+", type=float, default=[20, 100])
    parser.add_argument("--streams", nargs="+", type=int, default=[64, 256, 1024])
    parser.add_argument("--transports", nargs="+", default=["sse", "ws"])
    parser.add_argument("--seconds", type=float, default=8.0, help="each stream's length")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--idle", type=int, default=1000)
    parser.add_argument("--request-rates", nargs="+", type=float,
                        default=[50, 100, 200, 300, 400, 600, 800])
    parser.add_argument("--interval-ms", type=int, default=50, help="STREAM_INTERVAL_MS")
    parser.add_argument("--baseline", type=Path,
                        help="compare mode: the other checkout (B), run side by side with "
                        "this one (A) in alternating rounds")
    parser.add_argument("--candidate", type=Path,
                        help="compare mode: the checkout measured as A (default: this one)")
    parser.add_argument("--rounds", type=int, default=3, help="compare mode's rounds")
    parser.add_argument("--profile", help="a folder: py-spy's sampled stacks of the web "
                        "and daemon processes during each streams point (py-spy installed)")
    parser.add_argument("--env", nargs="*", default=[], help="NAME=VALUE settings on top")
    parser.add_argument("--stop-after-fail", action="store_true",
                        help="per rate and transport, stop at the first point that fails")
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    os.chdir(ROOT)
    redis = Redis()
    result: dict[str, Any] = {"bench": "web_capacity", "machine": machine(),
                              "workers": args.workers, "interval_ms": args.interval_ms,
                              "env": env, "streams": [], "saturation": {}}
    try:
        if "streams" in args.modes:
            for rate in args.rates:
                stack = StandinStack(redis, rate, max(args.streams), args.workers,
                                     args.interval_ms, env)
                key = stack.open()
                try:
                    for transport in args.transports:
                        held = 0
                        for n in args.streams:
                            point = run_streams(stack, key, transport, n, rate, args.seconds,
                                                args.interval_ms, args.clients, args.profile)
                            result["streams"].append(point)
                            if point["holds"]:
                                held = max(held, n)
                            elif args.stop_after_fail:
                                break
                        result["saturation"][f"{transport}@{rate:g}"] = held
                finally:
                    stack.close()
        if "compare" in args.modes:
            result["compare"] = compare(redis, args, env)
        if "idle" in args.modes or "requests" in args.modes:
            stack = StandinStack(redis, 1000.0, max(args.idle, 256), args.workers,
                                 args.interval_ms, env)
            key = stack.open()
            try:
                if "idle" in args.modes:
                    result["idle"] = run_idle(stack, key, args.idle)
                if "requests" in args.modes:
                    result["requests"] = run_requests(stack, key, args.request_rates, 5.0)
            finally:
                stack.close()
    finally:
        redis.close()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
