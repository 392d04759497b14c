"""What a hostile client's flood costs another tenant, through the door.

The real web as ``make run`` serves it (nginx in front of daphne, config/proxy.py) and a
stand-in daemon in this process that answers each job at once (the engine is not what is
measured). A victim tenant (beta, from 127.0.0.2) sends short non-streamed completions one
after another; its latency is timed alone and under each flood, in alternating rounds:

- ``wrong_keys``: ``--clients`` threads from 127.0.0.3 send completions with random
  well-formed keys on keep-alive connections, as fast as they are answered;
- ``replays``: ``--clients`` threads of tenant alpha, from 127.0.0.4, replay alpha's own
  finished ``--tokens``-token stream from the start (``GET /v1/requests/<id>/events``) in
  a loop.

Prints the machine and the command, a JSON line per flood and, last, all of them in one
JSON object: per flood the victim's median latency per round, the median ratio of flood to
the baseline round next to it, and what the attackers got (statuses, rate).

``--cost`` measures instead what one flood request costs the web process, with no victim:
daphne's CPU seconds (utime + stime, /proc) over ``--cost-s`` seconds of each flood, per
request answered then. ``models`` (``GET /v1/models`` with alpha's key, from 127.0.0.4) is
the cheapest request with a key, for comparison; ``--replays-per-minute 1`` makes nearly
every replay a refusal.

    DJANGO_SETTINGS_MODULE=tests.settings TEST_REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/door_floods.py --rounds 3
    ... bench/door_floods.py --cost --only replays --replays-per-minute 1
"""
from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import os
import secrets
import statistics
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from _common import command, machine  # noqa: E402

from config import proxy  # noqa: E402
from tests.live_service import StandIn, WebServer  # noqa: E402
from wire import protocol  # noqa: E402

ALPHABET = string.ascii_letters + string.digits


def connection(port: int, source: str) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", port, timeout=60,
                                      source_address=(source, 0))


def answer_all(standin: StandIn, stop: threading.Event) -> None:
    """Answer every job of the stand-in's model at once: accepted, two tokens, done."""
    while not stop.is_set():
        try:
            job = standin.next_job(timeout_s=1)
        except AssertionError:
            continue
        standin.accept(job)
        standin.emit(job.id, protocol.TOKEN, {"text": "Hi", "n_tokens": 1})
        standin.finish(job)


def victim_latencies(web: WebServer, model: str, count: int) -> list[float]:
    conn, out = connection(web.port, "127.0.0.2"), []
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 2})
    headers = {"Authorization": f"Bearer {web.keys['outsider']}",
               "Content-Type": "application/json"}
    for _ in range(count):
        started = time.perf_counter()
        conn.request("POST", "/v1/completions", body=body, headers=headers)
        reply = conn.getresponse()
        reply.read()
        out.append(time.perf_counter() - started)
        if reply.status != 200:
            raise RuntimeError(f"the victim got {reply.status}")
    conn.close()
    return out


def closed_loop(port: int, source: str, stop: threading.Event, seen: Counter,
                next_request: Callable[[], tuple[str, str, str | None, dict[str, str]]],
                count_bytes: bool = False) -> None:
    """One attacker: ``next_request()``'s (method, path, body, headers) sent again as soon
    as it is answered, on a keep-alive connection from ``source``; statuses into ``seen``."""
    conn = connection(port, source)
    while not stop.is_set():
        method, path, body, headers = next_request()
        try:
            conn.request(method, path, body=body, headers=headers)
            reply = conn.getresponse()
            data = reply.read()
            if count_bytes:
                seen["bytes"] += len(data)
            seen[reply.status] += 1
        except (OSError, http.client.HTTPException):
            seen["closed"] += 1
            conn.close()
            conn = connection(port, source)


def wrong_keys(port: int, target: dict, stop: threading.Event, seen: Counter) -> None:
    body = json.dumps({"model": target["model"], "prompt": "x"})

    def request() -> tuple[str, str, str | None, dict[str, str]]:
        prefix = "".join(secrets.choice(ALPHABET) for _ in range(10))
        secret = "".join(secrets.choice(ALPHABET) for _ in range(43))
        return "POST", "/v1/completions", body, {
            "Authorization": f"Bearer sk-{prefix}.{secret}", "Content-Type": "application/json"}

    closed_loop(port, "127.0.0.3", stop, seen, request)


def replays(port: int, target: dict, stop: threading.Event, seen: Counter) -> None:
    headers = {"Authorization": f"Bearer {target['key']}", "Accept": "text/event-stream"}
    path = f"/v1/requests/{target['request_id']}/events"
    closed_loop(port, "127.0.0.4", stop, seen, lambda: ("GET", path, None, headers),
                count_bytes=True)


def models(port: int, target: dict, stop: threading.Event, seen: Counter) -> None:
    headers = {"Authorization": f"Bearer {target['key']}"}
    closed_loop(port, "127.0.0.4", stop, seen, lambda: ("GET", "/v1/models", None, headers))


FLOODS = {"wrong_keys": wrong_keys, "replays": replays, "models": models}
ROUNDS = ("wrong_keys", "replays", "models")  # the floods run against the victim unless --only


def attacker(kind: str, port: int, target: dict, clients: int, done: Any,
             results: multiprocessing.Queue, mark: Any = None) -> None:
    """One process of ``clients`` threads flooding until ``done`` is set (not the victim's
    GIL); puts what they got and for how long, and what they had got when ``mark`` was set
    (None without one)."""
    stop, seen = threading.Event(), Counter()
    threads = [threading.Thread(target=FLOODS[kind], args=(port, target, stop, seen),
                                daemon=True) for _ in range(clients)]
    at_mark: list[Counter] = []
    if mark is not None:
        threads.append(threading.Thread(target=lambda: mark.wait() or at_mark.append(
            Counter(seen)), daemon=True))
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    done.wait()
    stop.set()
    for thread in threads:
        thread.join(60)
    marked = {str(k): v for k, v in at_mark[0].items()} if at_mark else None
    results.put(({str(k): v for k, v in seen.items()}, time.perf_counter() - started, marked))


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def flood_cost(web: WebServer, name: str, target: dict, args: argparse.Namespace) -> dict:
    """What one request of the flood costs daphne, with no victim: its CPU over
    ``args.cost_s`` seconds of the flood (after the ramp) per request answered then."""
    spawn = multiprocessing.get_context("spawn")
    results, done, mark = spawn.Queue(), spawn.Event(), spawn.Event()
    flood = spawn.Process(target=attacker, args=(name, web.port, target, args.clients, done,
                                                 results, mark))
    flood.start()
    time.sleep(args.ramp_s)
    assert web.proc is not None
    cpu_before, started = cpu_s(web.proc.pid), time.perf_counter()
    mark.set()
    time.sleep(args.cost_s)
    cpu, seconds = cpu_s(web.proc.pid) - cpu_before, time.perf_counter() - started
    done.set()
    seen, _total_s, at_mark = results.get(timeout=120)
    flood.join(60)
    statuses = {k: v - (at_mark or {}).get(k, 0) for k, v in seen.items() if k != "bytes"}
    answered = sum(v for k, v in statuses.items() if k != "closed")
    return {"seconds": round(seconds, 1), "statuses": statuses,
            "requests_per_s": round(answered / seconds, 1),
            "cpu_ms_per_request": round(1000 * cpu / max(1, answered), 2),
            "cpu_share": round(cpu / seconds, 2)}


def finish_row(web: WebServer, request_id: str) -> None:
    """Close the request's history row as its daemon would (the stand-in writes none)."""
    subprocess.run([sys.executable, "manage.py", "shell", "-c",
                    "from django.utils import timezone; from inference.models import "
                    f"InferenceRequest; InferenceRequest.objects.filter(id='{request_id}')"
                    ".update(status='done', finished=timezone.now())"],
                   cwd=ROOT, env=web.env, check=True, capture_output=True)


def long_finished_stream(web: WebServer, standin: StandIn, tokens: int) -> str:
    """Alpha's finished request of ``tokens`` token events (its stream kept for replays)."""
    done = threading.Event()
    ids: list[str] = []

    def run() -> None:
        job = standin.next_job(timeout_s=30)
        ids.append(job.id)
        standin.accept(job)
        for i in range(tokens):
            standin.emit(job.id, protocol.TOKEN, {"text": f" w{i}", "n_tokens": 1})
        standin.finish(job, completion_tokens=tokens)
        done.set()

    threading.Thread(target=run, daemon=True).start()
    reply = web.request("POST", "/v1/completions", {
        "model": standin.model, "prompt": "Tell", "max_tokens": tokens}, web.keys["owner"])
    assert reply.status == 200, reply.json()
    reply.json()
    done.wait(60)
    return ids[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=40, help="victim requests per round")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--ramp-s", type=float, default=3.0,
                        help="seconds each flood runs before the victim starts")
    parser.add_argument("--only", choices=sorted(FLOODS), help="run this flood alone")
    parser.add_argument("--cost", action="store_true",
                        help="measure daphne's CPU per flood request instead (no victim)")
    parser.add_argument("--cost-s", type=float, default=10.0)
    parser.add_argument("--replays-per-minute", type=int,
                        help="the server's REPLAYS_PER_MINUTE (default: its own, 60)")
    parser.add_argument("--requests-per-s", type=int, default=proxy.PROXY_REQUESTS_PER_S,
                        help="the door's PROXY_REQUESTS_PER_S (default: its own, "
                        f"{proxy.PROXY_REQUESTS_PER_S}; 100000: no rate)")
    parser.add_argument("--request-burst", type=int, default=proxy.PROXY_REQUEST_BURST,
                        help="the door's PROXY_REQUEST_BURST (default: its own, "
                        f"{proxy.PROXY_REQUEST_BURST})")
    args = parser.parse_args()
    print(f"machine: {machine()}")
    print(f"command: {command()}", flush=True)
    web = WebServer()
    web.env.update({"PROXY_REQUESTS_PER_S": str(args.requests_per_s),
                    "PROXY_REQUEST_BURST": str(args.request_burst)})
    if args.replays_per_minute is not None:
        web.env["REPLAYS_PER_MINUTE"] = str(args.replays_per_minute)
    web.start()
    standin = StandIn().start()
    stop_answering = threading.Event()
    try:
        request_id = long_finished_stream(web, standin, args.tokens)
        threading.Thread(target=answer_all, args=(standin, stop_answering), daemon=True).start()
        victim_latencies(web, standin.model, 10)  # warm
        finish_row(web, request_id)
        targets = {"wrong_keys": {"model": standin.model},
                   "replays": {"key": web.keys["owner"], "request_id": request_id},
                   "models": {"key": web.keys["owner"]}}
        result: dict = {"clients": args.clients, "tokens": args.tokens,
                        "victim_requests_per_round": args.requests}
        spawn = multiprocessing.get_context("spawn")
        for name, target in targets.items():
            if name != args.only and (args.only or name not in ROUNDS):
                continue
            if args.cost:
                result[name] = {"cost": flood_cost(web, name, target, args)}
                print(json.dumps({name: result[name]}), flush=True)
                continue
            rounds = []
            for _ in range(args.rounds):
                alone = victim_latencies(web, standin.model, args.requests)
                results, done = spawn.Queue(), spawn.Event()
                flood = spawn.Process(target=attacker, args=(
                    name, web.port, target, args.clients, done, results))
                flood.start()
                time.sleep(args.ramp_s)  # the flood is on before the victim starts
                under = victim_latencies(web, standin.model, args.requests)
                done.set()
                seen, seconds, _ = results.get(timeout=120)
                flood.join(60)
                ratio = statistics.median(under) / statistics.median(alone)
                rounds.append({
                    "alone_s": round(statistics.median(alone), 4),
                    "flood_s": round(statistics.median(under), 4), "ratio": round(ratio, 2),
                    "attack": seen, "attack_per_s": round(
                        sum(v for k, v in seen.items() if k != "bytes") / seconds, 1)})
            result[name] = {"rounds": rounds, "median_ratio": statistics.median(
                r["ratio"] for r in rounds)}
            print(json.dumps({name: result[name]}), flush=True)
        print(json.dumps(result))
    finally:
        stop_answering.set()
        time.sleep(1.5)  # the answering thread's last take returns
        standin.stop()
        web.stop()


if __name__ == "__main__":
    main()
