"""The disk tier under the real Gemma 3 270M: a state saved by one core is restored by the
next over the same folder (a restart), for its tenant only, and carries the cached content.

Each "restart" is a new core (and a new scheduler, which empties every sequence of the
context) with a new ``DiskCache`` over the same folder: nothing survives but the files.
"""

from __future__ import annotations

import pytest

from scheduler_daemon.core.disk_cache import DiskCache
from scheduler_daemon.core.inference import InferenceCore
from scheduler_daemon.core.scheduler import SchedulerConfig

from .test_prefix_cache import PREFIX, RECALL, WARM_UP, answer, ask, hit_tokens, submit, uncached

pytestmark = pytest.mark.slow


def start(engine, folder, **config) -> InferenceCore:
    disk = DiskCache(folder, engine.cache_identity, 64 << 20, max_tokens=engine.n_ctx,
                     partial_max_tokens=engine.n_swa)
    disk.open()
    config.setdefault("disk_min_tokens", 64)
    core = InferenceCore(engine, SchedulerConfig(chunk_size=512, max_queue=16, **config),
                         disk=disk)
    core.start()
    return core


def files(folder) -> list:
    return sorted(p for p in folder.rglob("*.kvs"))


def test_a_finished_conversation_is_restored_from_disk_after_a_restart(gemma_engine, tmp_path):
    core = start(gemma_engine, tmp_path)
    try:
        base = uncached(core)
        first = ask(core, WARM_UP, "tenant-a")
    finally:
        core.stop(grace_s=0)
    assert core.scheduler.counters["disk_saves_finish"] == 1  # saved as it ended
    assert len(files(tmp_path)) == 1  # the reference ran uncached: nothing of it is kept

    core = start(gemma_engine, tmp_path)  # restarted: empty slots, empty RAM
    try:
        hit = ask(core, RECALL, "tenant-a")
        other = ask(core, RECALL, "tenant-b")
    finally:
        core.stop(grace_s=0)
    counters = core.scheduler.counters
    assert hit.cached_tokens > 100 and hit_tokens(core, "disk") == hit.cached_tokens
    assert counters["disk_restore"] == 1 and counters["disk_reads"] == 1
    assert hit.cached_tokens < first.prompt_tokens  # the shared prefix, not the whole turn
    assert "ZEBRA" in hit.text and hit.first_piece == base.first_piece  # the content is there
    assert other.cached_tokens == 0  # another tenant sending the same text


def test_a_corrupted_file_is_skipped_and_the_prompt_computed(gemma_engine, tmp_path):
    core = start(gemma_engine, tmp_path)
    try:
        ask(core, WARM_UP, "tenant-a")
    finally:
        core.stop(grace_s=0)
    [path] = files(tmp_path)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # in the state's bytes: only the data checksum can tell
    path.write_bytes(bytes(data))

    core = start(gemma_engine, tmp_path)
    try:
        again = ask(core, RECALL, "tenant-a")
    finally:
        core.stop(grace_s=0)
    counters = core.scheduler.counters
    assert again.cached_tokens == 0 and "ZEBRA" in again.text
    assert counters["disk_corrupt"] == 1 and counters["disk_restore_failures"] == 1
    assert path not in files(tmp_path)  # deleted (the new turn's own state may be there)


def test_a_stop_saves_the_state_of_a_request_handed_back_mid_generation(gemma_engine, tmp_path):
    core = start(gemma_engine, tmp_path)
    handle = submit(core, WARM_UP, "tenant-a", max_tokens=400, params={"ignore_eos": True})
    for _event in handle.events(timeout=120):  # generating
        break
    handed = core.stop(grace_s=0, hand_back=True)
    assert handle.id in handed
    counters = core.scheduler.counters
    assert counters["disk_saves_shutdown"] == 1 and counters["disk_saves_finish"] == 0
    [path] = files(tmp_path)

    core = start(gemma_engine, tmp_path)  # the daemon that continues it finds its prefix
    try:
        hit = ask(core, RECALL, "tenant-a")
    finally:
        core.stop(grace_s=0)
    assert hit.cached_tokens > 100 and core.scheduler.counters["disk_restore"] == 1


def test_without_the_disk_tier_a_restart_is_cold(gemma_engine):
    """The control: the hits above come from the files, not from the engine's context."""
    core = InferenceCore(gemma_engine, SchedulerConfig(chunk_size=512, max_queue=16))
    core.start()
    try:
        ask(core, WARM_UP, "tenant-a")
    finally:
        core.stop(grace_s=0)
    core = InferenceCore(gemma_engine, SchedulerConfig(chunk_size=512, max_queue=16))
    core.start()
    try:
        assert answer(submit(core, RECALL, "tenant-a")).cached_tokens == 0
    finally:
        core.stop(grace_s=0)


def stats_of(handle):
    return list(handle.events(timeout=120))[-1].stats


def test_every_tier_accounts_read_and_created_tokens_as_the_prompt(gemma_engine, tmp_path):
    core = start(gemma_engine, tmp_path)
    try:
        cold = stats_of(submit(core, WARM_UP, "tenant-a"))
        slot = stats_of(submit(core, RECALL, "tenant-a"))
    finally:
        core.stop(grace_s=0)
    core = start(gemma_engine, tmp_path)
    try:
        disk = stats_of(submit(core, PREFIX + "Tell me: the code word is", "tenant-a"))
        off = stats_of(submit(core, RECALL, "tenant-a", cache_prompt=False))
    finally:
        core.stop(grace_s=0)
    assert (cold.cache_hit, cold.cache_tier) == ("none", None)
    assert (slot.cache_hit, slot.cache_tier) == ("prefix", "slot")
    assert (disk.cache_hit, disk.cache_tier) == ("prefix", "disk")
    for stats in (cold, slot, disk):
        assert stats.cached_tokens + stats.cache_created_tokens == stats.prompt_tokens
    assert (off.cached_tokens, off.cache_created_tokens, off.cache_hit) == (0, 0, "none")
