"""The prompt cache's disk tier as files: format, checks, budget, shares, the writer thread.

Pure file handling (no model): the state bytes here are opaque. The tier under a real
engine is tests/scheduler/test_disk_cache_real.py; through a restarted daemon,
tests/test_disk_cache_e2e.py.
"""

from __future__ import annotations

import os
import stat
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_daemon.core.disk_cache import (
    MAGIC,
    DiskCache,
    DiskWriter,
    encode,
    entry_key,
    scope_dir_name,
)

IDENTITY = "a" * 64


def opened(root: Path, budget: int = 1 << 20, identity: str = IDENTITY, **kw) -> DiskCache:
    disk = DiskCache(root, identity, budget, max_tokens=4096, **kw)
    disk.open()
    return disk


def files(disk: DiskCache) -> list[Path]:
    return sorted(p for p in disk.dir.rglob("*") if p.is_file())


def test_a_state_written_is_found_again_by_a_new_cache_over_the_same_folder(tmp_path):
    disk = opened(tmp_path)
    data = os.urandom(3000)
    assert disk.write("tenant-a", [1, 2, 3, 4], data) is not None
    [path] = files(disk)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(disk.dir.stat().st_mode) == 0o700
    assert path.parent.name == scope_dir_name("tenant-a")  # the scope is part of the folder
    again = opened(tmp_path)  # a restarted daemon
    entry, n = again.lookup("tenant-a", [1, 2, 3, 4, 5, 6], limit=5)
    assert n == 4 and bytes(again.read(entry)) == data
    assert again.lookup("tenant-b", [1, 2, 3, 4, 5, 6], limit=5) == (None, 0)  # scope
    other = opened(tmp_path, identity="b" * 64)  # another model or KV layout
    assert other.lookup("tenant-a", [1, 2, 3, 4, 5, 6], limit=5) == (None, 0)


def test_the_longest_prefix_wins_and_a_shorter_state_made_redundant_goes(tmp_path):
    disk = opened(tmp_path)
    disk.write("t", [1, 2, 3], b"x" * 100)
    disk.write("t", [7, 8, 9, 10], b"y" * 100)
    disk.write("t", [1, 2, 3, 4, 5], b"z" * 100)  # serves every lookup [1, 2, 3] did
    assert len(disk.entries()) == 2 and len(files(disk)) == 2
    entry, n = disk.lookup("t", [1, 2, 3, 4, 5, 6], limit=5)
    assert n == 5 and bytes(disk.read(entry)) == b"z" * 100


def corrupt_cases():
    def truncate(b: bytearray) -> bytes:
        return bytes(b[:-10])

    def flip_data(b: bytearray) -> bytes:
        b[-5] ^= 0x40
        return bytes(b)

    def flip_header(b: bytearray) -> bytes:
        b[len(MAGIC) + 10] ^= 0x01
        return bytes(b)

    def flip_token(b: bytearray) -> bytes:
        # the tokens follow the header: find them by re-encoding the head
        head, _ = encode(IDENTITY, "t", [5, 6, 7, 8], b"")
        b[len(head) - 2] ^= 0x01
        return bytes(b)

    def garbage(_b: bytearray) -> bytes:
        return os.urandom(500)

    def empty(_b: bytearray) -> bytes:
        return b""

    return [truncate, flip_data, flip_header, flip_token, garbage, empty]


@pytest.mark.parametrize("damage", corrupt_cases(), ids=lambda f: f.__name__)
def test_a_damaged_file_is_skipped_deleted_and_counted_at_open_or_at_read(tmp_path, damage):
    disk = opened(tmp_path)
    disk.write("t", [5, 6, 7, 8], os.urandom(2000))
    [path] = files(disk)
    good = path.read_bytes()
    entry, _ = disk.lookup("t", [5, 6, 7, 8, 9], limit=4)
    path.write_bytes(damage(bytearray(good)))  # damaged while indexed: the read finds it
    assert disk.read(entry) is None
    assert not path.exists() and disk.counters["disk_corrupt"] == 1
    assert disk.lookup("t", [5, 6, 7, 8, 9], limit=4) == (None, 0)
    path.write_bytes(damage(bytearray(good)))  # damaged before a restart
    again = opened(tmp_path)  # the open checks heads; the data is checked when read
    assert all(again.read(entry) is None for entry in again.entries())
    assert again.entries() == [] and not path.exists()
    assert again.counters["disk_corrupt"] == 1


def test_a_file_moved_to_another_scopes_folder_is_not_that_scopes(tmp_path):
    disk = opened(tmp_path)
    disk.write("victim", [1, 2, 3, 4], b"secret" * 100)
    [path] = files(disk)
    theirs = disk.dir / scope_dir_name("attacker")
    theirs.mkdir(mode=0o700)
    path.rename(theirs / path.name)
    again = opened(tmp_path)
    assert again.lookup("attacker", [1, 2, 3, 4, 5], limit=4) == (None, 0)
    assert again.counters["disk_corrupt"] == 1 and files(again) == []


def test_leftover_temporary_files_and_strangers_are_removed_at_open(tmp_path):
    disk = opened(tmp_path)
    disk.write("t", [1, 2, 3, 4], b"x" * 100)
    folder = disk.dir / scope_dir_name("t")
    (folder / ".tmp-deadbeef").write_bytes(b"half a state")
    (folder / "notes.txt").write_text("?")
    (disk.dir / "stray-file").write_text("?")
    again = opened(tmp_path)
    assert [p.name for p in files(again)] == [entry_key(IDENTITY, "t", [1, 2, 3, 4]) + ".kvs"]


def test_the_byte_budget_is_never_exceeded_and_the_least_recently_used_goes(tmp_path):
    size = len(encode(IDENTITY, "t", [0] * 4, b"x" * 1000)[0]) + 1000
    disk = opened(tmp_path, budget=3 * size)
    for i in range(3):
        disk.write("t", [i, i, i, i], b"x" * 1000)
    entry, _ = disk.lookup("t", [0, 0, 0, 0, 9], limit=4)
    disk.read(entry)  # [0...] is used: [1...] is now the least recent
    for i in range(3, 8):
        disk.write("t", [i, i, i, i], b"x" * 1000)
        assert sum(p.stat().st_size for p in files(disk)) <= 3 * size
    kept = {e.tokens[0] for e in disk.entries()}
    assert kept == {5, 6, 7}
    too_big = disk.write("t", [9] * 4, b"x" * (3 * size))
    assert too_big is None and disk.counters["disk_rejects"] == 1


def test_a_smaller_budget_after_a_restart_evicts_down_to_it(tmp_path):
    disk = opened(tmp_path, budget=1 << 20)
    for i in range(6):
        disk.write("t", [i] * 4, b"x" * 1000)
    again = opened(tmp_path, budget=2500)
    assert len(again.entries()) == 2 and len(files(again)) == 2


def test_one_tenant_cannot_push_out_anothers_states_past_its_share(tmp_path):
    size = len(encode(IDENTITY, "warm", [0] * 4, b"x" * 1000)[0]) + 1000
    disk = opened(tmp_path, budget=4 * size, tenant_share=0.5)
    disk.write("warm", [1, 1, 1, 1], b"x" * 1000)
    for i in range(20):  # a flood of distinct prompts
        disk.write("flood", [100 + i] * 4, b"x" * 1000)
    assert disk.lookup("warm", [1, 1, 1, 1, 2], limit=4)[1] == 4
    assert disk.index.scope_bytes("flood") <= 2 * size


def test_evicting_a_scope_deletes_its_files(tmp_path):
    disk = opened(tmp_path)
    disk.write("a", [1, 2, 3, 4], b"x" * 100)
    disk.write("b", [1, 2, 3, 4], b"x" * 100)
    assert disk.evict_scope("a") == 1
    assert [p.parent.name for p in files(disk)] == [scope_dir_name("b")]


def test_the_writer_writes_off_the_callers_thread_and_drops_when_full(tmp_path):
    disk = opened(tmp_path)
    saved = []
    writer = DiskWriter(disk, lambda *args: saved.append(args), max_queue=1)
    assert writer.submit("t", [1, 2, 3, 4], b"x" * 100, "finish")
    assert not writer.submit("t", [1, 2, 3, 4], b"x" * 100, "finish") or writer.flush(5)
    assert writer.flush(5)
    writer.close()
    assert saved and saved[0][0] == "t" and saved[0][3] == "finish"
    assert disk.counters["disk_saves_finish"] == 1 and len(files(disk)) == 1


# -- fuzz: hostile bytes in the folder never crash the loader nor reach the engine ---------


def _valid_file(tmp_path: Path) -> tuple[DiskCache, Path, bytes, bytes]:
    disk = opened(tmp_path)
    data = bytes(range(256)) * 8
    disk.write("t", [3, 1, 4, 1, 5], data)
    [path] = files(disk)
    return disk, path, path.read_bytes(), data


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_fuzz_any_change_to_a_file_is_caught_before_its_bytes_are_used(tmp_path, data):
    root = tmp_path / os.urandom(4).hex()
    disk, path, good, payload = _valid_file(root)
    mutated = bytearray(good)
    how = data.draw(st.sampled_from(["flip", "cut", "insert", "replace"]))
    if how == "flip":
        i = data.draw(st.integers(0, len(mutated) - 1))
        mutated[i] ^= data.draw(st.integers(1, 255))
    elif how == "cut":
        mutated = mutated[: data.draw(st.integers(0, len(mutated) - 1))]
    elif how == "insert":
        i = data.draw(st.integers(0, len(mutated)))
        mutated[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    else:
        mutated = bytearray(data.draw(st.binary(max_size=2048)))
    path.write_bytes(bytes(mutated))
    again = DiskCache(root, IDENTITY, 1 << 20, max_tokens=4096)
    again.open()  # never raises
    for entry in again.entries():
        got = again.read(entry)
        assert got is None or (bytes(got) == payload and entry.tokens == [3, 1, 4, 1, 5])
    assert bytes(mutated) == good or again.counters["disk_corrupt"] + len(again.entries()) >= 1


def test_counters_are_shared_with_the_caller(tmp_path):
    counters: Counter[str] = Counter()
    disk = opened(tmp_path, counters=counters)
    disk.write("t", [1, 2, 3, 4], b"x" * 100)
    assert counters["disk_saves"] == 1 and counters["disk_save_bytes"] > 100
