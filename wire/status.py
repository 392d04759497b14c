"""A request's status in the history, and how a finish reason maps to it.

``inference.models.InferenceRequest.Status`` offers these values; the daemon reports a
finish reason and the history writer (inference/history.py) turns it into one of them.
"""

from __future__ import annotations

QUEUED = "queued"
RUNNING = "running"
DONE = "done"
CANCELLED = "cancelled"
ERROR = "error"

ALL = (QUEUED, RUNNING, DONE, CANCELLED, ERROR)
FINISHED = frozenset({DONE, CANCELLED, ERROR})


def from_finish_reason(finish_reason: str) -> str:
    """``stop``/``length`` end done, ``cancelled`` cancelled, anything else error."""
    if finish_reason in ("stop", "length"):
        return DONE
    return CANCELLED if finish_reason == "cancelled" else ERROR
