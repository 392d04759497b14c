"""The prefix cache on the real Gemma 3 270M: every tier hits for its tenant only, and a hit
really carries the cached content.

The recall prompt states a made-up code word early in a long prefix; only the cached
prefix holds it, and the greedy continuation repeats it. Whole generations are never
compared across cache states (llama.cpp's CPU logits shift with batch shape and KV
placement); the first token is, against the same prompt run without any cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig
from scheduler_daemon.core.state import TokenEvent
from wire.sampling import SamplingParams

pytestmark = pytest.mark.slow

FILLER = (
    "The weather report says the morning will be cool and the afternoon warm. "
    "Farmers in the valley are harvesting apples and pears this week. "
) * 4
PREFIX = f"Remember this. The secret code word is ZEBRAFIX. {FILLER}"
WARM_UP = PREFIX + "Question: what is the secret code word? Answer: the secret code word is"
RECALL = PREFIX + "Repeat: the secret code word is"


@dataclass
class Answer:
    text: str
    first_piece: str
    cached_tokens: int
    prompt_tokens: int


def make_core(engine, **config) -> InferenceCore:
    core = InferenceCore(engine, SchedulerConfig(chunk_size=512, max_queue=16, **config))
    core.start()
    return core


@pytest.fixture
def core(gemma_engine):
    core = make_core(gemma_engine)
    yield core
    core.stop(grace_s=0)


def submit(core, prompt, scope, max_tokens=6, **kw):
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw.pop("params", {}))
    return core.submit(prompt=prompt, params=params, cache_scope=scope, **kw)


def answer(handle) -> Answer:
    events = list(handle.events(timeout=120))
    pieces = [e.text for e in events if isinstance(e, TokenEvent)]
    stats = events[-1].stats
    first = pieces[0] if pieces else ""
    return Answer("".join(pieces), first, stats.cached_tokens, stats.prompt_tokens)


def ask(core, prompt, scope, **kw) -> Answer:
    return answer(submit(core, prompt, scope, **kw))


def uncached(core) -> Answer:
    """The recall prompt with no cache at all: the reference for the first token."""
    base = ask(core, RECALL, "reference", cache_prompt=False)
    assert "ZEBRA" in base.text and base.cached_tokens == 0  # the prompt works without any cache
    return base


def assert_recalls(hit: Answer, base: Answer) -> None:
    assert "ZEBRA" in hit.text  # the code word lives only in the cached part of the prompt
    assert hit.first_piece == base.first_piece


def wait_until_generating(core, request_id: str, timeout_s: float = 120) -> int:
    """The slot a request generates on, once it does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for slot in core.snapshot()["slots"]:
            if slot["request_id"] == request_id and slot["state"] == "generating":
                return slot["id"]
        time.sleep(0.01)
    raise AssertionError(f"request {request_id} never started generating")


def hit_tokens(core, tier: str) -> int:
    return core.scheduler.counters[f"cache_hit_tokens_{tier}"]


def test_same_slot_hit_for_the_tenant_only(core):
    base = uncached(core)
    ask(core, WARM_UP, "tenant-a")
    hit = ask(core, RECALL, "tenant-a")
    assert hit.cached_tokens > 100 and hit_tokens(core, "slot") == hit.cached_tokens
    assert hit_tokens(core, "cross_slot") == hit_tokens(core, "ram") == 0
    assert_recalls(hit, base)
    miss = ask(core, RECALL, "tenant-b")
    assert miss.cached_tokens == 0
    assert "ZEBRA" in miss.text


def test_cross_slot_hit_from_a_generating_slot_for_the_tenant_only(core):
    base = uncached(core)
    busy = submit(core, WARM_UP, "tenant-a", max_tokens=80, params={"ignore_eos": True})
    source = wait_until_generating(core, busy.id)
    hit = ask(core, RECALL, "tenant-a")  # the source slot is busy: it lands elsewhere and copies
    assert core.snapshot()["slots"][source]["request_id"] == busy.id  # it was generating all along
    assert hit.cached_tokens > 100 and hit_tokens(core, "cross_slot") == hit.cached_tokens
    assert_recalls(hit, base)
    miss = ask(core, RECALL, "tenant-b")
    assert miss.cached_tokens == 0
    assert answer(busy).cached_tokens == 0


def test_ram_hit_after_the_slot_was_reused_for_the_tenant_only(core):
    base = uncached(core)
    ask(core, WARM_UP, "tenant-a")
    story = "Story {}: a dog and a cat were friends for many years and"
    others = [
        submit(core, story.format(i), "tenant-c") for i in range(4)
    ]  # four at once: every slot is taken, tenant-a's one too
    for handle in others:
        answer(handle)
    counters = core.scheduler.counters
    assert counters["ram_save"] >= 1
    entries = core.snapshot()["cache"]["entries"]
    assert not any(e["cache_scope"] == "tenant-a" for e in entries if e["tier"] == "slot")
    hit = ask(core, RECALL, "tenant-a")
    assert hit.cached_tokens > 100 and hit_tokens(core, "ram") == hit.cached_tokens
    assert counters["ram_restore"] == 1 and counters["ram_restore_tokens"] == hit.cached_tokens
    assert_recalls(hit, base)
    miss = ask(core, RECALL, "tenant-b")
    assert miss.cached_tokens == 0


def test_ram_budget_is_never_exceeded_and_oversized_states_are_not_stored(gemma_engine):
    per_entry = 160 * gemma_engine.kv_bytes_per_token  # a little more than WARM_UP's state
    budget = int(1.5 * per_entry)  # room for one such state, not two
    core = make_core(gemma_engine, ram_cache_bytes=budget, cross_slot=False)
    totals = []
    core.scheduler.on_cache_event = lambda e: totals.append(core.scheduler.cache.ram.total_bytes)
    try:
        for word in ("ZEBRAFIX", "MANGOLUX", "QUILLOTTA", "PERIWINK"):
            ask(core, WARM_UP.replace("ZEBRAFIX", word), "tenant-a")
            others = [submit(core, f"Story {i}: once upon a time", "tenant-c") for i in range(4)]
            for handle in others:
                answer(handle)  # every slot reused: tenant-a's state goes to RAM
        counters = core.scheduler.counters
        assert counters["ram_save"] >= 3 and counters["ram_evict"] >= 2
        assert totals and max(totals) <= budget
        ram = core.snapshot()["cache"]
        assert ram["ram_bytes"] <= budget
        mine = [e for e in ram["entries"] if e["tier"] == "ram" and e["cache_scope"] == "tenant-a"]
        assert len(mine) == 1
    finally:
        core.stop(grace_s=0)
    tiny = make_core(gemma_engine, ram_cache_bytes=per_entry // 4)
    try:
        ask(tiny, WARM_UP, "tenant-a")
        for handle in [submit(tiny, f"Story {i}: once upon a time", "tenant-c") for i in range(4)]:
            answer(handle)
        assert tiny.scheduler.counters["ram_reject"] >= 1
        snap = tiny.snapshot()["cache"]
        kept = [(e["tier"], e["cache_scope"]) for e in snap["entries"]]
        assert ("ram", "tenant-a") not in kept
        assert snap["ram_bytes"] <= per_entry // 4
    finally:
        tiny.stop(grace_s=0)


def test_a_conversation_lands_on_its_slot_while_it_is_free(core, monkeypatch):
    placed: dict[str, int] = {}
    assign = core.scheduler._assign

    def record(job, slot):
        placed[job.id] = slot.seq_id
        assign(job, slot)

    monkeypatch.setattr(core.scheduler, "_assign", record)
    history = "A chat between a user and a helpful assistant.\n"
    for turn in range(3):
        history += f"User: tell me fact number {turn} about rivers.\nAssistant:"
        handle = submit(core, history, "tenant-a", session="conv-1", request_id=f"conv-{turn}")
        history += answer(handle).text + "\n"
        # other traffic in between, from another tenant, on other slots
        for handle in [
            submit(
                core,
                f"Unrelated {turn}-{i}: the weather today is",
                "tenant-c",
                request_id=f"other-{turn}-{i}",
            )
            for i in range(2)
        ]:
            answer(handle)
    unrelated = submit(
        core,
        "A completely different prompt for the same conversation:",
        "tenant-a",
        session="conv-1",
        request_id="conv-unrelated",
    )
    answer(unrelated)
    slots = {placed[f"conv-{t}"] for t in range(3)} | {placed["conv-unrelated"]}
    assert len(slots) == 1  # every turn, even one sharing no prefix, on the session's slot
    assert not slots & {v for k, v in placed.items() if k.startswith("other-2")}


def test_a_parked_state_is_saved_and_restored_for_the_tenant_only(gemma_engine):
    """With the park (as the daemon runs): tenant-a's prefix, evicted by another prompt, is
    parked in the engine's last sequence, saved after that prompt's decode, and restored."""
    core = make_core(gemma_engine, park_seq=True)  # three slots and the park
    park = gemma_engine.n_seq_max - 1
    try:
        base = uncached(core)
        ask(core, WARM_UP, "tenant-a")
        story = "Story {}: a dog and a cat were friends for many years and"
        for handle in [submit(core, story.format(i), "tenant-c") for i in range(3)]:
            answer(handle)  # every slot taken: tenant-a's prefix evicted
        counters = core.scheduler.counters
        assert counters["ram_save"] >= 1 and core.scheduler.cache.park_seq == park
        assert not core.scheduler.cache.parked and gemma_engine.kv_pos_max(park) == -1
        assert len(core.snapshot()["slots"]) == park
        hit = ask(core, RECALL, "tenant-a")
        assert hit.cached_tokens > 100 and hit_tokens(core, "ram") == hit.cached_tokens
        assert_recalls(hit, base)
        assert ask(core, RECALL, "tenant-b").cached_tokens == 0
    finally:
        core.stop(grace_s=0)
