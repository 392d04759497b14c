"""The daemon's writes to the request history (``inference.InferenceRequest``).

The daemon closes every row it touches, so history is right even when no client is
listening any more. A row that does not exist (a job queued without one) is skipped.
Database trouble is logged, never allowed to stop token delivery. The writer thread keeps
its connection between writes (a connect per write was most of its CPU time per request,
taken from llama.cpp's threads during the prefill); one an error left unusable is closed,
and one idle for a while is pinged before it is trusted.
"""

from __future__ import annotations

import logging
from typing import Any

from django.utils import timezone

from config.db import kept_connections

log = logging.getLogger(__name__)

_STATUS = {"stop": "done", "length": "done", "cancelled": "cancelled", "error": "error"}


def _update(request_id: str, only_if_status: str | None = None, **fields: Any) -> None:
    from inference.models import InferenceRequest

    try:
        rows = InferenceRequest.objects.filter(id=request_id)  # raises for a non-UUID id
        if only_if_status is not None:
            rows = rows.filter(status=only_if_status)
        with kept_connections():
            rows.update(**fields)
    except Exception:  # the history must never take the daemon down
        log.exception("could not update history row %s", request_id)


def mark_running(request_id: str, prompt_tokens: int) -> None:
    """The daemon accepted the request (never reopens a row that is already closed)."""
    _update(
        request_id,
        only_if_status="queued",
        status="running",
        started=timezone.now(),
        prompt_tokens=prompt_tokens,
    )


def mark_finished(
    request_id: str,
    finish_reason: str,
    usage: dict[str, Any] | None,
    timings: dict[str, Any] | None,
    error_code: str = "",
) -> None:
    """The request ended (done, cancelled or error); record its accounting, never its text."""
    fields: dict[str, Any] = {
        "status": _STATUS.get(finish_reason, "error"),
        "finish_reason": finish_reason,
        "error_code": error_code,
        "finished": timezone.now(),
    }
    if usage:
        fields.update(
            prompt_tokens=usage["prompt_tokens"],
            completion_tokens=usage["completion_tokens"],
            cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        )
    if timings:
        fields.update(ttft_ms=timings.get("ttft_ms"), duration_ms=timings.get("duration_ms"))
    _update(request_id, **fields)
