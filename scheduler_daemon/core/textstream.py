"""Incremental text out of generated token bytes.

Two rules, after llama.cpp's server: never emit half a UTF-8 codepoint, and never emit
text that could still turn out to be the start of a stop string. What is held back is
released by ``flush()`` when the request ends for any reason other than a stop string.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence


class TextStream:
    """Turns token byte pieces into text deltas that are safe to send."""

    __slots__ = ("_decoder", "_stops", "_pending", "stopped_by")

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = tuple(s for s in stop if s)
        self._pending = ""
        self.stopped_by: str | None = None

    def feed(self, piece: bytes) -> str:
        """Add one token's bytes; return the text that can be emitted now."""
        if self.stopped_by is not None:
            return ""
        self._pending += self._decoder.decode(piece)
        if not self._stops:
            out, self._pending = self._pending, ""
            return out
        hit = self._earliest_stop()
        if hit is not None:
            at, stop = hit
            out = self._pending[:at]
            self._pending = ""
            self.stopped_by = stop
            return out
        keep = self._partial_stop_len()
        cut = len(self._pending) - keep
        out, self._pending = self._pending[:cut], self._pending[cut:]
        return out

    def flush(self) -> str:
        """Release everything held back (the request ended without a stop string)."""
        if self.stopped_by is not None:
            return ""
        out = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out

    def _earliest_stop(self) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            at = self._pending.find(stop)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of pending text that begins some stop string."""
        text = self._pending
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
