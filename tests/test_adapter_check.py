"""The LoRA adapter check (wire/adapter_check.py): what llama.cpp's loader expects of an
adapter passes, nothing else; hostile bytes are refused, never a crash. Fast: a tiny base
model file and its adapter are written here; the real Gemma and its generated adapter once."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures.lora_adapter import write_lora
from wire.adapter_check import AdapterRefused, check_adapter, read_shapes


def tiny_base(path: Path, arch: str = "llama") -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    w.add_tensor("blk.0.attn_q.weight", np.zeros((24, 16), np.float32))  # ne = [16, 24]
    w.add_tensor("blk.0.attn_v.weight", np.zeros((8, 16), np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.zeros((16,), np.float32))
    w.add_tensor("token_embd.weight", np.zeros((32, 16), np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    return path


def adapter(path: Path, arch: str = "llama", tensors: dict | None = None,
            kind: str = "adapter", meta=None) -> Path:
    """``meta``: writes the alpha and any other metadata (default: a float32 alpha of 8)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_string("general.type", kind)
    w.add_string("adapter.type", "lora")
    (meta or (lambda w: w.add_float32("adapter.lora.alpha", 8.0)))(w)
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {"blk.0.attn_q.weight": ((4, 16), (24, 4)),
                   "blk.0.attn_v.weight": ((4, 16), (8, 4))}
    for weight, (a, b) in tensors.items():
        if a is not None:
            w.add_tensor(f"{weight}.lora_a", rng.normal(size=a).astype(np.float32))
        if b is not None:
            w.add_tensor(f"{weight}.lora_b", rng.normal(size=b).astype(np.float32))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file):
        step()
    w.close()
    return path


@pytest.fixture
def base(tmp_path):
    return read_shapes(tiny_base(tmp_path / "base.gguf"))


def test_an_adapter_that_fits_its_base_passes(base, tmp_path):
    found = check_adapter(adapter(tmp_path / "a.gguf"), base)
    assert (found.architecture, found.rank, found.alpha) == ("llama", 4, 8.0)
    assert found.weights == ("blk.0.attn_q.weight", "blk.0.attn_v.weight")


@pytest.mark.parametrize("case, why", [
    ({"arch": "gemma3"}, "not for this model"),
    ({"kind": "model"}, "not a LoRA adapter"),
    ({"tensors": {"blk.0.attn_q.weight": ((4, 16), (24, 5))}}, "do not fit"),
    ({"tensors": {"blk.0.attn_q.weight": ((4, 15), (24, 4))}}, "do not fit"),
    ({"tensors": {"blk.0.attn_q.weight": ((4, 16), None)}}, "only one of"),
    ({"tensors": {"blk.9.attn_q.weight": ((4, 16), (24, 4))}}, "adapts no weight"),
    ({"tensors": {"blk.0.attn_norm.weight": ((4, 16), (24, 4))}}, "only a block's"),
    # the embeddings (tied to the output on Gemma: llama.cpp aborts on that pair)
    ({"tensors": {"token_embd.weight": ((4, 16), (32, 4))}}, "only a block's"),
    # keys llama.cpp reads with typed getters (another type aborts the process)
    ({"meta": lambda w: w.add_float64("adapter.lora.alpha", 8.0)}, "float32"),
    ({"meta": lambda w: w.add_float32("adapter.lora.alpha", float("nan"))}, "float32"),
    ({"meta": lambda w: w.add_float32("adapter.lora.alpha", -1.0)}, "float32"),
    ({"meta": lambda w: w.add_uint64("general.alignment", 32)}, "uint32"),
    ({"meta": lambda w: w.add_uint32("adapter.lora.task_name", 1)}, "is not a string"),
    ({"meta": lambda w: w.add_array("adapter.alora.invocation_tokens", [1, 2])},
     "activated LoRA"),
    ({"tensors": {"blk.0.attn_q.weight": ((300, 16), (24, 300))}}, "one rank of 1 to"),
    ({"tensors": {}}, "no tensors"),
])
def test_what_does_not_fit_is_refused_with_the_reason(base, tmp_path, case, why):
    with pytest.raises(AdapterRefused, match=why):
        check_adapter(adapter(tmp_path / "a.gguf", **case), base)


def test_a_model_file_a_truncated_file_and_garbage_are_refused(base, tmp_path):
    with pytest.raises(AdapterRefused, match="F32 or F16|not a LoRA"):
        check_adapter(tiny_base(tmp_path / "m.gguf"), base)
    good = adapter(tmp_path / "a.gguf").read_bytes()
    for name, data in [("cut", good[:-7]), ("garbage", os.urandom(4096)), ("empty", b""),
                       ("v2", good[:4] + b"\x02\x00\x00\x00" + good[8:])]:
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(AdapterRefused):
            check_adapter(path, base)


@settings(max_examples=400, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_hostile_bytes_are_refused_or_pass_only_what_fits(tmp_path, data):
    base = read_shapes(tiny_base(tmp_path / "base.gguf"))
    good = bytearray(adapter(tmp_path / "good.gguf").read_bytes())
    how = data.draw(st.sampled_from(["flip", "cut", "insert", "replace", "counts"]))
    if how == "flip":
        for _ in range(data.draw(st.integers(1, 4))):
            good[data.draw(st.integers(0, len(good) - 1))] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        good = good[: data.draw(st.integers(0, len(good) - 1))]
    elif how == "insert":
        i = data.draw(st.integers(0, len(good)))
        good[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    elif how == "replace":
        good = bytearray(data.draw(st.binary(max_size=2048)))
    else:  # huge counts and lengths where the header keeps them
        i = data.draw(st.sampled_from([8, 16, 24, 32]))
        good[i:i + 8] = data.draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little")
    path = tmp_path / "fuzzed.gguf"
    path.write_bytes(bytes(good))
    try:
        found = check_adapter(path, base)
    except AdapterRefused:
        return
    assert found.architecture == "llama" and 1 <= found.rank <= 256  # what passed still fits


@pytest.mark.slow
def test_the_generated_gemma_adapter_passes_and_is_refused_for_another_model(tmp_path):
    from config.models import CATALOG, SMOLLM2
    from tests.scheduler.conftest import model_path

    gemma = read_shapes(model_path())
    path = write_lora(model_path(), tmp_path / "gemma-lora.gguf")
    found = check_adapter(path, gemma)
    assert found.architecture == "gemma3" and found.rank == 8
    assert len(found.weights) == 3 * 18  # attn_q, attn_v, ffn_up of each of 18 blocks
    with pytest.raises(AdapterRefused, match="not for this model"):
        check_adapter(path, read_shapes(CATALOG[SMOLLM2].path()))
    with pytest.raises(AdapterRefused):
        check_adapter(model_path(), gemma)  # the base model itself is no adapter
