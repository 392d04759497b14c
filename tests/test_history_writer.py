"""inference/history.py, the one writer of history rows: the web's entry points and the
daemon's sink. Transactional: the sink closes old connections around each write, as the
daemon's writer thread does."""

import logging
import uuid

import pytest

from accounts.models import ApiKey, Tenant
from inference import history
from inference.models import InferenceRequest

pytestmark = pytest.mark.django_db(transaction=True)

USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 2}}


@pytest.fixture
def row() -> InferenceRequest:
    tenant = Tenant.objects.create(slug="hist", name="Hist")
    api_key, _ = ApiKey.issue(tenant, "k")
    return history.create(str(uuid.uuid4()), tenant.pk, api_key.pk, "chat", "m", "s1")


def fresh(row: InferenceRequest) -> InferenceRequest:
    return InferenceRequest.objects.get(pk=row.pk)


def test_a_created_row_is_queued_and_the_daemon_moves_it_to_running_then_done(row):
    assert fresh(row).status == "queued" and fresh(row).session == "s1"
    sink = history.DatabaseHistory()
    sink.mark_running(str(row.pk), prompt_tokens=5)
    assert (fresh(row).status, fresh(row).prompt_tokens) == ("running", 5)
    sink.mark_finished(str(row.pk), "length", USAGE, {"ttft_ms": 3.0, "duration_ms": 9.0})
    done = fresh(row)
    assert (done.status, done.finish_reason, done.completion_tokens, done.cached_tokens) == (
        "done", "length", 7, 2)
    assert done.finished is not None and done.ttft_ms == 3.0


def test_running_never_reopens_a_closed_row(row):
    sink = history.DatabaseHistory()
    sink.mark_finished(str(row.pk), "cancelled", None, None)
    sink.mark_running(str(row.pk), prompt_tokens=5)
    assert fresh(row).status == "cancelled"


def test_the_sink_never_raises(row, caplog):
    sink = history.DatabaseHistory()
    with caplog.at_level(logging.ERROR, logger="inference.history"):
        sink.mark_finished(str(row.pk), "stop", {"prompt_tokens": 1}, None)  # a usage missing keys
        sink.mark_running("not-a-uuid", prompt_tokens=1)
    assert len([r for r in caplog.records if "could not update" in r.message]) == 2
    assert fresh(row).status == "queued"  # nothing half-written


def test_the_web_abandons_and_closes_rows_it_owns(row):
    other = history.create(str(uuid.uuid4()), row.tenant_id, None, "completion", "m")
    history.abandon(str(other.pk))
    assert (fresh(other).status, fresh(other).finish_reason) == ("cancelled", "cancelled")
    assert history.close_interrupted(str(row.pk), "inference_interrupted") == row.tenant_id
    closed = fresh(row)
    assert (closed.status, closed.error_code) == ("error", "inference_interrupted")
    assert history.close_interrupted(str(uuid.uuid4()), "x") is None
