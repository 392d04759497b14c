"""llama.cpp's compute runs as one OpenMP team for the life of the process.

ggml runs each graph as an OpenMP team whose master is the thread that calls
``llama_decode``; libgomp keeps a pool of workers per master thread. If a second thread
ever decodes with several threads (the engine's load-time probe on the thread that builds
it, then the scheduler's loop), libgomp manages more threads than the machine has CPUs and
throttles the spin at every barrier to ~100 iterations: each of a decode's ops then ends
in a futex sleep and wake (on 2 vCPUs the decode threads idled ~15% of the time;
docs/performance.md). What a process can see of that is its threads: after the engine is
built and the core has served a request (and an embeddings job, on its second context),
exactly ``n_threads - 1`` threads that Python did
not start exist beyond those that existed before the engine (the loop's one team).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import model_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, threading
import numpy  # its BLAS threads, if any, belong to the baseline

def foreign_threads():
    python = {t.native_id for t in threading.enumerate()}
    return sorted(int(t) for t in os.listdir("/proc/self/task") if int(t) not in python)

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
from scheduler_daemon.core.scheduler import SchedulerConfig
from wire.sampling import SamplingParams

before = foreign_threads()
engine = LlamaEngine(EngineConfig(model_path=sys.argv[1], n_ctx=1024, n_batch=256,
                                  n_seq_max=2, n_threads=2))
loaded = foreign_threads()
core = InferenceCore(engine, SchedulerConfig())
core.start()
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
for prompt in ("The capital of France is", "Once upon a time"):
    core.submit(prompt=prompt, params=params).result(timeout=120)
# an embeddings job too: its own context, decoded by the same loop thread (one team)
embedded = threading.Event()
vectors = []
core.submit_embeddings("e", [engine.tokenize("a cat"), engine.tokenize("a dog")],
                       lambda v, err: (vectors.append((v, err)), embedded.set()))
assert embedded.wait(120) and vectors[0][1] is None and len(vectors[0][0]) == 2
served = foreign_threads()
core.stop(grace_s=0)
print(json.dumps({"before": before, "loaded": loaded, "served": served}))
"""


def test_the_engine_and_the_loop_make_one_openmp_team():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, model_path()],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    threads = json.loads(done.stdout.strip().splitlines()[-1])
    before, loaded, served = (set(threads[k]) for k in ("before", "loaded", "served"))
    assert loaded == before, "building the engine started threads of its own"
    assert len(served - before) == 1, f"one OpenMP worker for n_threads=2, got {threads}"


WARNING_CHILD = r"""
import logging, sys, threading
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
from scheduler_daemon.core.engine_api import BatchRow

engine = LlamaEngine(EngineConfig(model_path=sys.argv[1], n_ctx=512, n_batch=64,
                                  n_seq_max=1, n_threads=2))

def decode():
    engine.kv_remove(0)
    assert engine.decode([BatchRow(0, (engine.bos_token, 1, 2), 0, True)]) == 0

for _ in range(2):  # one thread after another: each ended thread took its pool with it
    thread = threading.Thread(target=decode, name="ended")
    thread.start()
    thread.join()
print("--- sequential done", file=sys.stderr, flush=True)
decoded, release = threading.Event(), threading.Event()
alive = threading.Thread(target=lambda: (decode(), decoded.set(), release.wait()), name="alive")
alive.start()
decoded.wait(60)
decode()  # the main thread, while "alive" lives: two teams
release.set()
alive.join()
"""


def test_a_second_live_decoding_thread_is_warned_about_and_a_successor_is_not():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", WARNING_CHILD, model_path()],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    before, after = done.stderr.split("--- sequential done")
    assert "second thread" not in before
    assert after.count("decodes from a second thread (MainThread, while alive lives)") == 1
