"""The Redis scripts are Lua files (wire/lua/), not Python strings: each names in its header
every KEYS and ARGV entry it reads, a shared part heads only the files that name it back,
and every script Redis is given compiles. A script hidden in Python, an entry read by
position but not named, or a composition one side does not declare fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from wire import queue
from wire.scripts import _DIR, _heads, _read, after, lua

ROOT = Path(__file__).resolve().parents[1]
FILES = sorted(p.stem for p in _DIR.glob("*.lua"))
SHARED = [name for name in FILES if _heads(_read(name))]
SCRIPTS = [name for name in FILES if name not in SHARED]
_ENTRY = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")
_NAMED = re.compile(r"\b(KEYS|ARGV)\[(\d+)(\.\.)?(\d*)\]")  # [n], [n..m], [n..]


def _header(text: str) -> str:
    lines = text.splitlines()
    end = next(i for i, line in enumerate(lines) if not line.startswith("--"))
    return "\n".join(lines[:end])


def _named(header: str) -> set[tuple[str, int]]:
    named = set()
    for kind, first, dots, last in _NAMED.findall(header):
        end = int(last) if last else 999 if dots else int(first)
        named.update((kind, i) for i in range(int(first), end + 1))
    return named


def test_no_python_module_holds_a_script():
    sources = [p for d in ("wire", "inference", "scheduler_daemon", "accounts")
               for p in (ROOT / d).rglob("*.py")]
    holding = [str(p.relative_to(ROOT)) for p in sources
               if re.search(r"redis\.p?call\(", p.read_text(encoding="utf-8"))]
    assert holding == []


@pytest.mark.parametrize("name", FILES)
def test_the_header_names_every_entry_the_file_reads(name):
    text = _read(name)
    header = _header(text)
    body = text[len(header):]
    named = _named(header)
    for part in after(text):  # the shared parts name their own
        named |= _named(_header(_read(part)))
    read = {(kind, int(i)) for kind, i in _ENTRY.findall(body)}
    assert read - named == set(), f"{name}.lua reads entries its header does not name"


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_part_heads_the_files_that_name_it(name):
    heads = _heads(_read(name))
    followers = [n for n in SCRIPTS if name in after(_read(n))]
    assert sorted(f"{n}.lua" for n in followers) == sorted(heads)
    for follower in followers:
        parts = after(_read(follower))
        assert lua(follower) == "".join(_read(p) for p in parts) + _read(follower)
    with pytest.raises(ValueError):
        lua(name)


def test_the_routing_names_what_python_sends_and_counts():
    """enqueue.lua compares the mode and writes the reasons as literals: the same words as
    queue.ROUTES and queue.ROUTE_REASONS."""
    text = lua("enqueue")
    for word in (*queue.ROUTES, *queue.ROUTE_REASONS):
        assert f"'{word}'" in text


@pytest.mark.parametrize("name", SCRIPTS)
def test_redis_compiles_each_script(redis_client, name):
    redis_client.script_load(lua(name))
