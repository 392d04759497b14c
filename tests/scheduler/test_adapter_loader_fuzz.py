"""Adapter files that pass wire/adapter_check.py survive llama.cpp's loader: variants of the
generated Gemma adapter with metadata llama.cpp reads (or might) of every GGUF type, and
with scrambled tensor data, are checked; each one the check passes is loaded by the real
``llama_adapter_lora_init`` in a separate process, which must not die (an abort there
would take a daemon and every tenant's requests with it)."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

from tests.fixtures.lora_adapter import write_lora
from wire.adapter_check import AdapterRefused, check_adapter, read_shapes

from .conftest import model_path

pytestmark = pytest.mark.slow

KEYS = ["adapter.lora.alpha", "adapter.lora.task_name", "adapter.lora.prompt_prefix",
        "adapter.alora.invocation_tokens", "general.alignment", "general.name",
        "adapter.lora.rank", "general.file_type"]
T = gguf.GGUFValueType
SCALARS = {T.UINT8: 7, T.INT8: -7, T.UINT16: 7, T.INT16: -7, T.UINT32: 32, T.INT32: -32,
           T.FLOAT32: 16.0, T.BOOL: True, T.STRING: "x", T.UINT64: 32, T.INT64: -32,
           T.FLOAT64: 16.0}


def variant(tensors, out, rng: random.Random) -> None:
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    for key in rng.sample(KEYS, rng.randint(1, 3)):
        kind = rng.choice([*SCALARS, T.ARRAY])
        if kind == T.ARRAY:
            w.add_array(key, rng.choice([[1, 2, 3], ["a", "b"], [1.5]]))
        else:
            w.add_key_value(key, SCALARS[kind], kind)
    for name, data in tensors:
        if rng.random() < 0.1:  # scrambled values: NaN, infinities, huge
            data = data.copy()
            data.flat[rng.randrange(data.size)] = rng.choice([np.nan, np.inf, -np.inf, 3e38])
        w.add_tensor(name, data)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()


LOADER = textwrap.dedent("""
    import sys
    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
    from scheduler_daemon.llama.errors import EngineError
    engine = LlamaEngine(EngineConfig(model_path=sys.argv[1], n_ctx=256, n_batch=64,
                                      n_seq_max=1, n_threads=1))
    for path in sys.argv[2:]:
        try:
            engine.free_adapter(engine.load_adapter(path))
            print("loaded", path, flush=True)
        except EngineError:
            print("refused", path, flush=True)
""")


def test_what_the_check_passes_llama_cpp_loads_without_dying(tmp_path):
    good = write_lora(model_path(), tmp_path / "good.gguf", rank=4)
    reader = gguf.GGUFReader(str(good))
    tensors = [(t.name, np.array(t.data)) for t in reader.tensors]
    base = read_shapes(model_path())
    rng = random.Random(35)
    passed, refused = [], 0
    for i in range(60):
        out = tmp_path / f"v{i}.gguf"
        variant(tensors, out, rng)
        try:
            check_adapter(out, base)
        except AdapterRefused:
            refused += 1
            out.unlink()
            continue
        passed.append(str(out))
    assert passed and refused  # both kinds were made
    run = subprocess.run([sys.executable, "-c", LOADER, model_path(), *passed],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("\n") == len(passed)  # every one answered
