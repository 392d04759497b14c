"""Redis scripts kept as Lua files in ``wire/lua/``, each opening with a header that names
its KEYS and ARGV and binding them to local names at its top. Callers load a script's text
once, at import (``lua(name)``), and run it with ``eval`` or ``register_script``.

No script is built by templating: what a script needs of Python's constants (a TTL, a
consumer group's name, a code) comes in its ARGV. Scripts that share a part are composed by
one documented concatenation, checked both ways when loaded:

- a shared part (``queue_head.lua``, ``in_flight.lua``, ``windows.lua``) names the files it
  heads on a line ``-- Heads: a.lua, b.lua``, binds the KEYS and ARGV they share (if any),
  defines their common functions and returns nothing;
- each such file opens with ``-- After: <part>.lua[, <part>.lua]`` and is loaded as the
  parts' texts, in that order, followed by its own (``lua("enqueue")`` = queue_head.lua +
  enqueue.lua; ``lua("admit")`` = in_flight.lua + windows.lua + admit.lua).

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
_AFTER = re.compile(r"-- After: (\w+\.lua(?:, \w+\.lua)*)\n")
_HEADS = re.compile(r"^-- Heads: (.+)$", re.MULTILINE)


@cache
def lua(name: str) -> str:
    """The text of ``wire/lua/<name>.lua``: after the texts of the shared parts its first
    line names (``-- After: <part>.lua, ...``), if it names any."""
    text = _read(name)
    if _heads(text):
        raise ValueError(f"wire/lua/{name}.lua is a shared part: load a file it heads")
    texts = []
    for part in after(text):
        texts.append(_read(part))
        if f"{name}.lua" not in _heads(texts[-1]):
            raise ValueError(f"wire/lua/{name}.lua comes after {part}.lua, which does not "
                             f"name it on its '-- Heads:' line")
    return "".join(texts) + text


def after(text: str) -> list[str]:
    """The shared parts a file's first line names (``-- After: a.lua, b.lua``), in order."""
    found = _AFTER.match(text)
    if found is None:
        return []
    return [n.strip().removesuffix(".lua") for n in found.group(1).split(",")]


def _read(name: str) -> str:
    return (_DIR / f"{name}.lua").read_text(encoding="utf-8")


def _heads(text: str) -> list[str]:
    found = _HEADS.search(text)
    return [] if found is None else [n.strip() for n in found.group(1).split(",")]
