"""The one writer of request history (``InferenceRequest`` rows): every status change a row
goes through is an entry point here.

- the web creates a row when it admits a request (``create``), ends one it admitted but
  never queued (``abandon``: its caller went away; ``close_failed``: Redis refused its job),
  and closes one whose daemon died (``close_interrupted``);
- the daemon reports ``running`` and the end through ``DatabaseHistory``, the sink
  ``run_scheduler`` hands the daemon (the daemon never imports this app's models).

A row holds accounting, never prompt or completion text. Writes from the daemon never raise:
the history must not stop token delivery. Each unit of database work starts and ends with
Django's ``close_old_connections`` (connections kept by ``CONN_MAX_AGE``, checked by
``CONN_HEALTH_CHECKS``), as a request does.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections
from django.utils import timezone

from inference.models import InferenceRequest
from wire import status

log = logging.getLogger(__name__)


def create(request_id: str, tenant_id: int, api_key_id: int | None, kind: str, model: str,
           session: str = "") -> InferenceRequest:
    """A row for a request the web admitted (status queued)."""
    return InferenceRequest.objects.create(
        id=request_id, tenant_id=tenant_id, api_key_id=api_key_id, kind=kind, model=model,
        session=session,
    )


def abandon(request_id: str) -> None:
    """A request admitted but never queued (its caller went away): it ends cancelled."""
    InferenceRequest.objects.filter(id=request_id, finished__isnull=True).update(
        status=status.CANCELLED, finish_reason="cancelled", finished=timezone.now(),
    )


def close_failed(request_id: str, error_code: str) -> None:
    """A request admitted but never queued because Redis refused its job: status error."""
    InferenceRequest.objects.filter(id=request_id, finished__isnull=True).update(
        status=status.ERROR, error_code=error_code, finish_reason="error",
        finished=timezone.now(),
    )


def close_interrupted(request_id: str, error_code: str) -> int | None:
    """Close a row its daemon can no longer close (it died): status error. Returns the
    row's tenant id (None when there is no row)."""
    rows = InferenceRequest.objects.filter(id=request_id)
    rows.filter(finished__isnull=True).update(
        status=status.ERROR, error_code=error_code, finish_reason="error",
        finished=timezone.now(),
    )
    return rows.values_list("tenant_id", flat=True).first()


class DatabaseHistory:
    """The daemon's history sink (``scheduler_daemon.service.history.HistorySink``).

    Never raises."""

    def mark_running(self, request_id: str, prompt_tokens: int) -> None:
        """The daemon accepted the request (never reopens a row that is already closed)."""
        _write(request_id, _running_fields, prompt_tokens, only_if_status=status.QUEUED)

    def mark_finished(self, request_id: str, finish_reason: str, usage: dict[str, Any] | None,
                      timings: dict[str, Any] | None, error_code: str = "") -> None:
        """The request ended (done, cancelled or error): its accounting."""
        _write(request_id, _finished_fields, finish_reason, usage, timings, error_code)


def _write(request_id: str, make_fields: Callable[..., dict[str, Any]], *args: Any,
           only_if_status: str | None = None) -> None:
    """``make_fields(*args)`` written to the row; any failure (a usage dict of the wrong
    shape included) is logged, never raised: history must not stop token delivery."""
    try:
        fields = make_fields(*args)
        close_old_connections()
        rows = InferenceRequest.objects.filter(id=request_id)  # raises for a non-UUID id
        if only_if_status is not None:
            rows = rows.filter(status=only_if_status)
        rows.update(**fields)
    except Exception:
        log.exception("could not update history row %s", request_id)
    finally:
        close_old_connections()


def _running_fields(prompt_tokens: int) -> dict[str, Any]:
    return {"status": status.RUNNING, "started": timezone.now(), "prompt_tokens": prompt_tokens}


def _finished_fields(finish_reason: str, usage: dict[str, Any] | None,
                     timings: dict[str, Any] | None, error_code: str) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "status": status.from_finish_reason(finish_reason),
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
        details = usage["prompt_tokens_details"]
        if "cache_created_tokens" in details:  # a daemon of this version's
            fields.update(
                cache_created_tokens=details["cache_created_tokens"],
                cache_hit=details.get("cache_hit") or "",
                cache_tier=details.get("cache_tier") or "",
            )
    if timings:
        fields.update(ttft_ms=timings.get("ttft_ms"), duration_ms=timings.get("duration_ms"))
    return fields
