"""Soak: N minutes of streamed load with disconnecting clients and daemon kills (issue #14).

What runs: a Redis of its own (redis-server on a free port, no persistence; or --redis-url),
daphne and one ``run_scheduler`` daemon (N_PARALLEL 4, service defaults otherwise: prefix
cache on, STREAM_INTERVAL_MS) on a temporary SQLite database, two tenants with a key each.
What it does, for --minutes (default 30):
  - 4 workers, each streaming one request after another (SSE, ``stream: true``,
    ``stream_options.include_usage``): completions and chat (one in three), max_tokens drawn
    from 16..256, ignore_eos on half of them, a tenant each drawn at random (seeded:
    --seed), every prompt unique (a run nonce and the request number) after a per-tenant
    shared prefix;
  - every 20th request (--leave-every) the client leaves mid-stream: reads 3 text chunks,
    then aborts the socket. Every other one of those comes back 1 s later with
    ``GET /v1/requests/<id>/events`` + ``Last-Event-ID`` ("reconnected"); the rest never
    come back ("abandoned": their history row should end ``cancelled``, at once or
    RESUME_GRACE_S later);
  - every --kill-every minutes (default 10) the daemon is killed with SIGKILL and started
    again at once under the same ``--daemon-id`` (what ``run_scheduler --supervise`` does):
    the requests it was streaming must be continued by the new one (``"resumed": n`` in
    their ``done`` event, read from Redis ``llm:events:<id>`` as each request ends: the SSE
    chunks do not carry it) and the queued ones served;
  - every 10 s the RSS (VmRSS) of daphne and of the daemon (whichever process is current)
    is sampled.
What it prints: the machine, the command, the settings; requests completed; errors by code
(``sse <code>`` for an SSE error chunk, ``http <status> <code>`` for a refusal,
``client <exception>`` for a broken or stalled connection); refusals the client retried
(429/503 with Retry-After, as the OpenAI SDKs do); the resumed count; the requests in
flight at each kill and how they ended; p50/p99 TTFT (request sent -> first chunk with
text) per 5-minute window by start time; the RSS slopes (least squares, MB per 10 min) over
the samples after the first --warmup-minutes (default 5): daphne over all of them; the
daemon *within runs* (one slope shared by all its runs, each run with its own intercept,
so the restart steps do not count; each run's first --settle-s seconds, the model load,
left out), and each run's own slope. The daemon's target slope is of its RSS less its
prompt RAM cache's bytes (``cache.ram_bytes`` of its Redis snapshot): that cache fills up
to PROMPT_CACHE_RAM_MB (256) by design after every restart, which would otherwise read
as a leak; the raw RSS slope is printed next to it. Then PASS/FAIL per target (the exit
status is 0 either way) and, as the last line, JSON.
Targets (issue #14): RSS slope < 5 MB per 10 min (daphne and daemon); no error other than
the deliberate disconnects; every request in flight at a kill completed (continued).
Run:  .venv/bin/python bench/soak.py [--minutes 30] [--kill-every 10]
      quick check: --minutes 3 --kill-every 1.5 --warmup-minutes 1
Every wait has a timeout; the processes it started are stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import secrets
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import redis.asyncio as aioredis
from _common import ROOT, Stack, free_port, machine  # (also puts the project on sys.path)

from config.listen import daphne_endpoint
from wire import protocol

WORKERS = 4
STALL_S = 120.0  # the longest silence a stream may keep (keep-alives come every 15 s)
REQUEST_CAP_S = 900.0  # one request, all of it
REFUSAL_RETRIES = 2  # like the OpenAI SDKs' max_retries
TEXT_CHUNKS_BEFORE_LEAVING = 3
TOPICS = ["rivers", "mountains", "trains", "bread", "stars", "gardens", "cities", "music",
          "bridges", "clocks", "islands", "libraries"]


# -- the requests ---------------------------------------------------------------------------


@dataclass
class Result:
    n: int
    tenant: str
    kind: str  # "completion" | "chat"
    max_tokens: int
    ignore_eos: bool
    leave: str | None  # None, "abandon" or "reconnect"
    start: float = 0.0  # seconds since the soak started
    end: float | None = None
    ttft: float | None = None
    request_id: str | None = None
    last_event_id: str | None = None
    text_chunks: int = 0
    max_gap_s: float = 0.0  # the longest wait between two chunks with text (a kill's pause)
    _last_text: float | None = None
    finish_reason: str | None = None
    completion_tokens: int | None = None
    error: str | None = None  # "sse <code>", "http <status> <code>", "client <exception>"
    refusals: list[str] = field(default_factory=list)  # retried 429/503s
    resumed: int = 0  # from the done event in Redis
    at_kill: list[int] = field(default_factory=list)  # kills it was in flight at
    reconnect_finish: str | None = None
    reconnect_error: str | None = None
    row_status: str | None = None  # abandoned: the history row's status at the end


class Refused(Exception):
    def __init__(self, status: int, code: str, retry_after: float | None) -> None:
        super().__init__(f"http {status} {code}")
        self.status, self.code, self.retry_after = status, code, retry_after


async def _line(reader: asyncio.StreamReader) -> bytes:
    line = await asyncio.wait_for(reader.readline(), STALL_S)
    if not line:
        raise ConnectionError("the server closed the connection")
    return line


async def _open(port: int, method: str, path: str, key: str, body: bytes | None = None,
                headers: dict[str, str] | None = None):
    """(reader, writer, status, headers) of an HTTP/1.0 request (no chunked encoding)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
    head = [f"{method} {path} HTTP/1.0", "Host: 127.0.0.1", f"Authorization: Bearer {key}"]
    for name, value in (headers or {}).items():
        head.append(f"{name}: {value}")
    if body is not None:
        head += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + (body or b""))
    await writer.drain()
    status = int((await _line(reader)).split()[1])
    got: dict[str, str] = {}
    while (line := await _line(reader)) not in (b"\r\n", b"\n"):
        name, _, value = line.decode("latin-1").partition(":")
        got[name.strip().lower()] = value.strip()
    if status != 200:
        raw = await asyncio.wait_for(reader.read(), 30)
        writer.close()
        try:
            code = json.loads(raw)["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = "?"
        retry = got.get("retry-after")
        raise Refused(status, code, float(retry) if retry else None)
    return reader, writer, status, got


async def _sse(reader: asyncio.StreamReader, result: Result, t0: float | None,
               leave_after: int | None) -> bool:
    """Read SSE events into ``result`` until [DONE]; False if it left after ``leave_after``
    text chunks (the caller aborts the socket)."""
    event_id = None
    while True:
        line = await _line(reader)
        if line.startswith(b"id: "):
            event_id = line[4:].strip().decode()
            continue
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if event_id:
            result.last_event_id = event_id
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            result.error = result.error or f"sse {chunk['error'].get('code')}"
            continue
        if chunk.get("usage"):
            result.completion_tokens = chunk["usage"]["completion_tokens"]
        for choice in chunk.get("choices") or []:
            text = choice.get("text") if "text" in choice else \
                (choice.get("delta") or {}).get("content")
            if text:
                result.text_chunks += 1
                now = time.perf_counter()
                if result._last_text is not None:
                    result.max_gap_s = max(result.max_gap_s, now - result._last_text)
                result._last_text = now
                if t0 is not None and result.ttft is None:
                    result.ttft = time.perf_counter() - t0
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if leave_after is not None and result.text_chunks >= leave_after \
                and result.finish_reason is None:
            return False


def _abort(writer: asyncio.StreamWriter) -> None:
    transport = writer.transport
    if transport is not None and not transport.is_closing():
        transport.abort()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.nonce = secrets.token_hex(4)
        self.counter = 0
        self.results: list[Result] = []
        self.in_flight: set[int] = set()  # indexes into results
        self.kills: list[dict] = []
        self.samples: list[dict] = []  # {"t", "daphne", "daemon", "run", "redis"}
        self.t_start = 0.0
        self.stopping = False
        self.redis_proc: subprocess.Popen | None = None
        self.redis_keys: dict[str, int] | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-soak-"))
        self.stack: Stack | None = None
        self.keys: dict[str, str] = {}
        self.daemon_id = f"soak-{self.nonce}"
        self.daemon_started: list[float] = []  # soak seconds at each daemon start (run index)
        self.prefixes = {
            tenant: f"You are the {tenant} tenant's writing assistant. " + " ".join(
                f"Rule {i}: be concise, concrete and friendly about {TOPICS[i]}."
                for i in range(10))
            for tenant in ("soak-a", "soak-b")
        }

    # -- processes ----------------------------------------------------------------------------

    def start(self) -> None:
        redis_url = self.args.redis_url
        if redis_url is None:
            if not shutil.which("redis-server"):
                raise SystemExit("no redis-server on PATH: pass --redis-url")
            port = free_port()
            self.redis_proc = subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.tmp)],
                stdout=(self.tmp / "redis.log").open("ab"), stderr=subprocess.STDOUT,
                start_new_session=True)
            redis_url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 30
            while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                                 text=True, timeout=10).stdout.strip() != "PONG":
                if time.monotonic() > deadline or self.redis_proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start; see {self.tmp}/redis.log")
                time.sleep(0.2)
        self.redis_url = redis_url
        stack = Stack(redis_url, WORKERS, self.args.threads, f"soak-{self.nonce}", tmp=self.tmp)
        stack.env.pop("CACHE_PROMPT")  # the service's default (on), as deployed
        stack.env.pop("N_THREADS")
        if self.args.threads:
            stack.env["N_THREADS"] = str(self.args.threads)
        self.stack = stack
        stack.manage("migrate", "-v", "0")
        for tenant in self.prefixes:
            self.keys[tenant] = stack.create_key(tenant)
        self.daemon = self._start_daemon()
        self.daphne = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-e", daphne_endpoint("127.0.0.1", stack.port),
             "config.asgi:application"],
            cwd=ROOT, env=stack.env, stdout=(self.tmp / "daphne.log").open("ab"),
            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while not stack.model_served():
            if time.monotonic() > deadline or self.daphne.poll() is not None \
                    or self.daemon.poll() is not None:
                raise RuntimeError(f"the service did not start; see {self.tmp}")
            time.sleep(0.5)

    def _start_daemon(self) -> subprocess.Popen:
        assert self.stack is not None
        self.daemon_started.append(time.monotonic() - self.t_start if self.t_start else 0.0)
        return subprocess.Popen(
            [sys.executable, "manage.py", "run_scheduler", "--grace", "1",
             "--daemon-id", self.daemon_id],
            cwd=ROOT, env={**self.stack.env, "LOG_LEVEL": "INFO"},
            stdout=(self.tmp / "daemon.log").open("ab"), stderr=subprocess.STDOUT,
            start_new_session=True)

    def close(self) -> None:
        """Stop daphne, the daemon and our Redis (SIGTERM, then SIGKILL after 30 s). A second
        Ctrl-C does not cut this short (it would leave processes behind)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
        for name in ("daphne", "daemon"):
            proc = getattr(self, name, None)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
        if self.redis_proc is None and self.stack is not None:  # someone else's Redis
            with contextlib.suppress(Exception):
                import redis

                client = redis.Redis.from_url(self.redis_url, socket_timeout=10)
                client.delete(protocol.jobs_stream(self.stack.model),
                              protocol.daemon_key(self.daemon_id),
                              protocol.running_key(self.daemon_id))
                client.zrem(protocol.DAEMONS_ZSET, self.daemon_id)
        if self.redis_proc is not None and self.redis_proc.poll() is None:
            self.redis_proc.terminate()
            try:
                self.redis_proc.wait(30)
            except subprocess.TimeoutExpired:
                self.redis_proc.kill()
                self.redis_proc.wait(10)
        if self.args.keep_logs:
            print(f"logs and database kept in {self.tmp}")
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- load ----------------------------------------------------------------------------------

    def _next(self) -> Result:
        n = self.counter
        self.counter += 1
        rng = self.rng
        tenant = rng.choice(list(self.prefixes))
        kind = "chat" if rng.random() < 1 / 3 else "completion"
        max_tokens = rng.randint(16, 256)
        ignore_eos = rng.random() < 0.5
        leave = None
        if (n + 1) % self.args.leave_every == 0:
            leave = "reconnect" if ((n + 1) // self.args.leave_every) % 2 else "abandon"
            # long enough to still be streaming after a few chunks
            max_tokens, ignore_eos = max(max_tokens, 160), True
        return Result(n, tenant, kind, max_tokens, ignore_eos, leave)

    def _body(self, r: Result) -> tuple[str, bytes]:
        rng = random.Random(f"{self.args.seed}-{r.n}")
        ask = (f"Request {self.nonce}-{r.n}: write about {rng.choice(TOPICS)}. "
               + "Give details and examples. " * rng.randint(1, 12))
        body = {"model": self.stack.model, "max_tokens": r.max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.8,
                "seed": r.n, "ignore_eos": r.ignore_eos}
        if r.kind == "chat":
            body["messages"] = [{"role": "system", "content": self.prefixes[r.tenant]},
                                {"role": "user", "content": ask}]
            return "/v1/chat/completions", json.dumps(body).encode()
        body["prompt"] = self.prefixes[r.tenant] + "\n\n" + ask
        return "/v1/completions", json.dumps(body).encode()

    async def _one(self, r: Result) -> None:
        path, body = self._body(r)
        key = self.keys[r.tenant]
        port = self.stack.port
        for attempt in range(REFUSAL_RETRIES + 1):
            t0 = time.perf_counter()
            try:
                reader, writer, _, headers = await _open(port, "POST", path, key, body)
                break
            except Refused as exc:
                if exc.status not in (429, 503) or attempt == REFUSAL_RETRIES:
                    r.error = str(exc)
                    return
                r.refusals.append(str(exc))
                await asyncio.sleep(min(exc.retry_after or 1.0, 30.0))
        r.request_id = headers.get("x-request-id")
        leave_after = TEXT_CHUNKS_BEFORE_LEAVING if r.leave else None
        try:
            finished = await _sse(reader, r, t0, leave_after)
        finally:
            _abort(writer)
        if finished:
            await self._read_done(r)
            return
        if r.leave == "reconnect":  # come back after a pause, where we left
            await asyncio.sleep(1.0)
            await self._reconnect(r)

    async def _reconnect(self, r: Result) -> None:
        again = Result(r.n, r.tenant, r.kind, r.max_tokens, r.ignore_eos, None)
        try:
            reader, writer, _, _ = await _open(
                self.stack.port, "GET", f"/v1/requests/{r.request_id}/events?include_usage=true",
                self.keys[r.tenant], headers={"Last-Event-ID": r.last_event_id or "0-0"})
            try:
                await _sse(reader, again, None, None)
            finally:
                _abort(writer)
            r.reconnect_finish, r.reconnect_error = again.finish_reason, again.error
            r.completion_tokens = again.completion_tokens
            await self._read_done(r)
        except Refused as exc:
            r.reconnect_error = str(exc)
        except Exception as exc:
            r.reconnect_error = f"client {type(exc).__name__}"

    async def _read_done(self, r: Result) -> None:
        """``resumed`` from the request's last event in Redis (the SSE chunks lack it)."""
        if not r.request_id:
            return
        entries = await self.redis.xrevrange(protocol.events_stream(r.request_id), count=1)
        if entries:
            kind, data = protocol.decode_event(entries[0][1])
            r.resumed = int(data.get("resumed") or 0)

    async def worker(self, end_at: float) -> None:
        while not self.stopping and time.monotonic() < end_at:
            r = self._next()
            r.start = time.monotonic() - self.t_start
            self.results.append(r)
            self.in_flight.add(r.n)
            try:
                await asyncio.wait_for(self._one(r), REQUEST_CAP_S)
            except Exception as exc:  # counted, never fatal: a soak goes on
                r.error = r.error or f"client {type(exc).__name__}"
            finally:
                self.in_flight.discard(r.n)
                r.end = time.monotonic() - self.t_start
            if r.error:
                await asyncio.sleep(1.0)  # no tight loop against a failing service

    async def killer(self, end_at: float) -> None:
        if not self.args.kill_every:
            return
        every = self.args.kill_every * 60
        k = 1
        while True:
            at = self.t_start + k * every
            if at >= end_at:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            flight = sorted(self.in_flight)
            old = self.daemon.pid
            self.daemon.kill()
            await asyncio.to_thread(self.daemon.wait, 30)
            for n in flight:
                self.results[n].at_kill.append(k)
            self.daemon = self._start_daemon()
            self.kills.append({"at_s": round(time.monotonic() - self.t_start, 1),
                               "pid": old, "new_pid": self.daemon.pid, "in_flight": flight})
            print(f"[{time.monotonic() - self.t_start:7.1f}s] kill -9 daemon {old} "
                  f"with {len(flight)} requests in flight; restarted as {self.daemon.pid}",
                  flush=True)
            k += 1

    async def sampler(self) -> None:
        while not self.stopping:
            t = time.monotonic() - self.t_start
            sample = {"t": round(t, 1), "daphne": rss_mb(self.daphne.pid),
                      "daemon": rss_mb(self.daemon.pid), "run": len(self.daemon_started) - 1}
            if self.redis_proc is not None:
                sample["redis"] = rss_mb(self.redis_proc.pid)
            sample["cache"] = await self._ram_cache_mb(self.daemon.pid)
            if sample["daemon"] is not None and sample["cache"] is not None:
                sample["daemon_net"] = round(sample["daemon"] - sample["cache"], 1)
            self.samples.append(sample)
            if self.daphne.poll() is not None:
                print("daphne exited: stopping the soak", flush=True)
                self.stopping = True
                return
            done = sum(1 for r in self.results if r.end is not None)
            print(f"[{t:7.1f}s] rss daphne {sample['daphne']} MB, daemon {sample['daemon']} MB "
                  f"(prompt RAM cache {sample['cache']} MB); "
                  f"{done} requests ended, {len(self.in_flight)} in flight", flush=True)
            await asyncio.sleep(self.args.sample_s)

    async def _ram_cache_mb(self, pid: int) -> float | None:
        """The daemon's prompt RAM cache (bounded by PROMPT_CACHE_RAM_MB), from its Redis
        snapshot, if the snapshot is that process's."""
        try:
            raw = await self.redis.get(protocol.daemon_key(self.daemon_id))
            snap = json.loads(raw) if raw else None
        except Exception:
            return None
        if not snap or snap.get("pid") != pid:
            return None
        return round((snap.get("cache") or {}).get("ram_bytes", 0) / 2**20, 1)

    async def run(self) -> None:
        self.redis = aioredis.Redis.from_url(self.redis_url, socket_timeout=10)
        self.t_start = time.monotonic()
        self.daemon_started = [0.0]
        end_at = self.t_start + self.args.minutes * 60
        loop = asyncio.get_running_loop()
        main = asyncio.current_task()
        loop.add_signal_handler(signal.SIGTERM, main.cancel)
        sampler = asyncio.create_task(self.sampler())
        killer = asyncio.create_task(self.killer(end_at))
        try:
            # the workers start no request after end_at and finish the ones they have
            await asyncio.gather(*(self.worker(end_at) for _ in range(WORKERS)))
        finally:
            self.stopping = True
            killer.cancel()
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await killer
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
            loop.remove_signal_handler(signal.SIGTERM)
        await self._row_statuses()
        self.redis_keys = await self._key_census()
        await self.redis.aclose()

    async def _row_statuses(self) -> None:
        """The history row of each abandoned request (cancelled at once, or after the grace)."""
        abandoned = [r for r in self.results if r.leave == "abandon" and r.request_id]
        if abandoned:
            await asyncio.sleep(min(protocol.RESUME_GRACE_S + 5, 30))
        for r in abandoned:
            try:
                reader, writer, _, _ = await _open(self.stack.port, "GET",
                                                   f"/v1/requests/{r.request_id}",
                                                   self.keys[r.tenant])
                raw = await asyncio.wait_for(reader.read(), 30)
                writer.close()
                r.row_status = json.loads(raw).get("status")
            except (TimeoutError, Refused, OSError, ValueError) as exc:
                r.row_status = f"? {exc}"

    async def _key_census(self) -> dict[str, int] | None:
        """Our Redis's keys by kind at the end (only when it is ours); a kind with keys that
        never expire is counted again under "<kind> (no TTL)"."""
        if self.redis_proc is None:
            return None
        kinds: Counter[str] = Counter()
        async for key in self.redis.scan_iter(count=1000):
            kind = ":".join(key.decode(errors="replace").split(":")[:2])
            kinds[kind] += 1
            if await self.redis.ttl(key) == -1:
                kinds[f"{kind} (no TTL)"] += 1
        return dict(sorted(kinds.items()))


# -- numbers ------------------------------------------------------------------------------


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def slope_per_10min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB), in MB per 10 minutes."""
    if len(points) < 3:
        return None
    mt = statistics.fmean(t for t, _ in points)
    my = statistics.fmean(y for _, y in points)
    sxx = sum((t - mt) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    return sum((t - mt) * (y - my) for t, y in points) / sxx * 600


def within_runs_slope(runs: list[list[tuple[float, float]]]) -> float | None:
    """One slope for all runs, each with its own intercept (the restart steps drop out)."""
    sxx = sxy = 0.0
    used = 0
    for points in runs:
        if len(points) < 2:
            continue
        mt = statistics.fmean(t for t, _ in points)
        my = statistics.fmean(y for _, y in points)
        sxx += sum((t - mt) ** 2 for t, _ in points)
        sxy += sum((t - mt) * (y - my) for t, y in points)
        used += len(points)
    if used < 3 or sxx == 0:
        return None
    return sxy / sxx * 600


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _r(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def ended_ok(r: Result) -> bool:
    """It ran to its end (length or stop), on its first stream or after reconnecting."""
    if r.error:
        return False
    return r.finish_reason in ("length", "stop") or (
        r.reconnect_error is None and r.reconnect_finish in ("length", "stop"))


def summarize(soak: Soak) -> dict:
    args = soak.args
    results = soak.results
    warm = args.warmup_minutes * 60
    errors = Counter(r.error for r in results if r.error)
    refusals = Counter(code for r in results for code in r.refusals)
    completed = [r for r in results if ended_ok(r)]
    left = [r for r in results if r.leave]
    unexpected = sum(errors.values()) + sum(1 for r in results if r.leave == "reconnect"
                                            and r.reconnect_error)
    resumed = [r for r in results if r.resumed]

    # TTFT per window (by start time)
    width = args.window_minutes * 60
    windows = []
    for w in range(math.ceil(args.minutes * 60 / width)):
        ttfts = [r.ttft for r in results if r.ttft is not None and w * width <= r.start
                 < (w + 1) * width]
        windows.append({
            "window_min": [round(w * width / 60, 1), round(min((w + 1) * width,
                                                               args.minutes * 60) / 60, 1)],
            "requests": len(ttfts),
            "ttft_p50_ms": _r(pct(ttfts, 50) * 1000, 1) if ttfts else None,
            "ttft_p99_ms": _r(pct(ttfts, 99) * 1000, 1) if ttfts else None,
        })

    # RSS
    after = [s for s in soak.samples if s["t"] >= warm]
    daphne_slope = slope_per_10min([(s["t"], s["daphne"]) for s in after
                                    if s["daphne"] is not None])

    def daemon_runs(name: str) -> dict[int, list[tuple[float, float]]]:
        runs: dict[int, list[tuple[float, float]]] = {}
        for s in after:
            started = soak.daemon_started[s["run"]]
            if s.get(name) is not None and s["t"] - started >= args.settle_s:
                runs.setdefault(s["run"], []).append((s["t"], s[name]))
        return runs

    raw_runs, net_runs = daemon_runs("daemon"), daemon_runs("daemon_net")
    daemon_raw_slope = within_runs_slope(list(raw_runs.values()))
    daemon_slope = within_runs_slope(list(net_runs.values()))
    per_run = {run: _r(slope_per_10min(points)) for run, points in sorted(net_runs.items())}
    per_run_raw = {run: _r(slope_per_10min(points)) for run, points in sorted(raw_runs.items())}
    redis_slope = slope_per_10min([(s["t"], s["redis"]) for s in after
                                   if s.get("redis") is not None])

    def rss_range(name: str) -> list[float] | None:
        values = [s[name] for s in soak.samples if s.get(name) is not None]
        return [min(values), max(values), values[-1]] if values else None

    # the kills
    kill_rows = []
    for i, kill in enumerate(soak.kills, 1):
        hit = [r for r in results if i in r.at_kill]
        kept = [r for r in hit if r.leave != "abandon"]
        kill_rows.append({
            **{k: v for k, v in kill.items() if k != "in_flight"},
            "in_flight": len(hit),
            "completed": sum(1 for r in kept if ended_ok(r)),
            "resumed": sum(1 for r in hit if r.resumed),
            # the longest pause between two text chunks that a stream in flight saw
            "max_gap_s": _r(max((r.max_gap_s for r in hit), default=None), 1),
            "not_completed": [{"n": r.n, "leave": r.leave, "error": r.error,
                               "finish": r.finish_reason or r.reconnect_finish,
                               "reconnect_error": r.reconnect_error}
                              for r in kept if not ended_ok(r)],
        })
    kills_ok = all(not row["not_completed"] for row in kill_rows)

    def target(ok: bool | None) -> str:
        return "n/a" if ok is None else ("PASS" if ok else "FAIL")

    slopes = [x for x in (daphne_slope, daemon_slope) if x is not None]
    targets = {
        "rss_slope_lt_5mb_per_10min": target(all(x < 5 for x in slopes) if len(slopes) == 2
                                             else None),
        "no_unexpected_errors": target(unexpected == 0),
        "killed_daemon_requests_completed": target(kills_ok if soak.kills else None),
    }
    return {
        "requests": len(results),
        "completed": len(completed),
        "completion_tokens": sum(r.completion_tokens or 0 for r in completed),
        "errors": dict(errors),
        "refusals_retried": dict(refusals),
        "left_mid_stream": {
            "abandoned": sum(1 for r in left if r.leave == "abandon"),
            "abandoned_row_status": dict(Counter(str(r.row_status) for r in left
                                                 if r.leave == "abandon")),
            "reconnected": sum(1 for r in left if r.leave == "reconnect"),
            "reconnect_finish": dict(Counter(str(r.reconnect_finish or r.reconnect_error)
                                             for r in left if r.leave == "reconnect")),
        },
        "resumed_requests": len(resumed),
        "resumed_total": sum(r.resumed for r in resumed),
        "kills": kill_rows,
        "ttft_windows": windows,
        "rss": {
            "samples": len(soak.samples),
            "after_s": warm,
            "daphne_slope_mb_per_10min": _r(daphne_slope),
            "daemon_slope_mb_per_10min": _r(daemon_slope),
            "daemon_slope_method": f"RSS less the prompt RAM cache's bytes (bounded by "
                                   f"PROMPT_CACHE_RAM_MB); within runs: one slope, an "
                                   f"intercept per daemon run, each run's first "
                                   f"{args.settle_s:.0f} s left out",
            "daemon_slope_per_run": per_run,
            "daemon_raw_slope_mb_per_10min": _r(daemon_raw_slope),
            "daemon_raw_slope_per_run": per_run_raw,
            "redis_slope_mb_per_10min": _r(redis_slope),
            "daphne_min_max_last_mb": rss_range("daphne"),
            "daemon_min_max_last_mb": rss_range("daemon"),
            "daemon_cache_min_max_last_mb": rss_range("cache"),
            "redis_min_max_last_mb": rss_range("redis"),
        },
        "redis_keys_at_end": soak.redis_keys,
        "targets": targets,
    }


def report(soak: Soak, summary: dict, command: str) -> None:
    print()
    print(f"machine: {machine()}")
    print(f"command: {command}")
    a = soak.args
    print(f"settings: minutes={a.minutes} kill_every={a.kill_every} workers={WORKERS} "
          f"leave_every={a.leave_every} seed={a.seed} warmup_minutes={a.warmup_minutes} "
          f"settle_s={a.settle_s} sample_s={a.sample_s} window_minutes={a.window_minutes} "
          f"threads={a.threads or 'service default'} N_PARALLEL={WORKERS} "
          f"N_CTX={soak.stack.env['N_CTX']} N_BATCH={soak.stack.env['N_BATCH']} "
          f"CHUNK_SIZE={soak.stack.env['CHUNK_SIZE']} "
          f"redis={'own' if soak.redis_proc else a.redis_url}")
    s = summary
    print(f"requests: {s['requests']} started, {s['completed']} completed "
          f"({s['completion_tokens']} tokens)")
    print(f"errors by code: {s['errors'] or 'none'}")
    print(f"refusals retried (429/503 + Retry-After): {s['refusals_retried'] or 'none'}")
    lm = s["left_mid_stream"]
    print(f"left mid-stream: {lm['abandoned']} abandoned (rows: {lm['abandoned_row_status']}), "
          f"{lm['reconnected']} reconnected with Last-Event-ID (ended: {lm['reconnect_finish']})")
    print(f"resumed (continued after a daemon death): {s['resumed_requests']} requests, "
          f"{s['resumed_total']} continuations")
    for k in s["kills"]:
        print(f"kill at {k['at_s']} s: {k['in_flight']} in flight, {k['completed']} completed, "
              f"{k['resumed']} resumed, longest pause between chunks {k['max_gap_s']} s; "
              f"not completed: {k['not_completed'] or 'none'}")
    print(f"{'window (min)':>14} {'requests':>8} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for w in s["ttft_windows"]:
        lo, hi = w["window_min"]
        print(f"{f'{lo:g}-{hi:g}':>14} {w['requests']:>8} {str(w['ttft_p50_ms']):>12} "
              f"{str(w['ttft_p99_ms']):>12}")
    rss = s["rss"]
    print(f"RSS slope after {rss['after_s']:.0f} s (MB / 10 min, least squares): "
          f"daphne {rss['daphne_slope_mb_per_10min']}, redis {rss['redis_slope_mb_per_10min']}")
    print(f"  daemon {rss['daemon_slope_mb_per_10min']} ({rss['daemon_slope_method']}; "
          f"per run {rss['daemon_slope_per_run']})")
    print(f"  daemon raw RSS, same method: {rss['daemon_raw_slope_mb_per_10min']} "
          f"(per run {rss['daemon_raw_slope_per_run']})")
    print(f"RSS MB min/max/last: daphne {rss['daphne_min_max_last_mb']}, daemon "
          f"{rss['daemon_min_max_last_mb']} (its prompt RAM cache "
          f"{rss['daemon_cache_min_max_last_mb']}), redis {rss['redis_min_max_last_mb']}")
    if s["redis_keys_at_end"] is not None:
        print(f"redis keys at the end: {s['redis_keys_at_end']}")
    for name, verdict in s["targets"].items():
        print(f"target {name}: {verdict}")


def _interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--kill-every", type=float, default=10.0, help="minutes (0: never)")
    parser.add_argument("--leave-every", type=int, default=20,
                        help="every Nth request leaves mid-stream")
    parser.add_argument("--warmup-minutes", type=float, default=5.0,
                        help="RSS samples before this are left out of the slopes")
    parser.add_argument("--settle-s", type=float, default=60.0,
                        help="each daemon run's first seconds left out of its RSS slope")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--window-minutes", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--threads", type=int, default=None,
                        help="N_THREADS (default: the service's, every core)")
    parser.add_argument("--redis-url", default=None,
                        help="an existing Redis database (default: a redis-server of our own "
                             "on a free port)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the logs and database (printed path)")
    args = parser.parse_args()
    command = shlex.join([Path(sys.executable).name, *sys.argv])
    soak = Soak(args)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started ignoring it
    interrupted = False
    try:
        soak.start()
        print(f"service up (daphne {soak.daphne.pid}, daemon {soak.daemon.pid}, "
              f"model {soak.stack.model}); {args.minutes:g} minutes", flush=True)
        asyncio.run(soak.run())
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: stopping (the summary covers what ran)", flush=True)
        interrupted = True
    except BaseException:
        args.keep_logs = True
        soak.close()
        raise
    if interrupted and not soak.results:
        soak.close()
        raise SystemExit(130)
    summary = summarize(soak)
    soak.close()
    report(soak, summary, command)
    print(json.dumps({"bench": "soak", "machine": machine(), "command": command,
                      "settings": {k: v for k, v in vars(args).items() if k != "redis_url"}
                      | {"workers": WORKERS}, "interrupted": interrupted, **summary}))
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
