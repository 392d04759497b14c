"""An adapter file, checked when an operator registers it (docs/adapters.md).

The file must lie inside ``ADAPTERS_DIR`` once every link is followed (no ``..``, no symlink
out of it), be a regular file, and pass ``wire.adapter_check.check_adapter`` against the base
model's tensor shapes: a GGUF LoRA of the base's architecture and sizes. What it finds
(the path relative to ``ADAPTERS_DIR``, sha256, size, rank, alpha) is what the row keeps.
Every refusal is an ``AdapterFileError`` (a ``ValueError``) saying why, for the admin form and
the management command alike.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings

from config.models import default_path
from wire.adapter_check import AdapterRefused, check_adapter, read_shapes

_HASH_CHUNK_BYTES = 1 << 20


class AdapterFileError(ValueError):
    """A file that cannot be registered as an adapter (the message says why)."""


@dataclass(frozen=True, slots=True)
class AdapterFile:
    """What a checked file is: ``file`` relative to ADAPTERS_DIR (links resolved)."""

    file: str
    sha256: str
    size_bytes: int
    rank: int
    alpha: float | None


def adapters_dir() -> Path:
    """ADAPTERS_DIR with every link resolved (it may itself be a link)."""
    return Path(os.path.realpath(settings.ADAPTERS_DIR))


def absolute_path(file: str) -> str:
    """A registered file's absolute path, as a job carries it."""
    return str(adapters_dir() / file)


def base_model_path(model: str) -> str:
    """The base model's file: MODEL_PATH for MODEL_NAME, else the catalog's (Gemma's for a
    name it does not know: config/models.py)."""
    if model == settings.MODEL_NAME:
        return settings.MODEL_PATH
    return default_path(model)


@functools.lru_cache(maxsize=16)
def _shapes(path: str, size: int, mtime_ns: int) -> tuple[str, dict[str, tuple[int, ...]]]:
    return read_shapes(path)


def base_shapes(model: str) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The base model's architecture and tensor shapes (read once per file version)."""
    path = base_model_path(model)
    try:
        info = os.stat(path)
        return _shapes(path, info.st_size, info.st_mtime_ns)
    except (OSError, AdapterRefused) as exc:
        raise AdapterFileError(f"cannot read the base model {model!r}'s file {path}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from None


def inside(file: str | os.PathLike[str]) -> Path:
    """``file`` (relative to ADAPTERS_DIR, or absolute) resolved, when it lies inside
    ADAPTERS_DIR and is a regular file; else AdapterFileError."""
    root = adapters_dir()
    resolved = Path(os.path.realpath(root / file))  # an absolute ``file`` replaces root
    if resolved == root or root not in resolved.parents:
        raise AdapterFileError(f"{file} is not inside ADAPTERS_DIR ({root}), once links are "
                               "followed")
    try:
        mode = os.stat(resolved).st_mode
    except OSError as exc:
        raise AdapterFileError(f"{file}: {exc.strerror}") from None
    if not stat.S_ISREG(mode):
        raise AdapterFileError(f"{file} is not a regular file")
    return resolved


def inspect(model: str, file: str | os.PathLike[str]) -> AdapterFile:
    """Check ``file`` as an adapter of ``model`` (see the module); AdapterFileError."""
    path = inside(file)
    base = base_shapes(model)
    try:
        found = check_adapter(path, base)
    except AdapterRefused as exc:
        raise AdapterFileError(f"{file} is not a LoRA adapter for {model!r}: {exc}") from None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK_BYTES):
            digest.update(chunk)
    return AdapterFile(str(path.relative_to(adapters_dir())), digest.hexdigest(),
                       path.stat().st_size, found.rank, found.alpha)
