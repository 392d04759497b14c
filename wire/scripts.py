"""Redis scripts kept as Lua files in ``wire/lua/``, each with a header naming its KEYS and
ARGV; callers register the text (``redis.Redis.register_script``)."""

from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).with_name("lua")


def lua(name: str) -> str:
    """The text of ``wire/lua/<name>.lua``."""
    return (_DIR / f"{name}.lua").read_text(encoding="utf-8")
