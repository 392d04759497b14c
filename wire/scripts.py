"""Redis scripts kept as Lua files in ``wire/lua/``, each opening with a header that names
its KEYS and ARGV and binding them to local names at its top. Callers load a script's text
once, at import (``lua(name)``), and run it with ``eval`` or ``register_script``.

No script is built by templating: what a script needs of Python's constants (a TTL, a
consumer group's name, a code) comes in its ARGV. Scripts that share a part are composed by
one documented concatenation, checked both ways when loaded:

- the shared part (``queue_head.lua``, ``in_flight.lua``) names the files it heads on a
  line ``-- Heads: a.lua, b.lua``, binds the KEYS and ARGV they share, defines their common
  functions and returns nothing;
- each such file opens with ``-- After: <shared part>.lua`` and is loaded as the shared
  part's text followed by its own (``lua("enqueue")`` = queue_head.lua + enqueue.lua).

A file that names a part that does not name it back, or a part loaded alone, is an error
at import. The gate of a model's queue and the tenant limits are one complete script
(``admit.lua``), the gate taken when its keys are given: no script is spliced into
another.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

_DIR = Path(__file__).with_name("lua")
_AFTER = re.compile(r"-- After: (\w+)\.lua\n")
_HEADS = re.compile(r"^-- Heads: (.+)$", re.MULTILINE)


@cache
def lua(name: str) -> str:
    """The text of ``wire/lua/<name>.lua``: after the text of the shared part its first
    line names (``-- After: <part>.lua``), if it names one."""
    text = _read(name)
    if _heads(text):
        raise ValueError(f"wire/lua/{name}.lua is a shared part: load a file it heads")
    after = _AFTER.match(text)
    if after is None:
        return text
    part = _read(after.group(1))
    if f"{name}.lua" not in _heads(part):
        raise ValueError(f"wire/lua/{name}.lua comes after {after.group(1)}.lua, which does "
                         f"not name it on its '-- Heads:' line")
    return part + text


def _read(name: str) -> str:
    return (_DIR / f"{name}.lua").read_text(encoding="utf-8")


def _heads(text: str) -> list[str]:
    found = _HEADS.search(text)
    return [] if found is None else [n.strip() for n in found.group(1).split(",")]
