"""A LoRA adapter through the engine layer on the real Gemma 3 270M: the generated test
adapter (tests/fixtures/lora_adapter.py) loads, changes the greedy output, and taking it off
gives the base model's output back. The requests' path to adapters (checks, names, batching
by adapter) is issue 35's; this is the engine's part."""

from __future__ import annotations

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.llama.errors import EngineError
from tests.fixtures.lora_adapter import write_lora
from wire.sampling import SamplingParams

from .conftest import model_path

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_file(tmp_path_factory):
    return write_lora(model_path(), tmp_path_factory.mktemp("lora") / "gemma-lora.gguf")


def greedy(engine) -> str:
    core = InferenceCore(engine, SchedulerConfig(chunk_size=512, max_queue=4))
    core.start()
    try:
        return core.submit(prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=10),
                           cache_prompt=False).result(timeout=120).text
    finally:
        core.stop(grace_s=0)


def test_the_test_adapter_changes_the_greedy_output_and_comes_off_again(gemma_engine,
                                                                        adapter_file):
    base = greedy(gemma_engine)
    handle = gemma_engine.load_adapter(str(adapter_file))
    try:
        gemma_engine.use_adapters([(handle, 1.0)])
        tuned = greedy(gemma_engine)
        gemma_engine.use_adapters([])
        again = greedy(gemma_engine)
    finally:
        gemma_engine.use_adapters([])
        gemma_engine.free_adapter(handle)
    assert tuned != base
    assert again == base  # the same batch shape as the first: the base output exactly


def test_a_file_that_is_no_adapter_is_refused(gemma_engine, tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 16)  # a header with no tensors
    with pytest.raises(EngineError):
        gemma_engine.load_adapter(str(path))
