"""The prefix_cache scenario against a running llama-server: a same-machine reference.

bench/prefix_cache.py's target (full mode: TTFT median <= 250 ms) was set against
llama-server's 684 ms on the machine the issue was written on. Machines differ by several
times (bench/results/), so this script replays the same scenario -- 8 interleaved
conversations x 4 turns, the same ~300-token system prompt, pairs sent together, 16 new
tokens, greedy, ignore_eos -- against llama-server over HTTP (streaming; TTFT = request
sent -> first chunk with text), and reads cached tokens from llama-server's ``timings``.

llama-server is not part of this project. To build the one that matches our llama.cpp
(the copy vendored in llama-cpp-python 0.3.36):
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36 -d /tmp/llsrc
    cd /tmp/llsrc && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON
    cmake --build build --target llama-server -j2
    build/bin/llama-server -m <gemma .gguf> -c 8192 -np 4 -kvu -t 2 --port 8090
Run:  .venv/bin/python bench/llama_server_prefix.py --url http://127.0.0.1:8090
The last line printed is JSON: {"bench": "llama_server_prefix", ...}.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from _common import machine
from prefix_cache import SYSTEM, scenario, summarize


def ask(url: str, messages: list[dict], new_tokens: int) -> dict:
    """One streamed chat completion: TTFT, text, prompt and cached token counts."""
    body = json.dumps(
        {
            "messages": messages,
            "max_tokens": new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": True,
            "stream": True,
        }
    ).encode()
    request = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    t0 = time.perf_counter()
    ttft, parts, timings = None, [], {}
    with urllib.request.urlopen(request, timeout=600) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft or time.perf_counter() - t0
                    parts.append(text)
            timings = chunk.get("timings") or timings
    return {
        "ttft_ms": (ttft or 0.0) * 1000,
        "text": "".join(parts),
        "prompt_tokens": timings.get("prompt_n", 0) + timings.get("cache_n", 0),
        "cached_tokens": timings.get("cache_n", 0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8090")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    args = parser.parse_args()
    ask(args.url, [{"role": "user", "content": "Warm-up."}], 2)
    chats = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    results: list[dict] = []
    t0 = time.perf_counter()
    for pair in scenario(args.conversations, args.turns):
        for i, question in pair:
            chats[i].append({"role": "user", "content": question})
        ids = [i for i, _ in pair]
        with ThreadPoolExecutor(len(ids)) as pool:  # the pair is sent together
            answers = list(pool.map(lambda i: ask(args.url, chats[i], args.new_tokens), ids))
        for i, answer in zip(ids, answers, strict=True):
            results.append(answer)
            chats[i].append({"role": "assistant", "content": answer["text"]})
    row = {**summarize(results), "wall_s": round(time.perf_counter() - t0, 2)}
    print(f"machine: {machine()}")
    print(f"llama-server at {args.url}: {row}")
    print(json.dumps({"bench": "llama_server_prefix", "machine": machine(), **row}))


if __name__ == "__main__":
    main()
