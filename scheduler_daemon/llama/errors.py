"""The error of the llama.cpp layer, apart so that every module of it can raise it."""

from __future__ import annotations


class EngineError(RuntimeError):
    """The model or context could not be created, or llama.cpp failed hard."""
