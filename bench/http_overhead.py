"""What the service adds on top of the scheduler: TTFT and throughput through HTTP + SSE.

For each concurrency N, N streamed completions of the same token-id prompts (distinct per
request, ~100 tokens, greedy, ignore_eos, no prefix cache) go
  "inproc": straight to an in-process InferenceCore (submit -> first TokenEvent with text);
  "http":   through daphne + Redis + a run_scheduler daemon, POST /v1/completions with
            stream=true (request sent -> first SSE chunk with text), a minimal asyncio client.
Both setups have the same engine sizes and run in this one process's run, interleaved per
repetition (alternating which goes first) so machine drift hits both alike. TTFT p50 is
over all requests of a concurrency level; throughput is generated tokens / wall time of
each batch; the ratio is the median of the reps' paired ratios. TTFT is measured in its own
phase (two new tokens, --ttft-reps pairs) and reported both as the issue asks (difference of
the p50s) and paired (median of per-pair differences, with a 90% bootstrap interval). On a
shared 2-core VM the same prefill varies by +-15% run to run (bench/README.md): read the
intervals before the medians.
The daemon runs with the service's defaults (STREAM_INTERVAL_MS among them).
Run:  .venv/bin/python bench/http_overhead.py [--conc 1 4 8] [--new-tokens 64] [--reps 8]
      [--ttft-reps 60 24 16]
Needs Redis (--redis-url, default database 14). The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _common import ROOT, machine, model_path

from config.listen import daphne_endpoint
from scheduler_daemon.core import InferenceCore
from scheduler_daemon.engine import EngineConfig, LlamaEngine
from scheduler_daemon.scheduler import SchedulerConfig
from scheduler_daemon.state import TokenEvent
from wire.sampling import SamplingParams

PROMPT_TOKENS = 100
_DROP_JOBS = (
    "import sys, redis; from wire import protocol; "
    "redis.Redis.from_url(sys.argv[1]).delete(protocol.jobs_stream(sys.argv[2]))"
)
N_CTX, N_BATCH, CHUNK = 8192, 2048, 512


def make_prompts(engine: LlamaEngine, n: int, salt: int) -> list[list[int]]:
    """``n`` distinct prompts of PROMPT_TOKENS tokens (``salt`` keeps repetitions distinct)."""
    topics = ["rivers", "mountains", "trains", "bread", "stars", "gardens", "cities", "music"]
    return [
        engine.tokenize(
            f"Essay {salt}-{i} about {topics[i % len(topics)]}. "
            + "Write a long and detailed essay about this subject. " * 12
        )[:PROMPT_TOKENS]
        for i in range(n)
    ]


# -- in-process ----------------------------------------------------------------------------


def run_inproc(core: InferenceCore, prompts: list[list[int]], new_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ttfts: list[float | None] = []
    tokens: list[int] = []

    def consume(handle, t0: float) -> None:
        first = None
        for event in handle.events(timeout=600):
            if isinstance(event, TokenEvent):
                if first is None and event.text:
                    first = time.perf_counter() - t0
            else:
                tokens.append(event.stats.completion_tokens)
        ttfts.append(first)

    t0 = time.perf_counter()
    threads = []
    for prompt in prompts:
        handle = core.submit(prompt=prompt, params=params, cache_prompt=False)
        threads.append(threading.Thread(target=consume, args=(handle, time.perf_counter())))
        threads[-1].start()
    for thread in threads:
        thread.join()
    if len(ttfts) != len(prompts) or None in ttfts:
        raise RuntimeError("a stream ended without text")  # never a silent 0 ms TTFT
    return {"ttfts": ttfts, "tok_s": sum(tokens) / (time.perf_counter() - t0)}


# -- HTTP + SSE -------------------------------------------------------------------------------


async def one_stream(port: int, key: str, body: bytes) -> tuple[float, int]:
    """(TTFT s, completion tokens) of one streamed completion over HTTP/1.0 (no chunking)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.0\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nAuthorization: Bearer "
        + key.encode()
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP {status!r}: {await reader.read()!r}")
    ttft, used = None, 0
    async for line in reader:
        # parse only what is measured: chunks until the first text, then the usage chunk
        if not line.startswith(b"data: {") or (ttft is not None and b'"usage"' not in line):
            continue
        chunk = json.loads(line[6:])
        if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
            ttft = time.perf_counter() - t0
        if chunk.get("usage"):
            used = chunk["usage"]["completion_tokens"]
    writer.close()
    if ttft is None:
        raise RuntimeError("a stream ended without text")
    return ttft, used


def run_http(port: int, key: str, model: str, prompts: list[list[int]], new_tokens: int) -> dict:
    bodies = [
        json.dumps(
            {
                "model": model,
                "prompt": p,
                "max_tokens": new_tokens,
                "stream": True,
                "temperature": 0,
                "ignore_eos": True,
                "cache_prompt": False,
                "stream_options": {"include_usage": True},
            }
        ).encode()
        for p in prompts
    ]

    async def batch() -> list[tuple[float, int]]:
        return await asyncio.gather(*(one_stream(port, key, b) for b in bodies))

    t0 = time.perf_counter()
    results = asyncio.run(batch())
    return {
        "ttfts": [r[0] for r in results],
        "tok_s": sum(r[1] for r in results) / (time.perf_counter() - t0),
    }


class Stack:
    """daphne + run_scheduler on a temporary SQLite database, stopped by ``close``."""

    def __init__(self, redis_url: str, n_parallel: int, threads: int, model: str,
                 root: Path = ROOT, defaults: bool = False, env: dict[str, str] | None = None,
                 supervise: bool = False) -> None:
        """``defaults``: the service's own settings (as ``make run`` has them) instead of this
        benchmark's engine sizes; ``env``: settings on top; ``supervise``: the daemon under
        ``run_scheduler --supervise``, as ``make run`` starts it."""
        self.root = root  # the checkout whose daphne and daemon run
        self.supervise = supervise
        self.tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
        self.port = _free_port()
        self.model = model
        self.env = {
            **os.environ,
            "REDIS_URL": redis_url,
            "DEBUG": "false",
            "SECRET_KEY": secrets.token_urlsafe(40),
            "ALLOWED_HOSTS": "127.0.0.1",
            "DATABASE_URL": f"sqlite:///{self.tmp / 'db.sqlite3'}",
            "LOG_LEVEL": "WARNING",
            "MODEL_PATH": model_path(),
            "MODEL_NAME": model,
        }
        if not defaults:
            self.env.update({"N_PARALLEL": str(n_parallel), "N_CTX": str(N_CTX),
                             "N_BATCH": str(N_BATCH), "CHUNK_SIZE": str(CHUNK),
                             "N_THREADS": str(threads), "CACHE_PROMPT": "false"})
        self.env.update(env or {})
        self.procs: list[subprocess.Popen] = []
        # what daphne serves, and settings for one of the two processes only (a probe's)
        self.application = "config.asgi:application"
        self.web_env: dict[str, str] = {}
        self.daemon_env: dict[str, str] = {}

    def open(self) -> str:
        """Start everything; return an API key."""
        manage = [sys.executable, "manage.py"]
        self._run([*manage, "migrate", "-v", "0"])
        self._run([*manage, "create_tenant", "bench"])
        key = self._run([*manage, "create_api_key", "bench"]).strip().splitlines()[-1]
        log = (self.tmp / "log.txt").open("ab")
        daphne = [sys.executable, "-m", "daphne", "-e", daphne_endpoint("127.0.0.1", self.port),
                  self.application]  # as make run starts it
        scheduler = [*manage, "run_scheduler", "--grace", "1"]
        if self.supervise:
            scheduler.append("--supervise")
        for argv, env in ((scheduler, self.daemon_env), (daphne, self.web_env)):
            self.procs.append(
                subprocess.Popen(argv, cwd=self.root, env={**self.env, **env}, stdout=log,
                                 stderr=subprocess.STDOUT)
            )
        deadline = time.monotonic() + 180
        while not self._model_served():
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.close(keep_logs=True)
                raise RuntimeError(f"the service did not start; see {self.tmp / 'log.txt'}")
            time.sleep(0.5)
        return key

    def _run(self, argv: list[str]) -> str:
        return subprocess.run(
            argv, cwd=self.root, env=self.env, check=True, capture_output=True, text=True
        ).stdout

    def _model_served(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/health", timeout=2) as r:
                return self.model in json.loads(r.read())["models"]
        except OSError:
            return False

    def close(self, keep_logs: bool = False) -> None:
        """Stop the processes; drop the model's jobs stream and (unless asked) the files."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        subprocess.run([sys.executable, "-c", _DROP_JOBS, self.env["REDIS_URL"], self.model],
                       cwd=ROOT, env=self.env, check=True)  # this checkout's wire names
        if not keep_logs:
            shutil.rmtree(self.tmp, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def p50_ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1000, 1)


def median_ci(values: list[float], level: float = 0.9, resamples: int = 2000) -> tuple:
    """(median, low, high): a percentile-bootstrap interval for the median (seeded)."""
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples)
    )
    cut = int(resamples * (1 - level) / 2)
    return statistics.median(values), medians[cut], medians[-cut - 1]


def paired(run_a, run_b, reps: int) -> list[tuple[dict, dict]]:
    """``reps`` (a, b) result pairs, alternating which of the two runs first."""
    pairs = []
    for rep in range(reps):
        if rep % 2 == 0:
            a = run_a(rep)
            b = run_b(rep)
        else:
            b = run_b(rep)
            a = run_a(rep)
        pairs.append((a, b))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conc", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=8, help="throughput pairs per level")
    parser.add_argument("--ttft-reps", type=int, nargs="+", default=[60, 24, 16],
                        help="TTFT pairs per level (one value, or one per --conc level)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    args = parser.parse_args()
    ttft_reps = dict(zip(args.conc, args.ttft_reps * len(args.conc) if len(args.ttft_reps) == 1
                         else args.ttft_reps, strict=True))
    logging.basicConfig(level=logging.WARNING)
    n_seq = max(args.conc)
    engine = LlamaEngine(
        EngineConfig(
            model_path=model_path(),
            n_ctx=N_CTX,
            n_batch=N_BATCH,
            n_seq_max=n_seq,
            n_threads=args.threads,
        )
    )
    core = InferenceCore(engine, SchedulerConfig(chunk_size=CHUNK, cache_prompt=False))
    core.start()
    stack = Stack(args.redis_url, n_seq, args.threads, f"bench-{secrets.token_hex(3)}")
    try:
        key = stack.open()
        print(f"machine: {machine()}")
        print(
            f"n_ctx={N_CTX} n_batch={N_BATCH} n_seq_max={n_seq} threads={args.threads} "
            f"prompt={PROMPT_TOKENS} new={args.new_tokens} reps={args.reps} "
            f"ttft_reps={ttft_reps}"
        )
        warm = make_prompts(engine, 1, -1)
        run_inproc(core, warm, 4)
        run_http(stack.port, key, stack.model, warm, 4)
        print(
            f"{'conc':>4} {'ttft inproc':>11} {'ttft http':>9} {'added p50 [90% CI]':>24} "
            f"{'tok/s inproc':>12} {'tok/s http':>10} {'ratio [90% CI]':>22}"
        )
        rows = [measure_level(engine, core, stack, key, conc, args.new_tokens, args.reps,
                              ttft_reps[conc]) for conc in args.conc]
    finally:
        stack.close()
        core.stop(grace_s=0)
        engine.close()
    print(
        json.dumps(
            {
                "bench": "http_overhead",
                "machine": machine(),
                "threads": args.threads,
                "prompt_tokens": PROMPT_TOKENS,
                "new_tokens": args.new_tokens,
                "reps": args.reps,
                "ttft_reps": ttft_reps,
                "rows": rows,
            }
        )
    )


def measure_level(engine: LlamaEngine, core: InferenceCore, stack: Stack, key: str, conc: int,
                  new_tokens: int, reps: int, ttft_reps: int) -> dict:
    """One concurrency level: a TTFT phase (2 new tokens, many pairs: a prefill of ~100 tokens
    varies by +-15% run to run on a shared VM, so only many pairs resolve a few ms) and a
    throughput phase (``new_tokens`` each, fewer pairs)."""

    def inproc(tokens: int, salt: int):
        return lambda rep: run_inproc(core, make_prompts(engine, conc, salt + rep), tokens)

    def http(tokens: int, salt: int):
        return lambda rep: run_http(stack.port, key, stack.model,
                                    make_prompts(engine, conc, salt + rep), tokens)

    salt = conc * 10_000
    ttft_pairs = paired(inproc(2, salt), http(2, salt), ttft_reps)
    tput_pairs = paired(inproc(new_tokens, salt + 5000), http(new_tokens, salt + 5000), reps)
    ttft_in = [t for a, _ in ttft_pairs for t in a["ttfts"]]
    ttft_http = [t for _, b in ttft_pairs for t in b["ttfts"]]
    added = [statistics.median(b["ttfts"]) - statistics.median(a["ttfts"])
             for a, b in ttft_pairs]
    ratios = [b["tok_s"] / a["tok_s"] for a, b in tput_pairs]
    added_ms = [round(x * 1000, 1) for x in median_ci(added)]
    ratio = [round(x, 3) for x in median_ci(ratios)]
    row = {
        "conc": conc,
        "inproc": {"ttft_p50_ms": p50_ms(ttft_in),
                   "tok_s": round(statistics.median(a["tok_s"] for a, _ in tput_pairs), 2)},
        "http": {"ttft_p50_ms": p50_ms(ttft_http),
                 "tok_s": round(statistics.median(b["tok_s"] for _, b in tput_pairs), 2)},
        # the number: difference of the two p50s; and the paired estimate with its
        # 90% interval (median over pairs of the pair's HTTP minus in-process median TTFT)
        "ttft_overhead_ms": round(p50_ms(ttft_http) - p50_ms(ttft_in), 1),
        "ttft_added_paired_ms": added_ms,
        "throughput_ratio": ratio[0],
        "throughput_ratio_ci90": ratio[1:],
    }
    print(
        f"{conc:>4} {row['inproc']['ttft_p50_ms']:>9.1f}ms {row['http']['ttft_p50_ms']:>7.1f}ms "
        f"{added_ms[0]:>+8.1f} [{added_ms[1]:+.1f}, {added_ms[2]:+.1f}] ms "
        f"{row['inproc']['tok_s']:>12.2f} {row['http']['tok_s']:>10.2f} "
        f"{ratio[0]:>7.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}]",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
