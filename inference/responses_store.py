"""Stored responses (``StoredResponse``): the one reader and writer of their rows.

A response made with ``store`` (the default) is kept RESPONSES_RETENTION_DAYS days under its
tenant: its Response object (``GET /v1/responses/<id>``) and its conversation as chat
messages, this turn's output included (what ``previous_response_id`` continues). Every
lookup is the tenant's own (``StoredResponse.objects.for_tenant``): another tenant's id, an
unknown one, an expired one and a deleted one are the same 404. A save also deletes up to
``SWEEP_ROWS`` expired rows, any tenant's. Synchronous: async code calls these through
``inference.db.run``.
"""
from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone

from inference.errors import ApiError
from inference.models import StoredResponse
from inference.responses_request import RESPONSE_ID

log = logging.getLogger(__name__)

# A stored row's JSON (conversation + response) at most this many times MAX_PROMPT_BYTES: a
# conversation's text is at most MAX_PROMPT_BYTES (the chat check every turn passes), JSON's
# escapes at most 6 bytes per character of it, plus one turn's output.
MAX_STORED_FACTOR = 8
DELETED = ""  # a deleted response's conversation and response (no JSON text is empty)
SWEEP_ROWS = 200


def sweep(now: Any = None) -> int:
    """Deletes up to SWEEP_ROWS expired rows (deleted marks included), oldest first; the
    number deleted. Each save sweeps: the rows expire at the rate they were stored, so the
    table holds about RESPONSES_RETENTION_DAYS of them."""
    expired = StoredResponse.objects.filter(expires__lte=now or timezone.now())
    ids = list(expired.order_by("expires").values_list("pk", flat=True)[:SWEEP_ROWS])
    return StoredResponse.objects.filter(pk__in=ids).delete()[0] if ids else 0


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def save(tenant_id: int, response_id: str, request_id: str, model: str,
         conversation: list[dict[str, Any]], response: dict[str, Any]) -> bool:
    """Keep a response (again, for a replay: the same row). False when it is over the size
    bound (logged; not kept)."""
    now = timezone.now()
    sweep(now)
    kept_conversation, kept_response = _dumps(conversation), _dumps(response)
    size = len(kept_conversation.encode()) + len(kept_response.encode())
    if size > MAX_STORED_FACTOR * settings.MAX_PROMPT_BYTES:
        log.warning("response %s not stored: %d bytes", response_id, size)
        return False
    fields = {"request_id": request_id, "model": model, "conversation": kept_conversation,
              "response": kept_response, "created": now,
              "expires": now + timedelta(days=settings.RESPONSES_RETENTION_DAYS)}
    rows = StoredResponse.objects.filter(id=response_id, tenant_id=tenant_id)
    if rows.exclude(response=DELETED).update(**fields):
        return True
    if rows.exists():  # deleted: a replay of its request does not bring it back
        return False
    try:
        with transaction.atomic():
            StoredResponse.objects.create(id=response_id, tenant_id=tenant_id, **fields)
    except IntegrityError:  # saved meanwhile (a replay beside the original), or deleted
        return rows.exclude(response=DELETED).update(**fields) > 0
    return True


def _row(tenant_id: int, response_id: str, param: str | None) -> StoredResponse:
    row = None
    if RESPONSE_ID.fullmatch(response_id):  # (a NUL in a query is PostgreSQL's error)
        row = StoredResponse.objects.for_tenant(tenant_id).filter(id=response_id).exclude(
            response=DELETED).first()
    if row is None:
        raise ApiError("not_found", f"No response with id {response_id!r:.80}.", param)
    return row


def conversation(tenant_id: int, response_id: str) -> list[dict[str, Any]]:
    """The conversation a response continues (404 ``not_found`` naming
    ``previous_response_id``)."""
    return json.loads(_row(tenant_id, response_id, "previous_response_id").conversation)


def retrieve(tenant_id: int, response_id: str) -> dict[str, Any]:
    """The stored Response object (404 ``not_found``)."""
    return json.loads(_row(tenant_id, response_id, None).response)


def delete(tenant_id: int, response_id: str) -> None:
    """Delete a stored response (404 ``not_found``): its text goes, its id stays until it
    expires as a mark that keeps a replay of its request from saving it again."""
    row = _row(tenant_id, response_id, None)
    StoredResponse.objects.filter(pk=row.pk).update(conversation=DELETED, response=DELETED)
