"""How much large tokenize requests slow another tenant's stream (#31, part 6).

A real daphne and a Gemma daemon (N_CTX 2048, N_PARALLEL 2, MAX_PROMPT_BYTES 256 KiB); one
tenant's 60-token stream (ignore_eos) is timed alone, then while ``--clients`` threads of
another tenant send /v1/tokenize with_pieces on 261 KB of CJK text back to back (the
issue's request). Prints one JSON line: the stream's seconds alone and under load, the
tokenize answers seen, their statuses and answer bytes.

    DJANGO_SETTINGS_MODULE=tests.settings TEST_REDIS_URL=redis://127.0.0.1:6379/14 \\
        .venv/bin/python bench/vocab_stall.py --clients 4
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django  # noqa: E402

django.setup()

from tests.live_service import RealDaemon, WebServer  # noqa: E402

CJK = "".join(chr(0x4E00 + (i * 7919) % 20_000) for i in range(87_000))


def stream_s(web: WebServer, model: str, key: str) -> float:
    started = time.perf_counter()
    reply = web.request("POST", "/v1/completions", {
        "model": model, "prompt": "Count: one, two,", "max_tokens": 60, "ignore_eos": True,
        "temperature": 0, "stream": True}, key, timeout=600)
    for _, data in reply.sse():
        if data == "[DONE]":
            break
    reply.conn.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    web = WebServer()
    web.env["MAX_PROMPT_BYTES"] = str(256 * 1024)
    web.start()
    daemon = RealDaemon(web, "gemma-vocab-bench").start()
    try:
        stream_s(web, daemon.model, web.keys["outsider"])  # warm
        alone = [stream_s(web, daemon.model, web.keys["outsider"]) for _ in range(args.runs)]
        stop = threading.Event()
        seen: Counter[int] = Counter()
        sizes: list[int] = []

        def hammer() -> None:
            while not stop.is_set():
                reply = web.request("POST", "/v1/tokenize", {
                    "model": daemon.model, "content": CJK, "with_pieces": True},
                    web.keys["owner"], timeout=600)
                body = reply.response.read()
                reply.conn.close()
                seen[reply.status] += 1
                sizes.append(len(body))

        threads = [threading.Thread(target=hammer, daemon=True) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        time.sleep(2)  # the clients are under way
        loaded = [stream_s(web, daemon.model, web.keys["outsider"]) for _ in range(args.runs)]
        stop.set()
        for thread in threads:
            thread.join(timeout=600)
        print(json.dumps({"clients": args.clients, "alone_s": [round(s, 2) for s in alone],
                          "loaded_s": [round(s, 2) for s in loaded], "statuses": dict(seen),
                          "answer_bytes_max": max(sizes, default=0),
                          "load": os.getloadavg()}))
    finally:
        daemon.stop()
        web.stop()


if __name__ == "__main__":
    main()
