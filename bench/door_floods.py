"""What a hostile client's flood costs another tenant, through the door (#32).

The real web as ``make run`` serves it (nginx in front of daphne, config/proxy.py) and a
stand-in daemon in this process that answers each job at once (the engine is not what is
measured). A victim tenant (beta, from 127.0.0.2) sends short non-streamed completions one
after another; its latency is timed alone and under each flood, in alternating rounds:

- ``wrong_keys``: ``--clients`` threads from 127.0.0.3 send completions with random
  well-formed keys on keep-alive connections, as fast as they are answered;
- ``replays``: ``--clients`` threads of tenant alpha, from 127.0.0.4, replay alpha's own
  finished ``--tokens``-token stream from the start (``GET /v1/requests/<id>/events``) in
  a loop.

Prints one JSON object: per phase the victim's median latency per round, the median ratio
of flood to the baseline round next to it, and what the attackers got (statuses, rate).

    DJANGO_SETTINGS_MODULE=tests.settings TEST_REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/door_floods.py --rounds 3
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
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

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


def wrong_keys(port: int, target: dict, stop: threading.Event, seen: Counter) -> None:
    conn = connection(port, "127.0.0.3")
    body = json.dumps({"model": target["model"], "prompt": "x"})
    while not stop.is_set():
        prefix = "".join(secrets.choice(ALPHABET) for _ in range(10))
        secret = "".join(secrets.choice(ALPHABET) for _ in range(43))
        try:
            conn.request("POST", "/v1/completions", body=body, headers={
                "Authorization": f"Bearer sk-{prefix}.{secret}",
                "Content-Type": "application/json"})
            reply = conn.getresponse()
            reply.read()
            seen[reply.status] += 1
        except (OSError, http.client.HTTPException):
            seen["closed"] += 1
            conn.close()
            conn = connection(port, "127.0.0.3")


def replays(port: int, target: dict, stop: threading.Event, seen: Counter) -> None:
    conn = connection(port, "127.0.0.4")
    headers = {"Authorization": f"Bearer {target['key']}", "Accept": "text/event-stream"}
    while not stop.is_set():
        try:
            conn.request("GET", f"/v1/requests/{target['request_id']}/events", headers=headers)
            reply = conn.getresponse()
            seen["bytes"] += len(reply.read())
            seen[reply.status] += 1
        except (OSError, http.client.HTTPException):
            seen["closed"] += 1
            conn.close()
            conn = connection(port, "127.0.0.4")


FLOODS = {"wrong_keys": wrong_keys, "replays": replays}


def attacker(kind: str, port: int, target: dict, clients: int, done: Any,
             results: multiprocessing.Queue) -> None:
    """One process of ``clients`` threads flooding until ``done`` is set (not the victim's
    GIL); puts what they got and for how long."""
    stop, seen = threading.Event(), Counter()
    threads = [threading.Thread(target=FLOODS[kind], args=(port, target, stop, seen),
                                daemon=True) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    done.wait()
    stop.set()
    for thread in threads:
        thread.join(60)
    results.put(({str(k): v for k, v in seen.items()}, time.perf_counter() - started))


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
    args = parser.parse_args()
    web = WebServer().start()
    standin = StandIn().start()
    stop_answering = threading.Event()
    try:
        request_id = long_finished_stream(web, standin, args.tokens)
        threading.Thread(target=answer_all, args=(standin, stop_answering), daemon=True).start()
        victim_latencies(web, standin.model, 10)  # warm
        finish_row(web, request_id)
        targets = {"wrong_keys": {"model": standin.model},
                   "replays": {"key": web.keys["owner"], "request_id": request_id}}
        result: dict = {"clients": args.clients, "tokens": args.tokens,
                        "victim_requests_per_round": args.requests}
        spawn = multiprocessing.get_context("spawn")
        for name, target in targets.items():
            if args.only and name != args.only:
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
                seen, seconds = results.get(timeout=120)
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
