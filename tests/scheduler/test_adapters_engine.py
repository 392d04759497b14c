"""A LoRA adapter through the engine layer on the real Gemma 3 270M: the generated test
adapter (tests/fixtures/lora_adapter.py) loads, changes the greedy output, and taking it off
gives the base model's output back. The requests' path to adapters (checks, names, batching
by adapter) is issue 35's; this is the engine's part."""

from __future__ import annotations

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import TokenEvent
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


# -- requests with adapters through the core (core/adapters.py, the scheduler's groups) -----

LONG = ("A library keeps its books on numbered shelves, and every shelf has a card that "
        "lists the titles in order. ") * 12


def adapter_spec(path, adapter_id: str = "ad_00000000000000a1", scale: float = 1.0) -> dict:
    import hashlib

    return {"id": adapter_id, "path": str(path), "scale": scale,
            "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def ask(core, prompt=PROMPT, adapter=None, scope="t1", max_tokens=10, **kw):
    return core.submit(prompt=prompt, params=SamplingParams(temperature=0, max_tokens=max_tokens),
                       cache_scope=scope, adapter=adapter, **kw)


def test_an_adapters_requests_decode_apart_from_the_base_models_in_the_same_ticks(
        core, adapter_file):
    spec = adapter_spec(adapter_file)
    base_alone = ask(core, cache_prompt=False).result(timeout=120).text
    tuned_alone = ask(core, adapter=spec, cache_prompt=False).result(timeout=120).text
    assert tuned_alone != base_alone
    # both at once, twice over: each group decodes alone, so each gets its own output
    groups = []
    core.tick_listeners.append(lambda stats: groups.append(core.scheduler.last_plan.group))
    handles = [ask(core, adapter=spec if i % 2 else None, cache_prompt=False)
               for i in range(4)]
    texts = [h.result(timeout=120).text for h in handles]
    assert texts == [base_alone, tuned_alone, base_alone, tuned_alone]
    # the groups took turns tick by tick while both had work (one after the other would
    # switch 3 times)
    assert sum(a != b for a, b in zip(groups, groups[1:], strict=False)) >= 10, groups
    # n > 1 under the adapter: every choice is decoded under it
    both = core.submit(prompt=PROMPT, params=SamplingParams(temperature=0, max_tokens=10),
                       cache_scope="t1", adapter=spec, cache_prompt=False, n=2)
    texts = ["", ""]
    for event in both.events(timeout=120):
        if isinstance(event, TokenEvent):
            texts[event.index] += event.text
    # (two rows: another batch shape than alone, so compared with each other and the base)
    assert texts[0] == texts[1] and texts[0] != base_alone
    summary = core.adapters.summary()
    assert summary["loaded"] == [spec["id"]] and summary["loads"] == {spec["id"]: 1}
    assert summary["tokens"][spec["id"]] > 0


def test_a_prefix_cached_under_an_adapter_is_reused_only_under_it_at_its_scale(
        core, adapter_file):
    spec = adapter_spec(adapter_file)

    def cached(adapter, scope="t1") -> int:
        done = ask(core, LONG, adapter=adapter, scope=scope, max_tokens=2,
                   cache_prompt=True).result(timeout=120)
        return done.finished.stats.cached_tokens

    assert cached(spec) == 0  # the first: computed under the adapter
    assert cached(spec) > 200  # the same again: a hit
    assert cached(None) == 0  # without the adapter: computed again
    assert cached({**spec, "scale": 0.5}) == 0  # another scale: again
    assert cached(spec, scope="t2") == 0  # another tenant, the same adapter: again
    assert cached(None) > 200 and cached({**spec, "scale": 0.5}) > 200  # each its own


def test_a_flood_on_an_adapter_delays_the_base_model_by_one_turn(core, adapter_file):
    """Three slots full of one tenant's adapter requests (more queued), then a base-model
    request from another tenant: once it holds a slot, it decodes every other tick."""
    spec = adapter_spec(adapter_file)
    flood = [ask(core, f"Story {i}:", adapter=spec, scope="flood", max_tokens=40,
                 cache_prompt=False) for i in range(6)]
    groups: list[str] = []
    core.tick_listeners.append(lambda stats: groups.append(core.scheduler.last_plan.group))
    base = ask(core, PROMPT, scope="other", max_tokens=12, cache_prompt=False)
    base.result(timeout=300)
    for handle in flood:
        handle.result(timeout=300)
    ours = [i for i, g in enumerate(groups) if g == ""]
    assert len(ours) >= 12  # its prefill and its 12 tokens' decodes (with the first sample)
    first, last = ours[0], ours[11]
    assert all(b - a == 2 for a, b in zip(ours[:12], ours[1:12], strict=False)), groups
    assert set(groups[first:last]) == {"", spec["id"] + "@1.0"}
