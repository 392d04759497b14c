"""llama.cpp's log, routed through Python ``logging`` (the ``llama_cpp`` logger), a line at a
time."""

from __future__ import annotations

import ctypes
import logging

import llama_cpp as lc

llama_log = logging.getLogger("llama_cpp")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line.
# llama.cpp's "info" is a model-loading dump: it goes to DEBUG here.
_LEVELS = {
    0: logging.DEBUG,
    1: logging.DEBUG,
    2: logging.DEBUG,
    3: logging.WARNING,
    4: logging.ERROR,
}


MAX_LOG_LINE_CHARS = 500


class _LlamaLogSink:
    """Collects llama.cpp's log fragments into lines for Python logging."""

    def __init__(self) -> None:
        self.level = logging.DEBUG
        self.pending = ""

    def __call__(self, level: int, text: bytes, _user_data: object) -> None:
        if level != 5:
            self.level = _LEVELS.get(level, logging.INFO)
        self.pending += text.decode("utf-8", errors="replace")
        while "\n" in self.pending:
            line, self.pending = self.pending.split("\n", 1)
            if line.strip() and llama_log.isEnabledFor(self.level):
                # repr: a line may quote client text (a grammar): escaped and quoted, it can
                # never pass for another log line (a forged request_end JSON line)
                llama_log.log(self.level, "%r", line[:MAX_LOG_LINE_CHARS])


# Module globals on purpose: C keeps this pointer for the life of the process, and a
# collected ctypes callback crashes it.
_LOG_SINK = _LlamaLogSink()
_LOG_CALLBACK = lc.llama_log_callback(_LOG_SINK)


def route_llama_logs() -> None:
    """Send llama.cpp's stderr chatter through the ``llama_cpp`` Python logger."""
    lc.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
