"""Stored responses (inference/responses_store.py) under review (issue 37): a deleted
response stays deleted, whoever saves its id again; another tenant never reaches it."""
from __future__ import annotations

import uuid

import pytest

from inference import responses_store
from inference.errors import ApiError
from inference.responses_format import response_id

CONVERSATION = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]


def _save(tenant_id: int, request_id: str) -> bool:
    rid = response_id(request_id)
    return responses_store.save(tenant_id, rid, request_id, "m", CONVERSATION,
                                {"id": rid, "object": "response", "status": "completed"})


def test_a_deleted_response_is_not_brought_back_by_its_replay(parties):
    """An Idempotency-Key retry of a stored response's request is a replay, which saves the
    response again (the view's ``keep``): after a DELETE it must stay deleted."""
    request_id = str(uuid.uuid4())
    rid = response_id(request_id)
    assert _save(parties.a.pk, request_id)
    assert responses_store.retrieve(parties.a.pk, rid)["id"] == rid
    responses_store.delete(parties.a.pk, rid)
    assert not _save(parties.a.pk, request_id)  # the replay's save
    for read in (responses_store.retrieve, responses_store.conversation,
                 responses_store.delete):
        with pytest.raises(ApiError) as missing:
            read(parties.a.pk, rid)
        assert missing.value.status == 404


def test_a_response_saved_again_is_updated_and_another_tenants_is_404(parties):
    request_id = str(uuid.uuid4())
    rid = response_id(request_id)
    assert _save(parties.a.pk, request_id) and _save(parties.a.pk, request_id)
    assert responses_store.conversation(parties.a.pk, rid) == CONVERSATION
    for read in (responses_store.retrieve, responses_store.conversation,
                 responses_store.delete):
        with pytest.raises(ApiError) as missing:
            read(parties.b.pk, rid)
        assert missing.value.status == 404
    assert responses_store.retrieve(parties.a.pk, rid)["id"] == rid


def test_a_save_sweeps_every_tenants_expired_rows(parties, settings):
    """A tenant that stores nothing more still loses its expired rows: each save deletes
    up to SWEEP_ROWS expired rows, whoever's."""
    from django.utils import timezone

    from inference.models import StoredResponse
    old = [str(uuid.uuid4()) for _ in range(3)]
    for request_id in old:
        assert _save(parties.b.pk, request_id)
    StoredResponse.objects.filter(tenant_id=parties.b.pk).update(expires=timezone.now())
    kept = str(uuid.uuid4())
    assert _save(parties.a.pk, kept)  # another tenant's save
    assert not StoredResponse.objects.filter(tenant_id=parties.b.pk).exists()
    assert StoredResponse.objects.filter(tenant_id=parties.a.pk).count() == 1
