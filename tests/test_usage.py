"""GET /v1/usage: the caller's tenant only, by day and model, validated dates."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from inference.models import InferenceRequest
from tests.conftest import bearer

pytestmark = pytest.mark.django_db


def row(tenant, model="m1", when=None, prompt=10, completion=5, cached=2, status="done",
        created=8):
    return InferenceRequest.objects.create(
        tenant=tenant,
        kind="chat",
        model=model,
        status=status,
        prompt_tokens=prompt,
        completion_tokens=completion,
        cached_tokens=cached,
        cache_created_tokens=created,
        created=when or datetime.now(UTC),
    )


def test_usage_groups_by_day_and_model_for_the_callers_tenant_only(api, parties):
    day1, day2 = datetime(2026, 3, 1, 10, tzinfo=UTC), datetime(2026, 3, 2, 23, 59, tzinfo=UTC)
    row(parties.a, "m1", day1)
    row(parties.a, "m1", day1, prompt=1, completion=1, cached=0, created=1)
    row(parties.a, "m2", day1)
    row(parties.a, "m1", day2, prompt=None, completion=None, cached=None, status="error",
        created=None)
    row(parties.b, "m1", day1, prompt=1000)  # the outsider's: never counted for A
    row(parties.a, "m1", datetime(2026, 3, 3, 0, 0, tzinfo=UTC))  # after end
    reply = api.get("/v1/usage?start=2026-03-01&end=2026-03-02", **bearer(parties.member))
    assert reply.status_code == 200
    body = reply.json()
    assert (body["object"], body["start"], body["end"]) == ("usage", "2026-03-01", "2026-03-02")
    assert body["data"] == [
        {
            "date": "2026-03-01",
            "model": "m1",
            "requests": 2,
            "prompt_tokens": 11,
            "cached_tokens": 2,
            "cache_created_tokens": 9,
            "completion_tokens": 6,
            "total_tokens": 17,
        },
        {
            "date": "2026-03-01",
            "model": "m2",
            "requests": 1,
            "prompt_tokens": 10,
            "cached_tokens": 2,
            "cache_created_tokens": 8,
            "completion_tokens": 5,
            "total_tokens": 15,
        },
        {
            "date": "2026-03-02",
            "model": "m1",
            "requests": 1,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "cache_created_tokens": 0,
            "completion_tokens": 0,
            "total_tokens": 0,
        },
    ]
    assert body["totals"] == {
        "requests": 4,
        "prompt_tokens": 21,
        "cached_tokens": 4,
        "cache_created_tokens": 17,
        "completion_tokens": 11,
        "total_tokens": 32,
    }
    assert body["limits"] == {
        "requests_per_minute": None,
        "tokens_per_minute": None,
        "max_concurrent": None,
        "monthly_token_budget": None,
    }
    assert set(body["current"]) == {
        "requests_this_minute",
        "tokens_this_minute",
        "tokens_this_month",
        "concurrent",
    }
    outsider = api.get(
        "/v1/usage?start=2026-03-01&end=2026-03-02", **bearer(parties.outsider)
    ).json()
    assert outsider["totals"]["prompt_tokens"] == 1000 and outsider["totals"]["requests"] == 1


def test_usage_defaults_to_this_month(api, parties):
    row(parties.a)
    body = api.get("/v1/usage", **bearer(parties.owner)).json()
    today = datetime.now(UTC).date()
    assert body["start"] == today.replace(day=1).isoformat() and body["end"] == today.isoformat()
    assert body["totals"]["requests"] == 1


@pytest.mark.parametrize(
    "query, param",
    [
        ("start=yesterday", "start"),
    ("start=", "start"),
        ("end=2026-13-01", "end"),
        ("start=2026-03-05&end=2026-03-01", "end"),
        ("start=2020-01-01&end=2026-01-01", "end"),
    ],
)
def test_bad_dates_are_400_naming_the_field(api, parties, query, param):
    reply = api.get(f"/v1/usage?{query}", **bearer(parties.owner))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_usage_needs_a_key(api, parties):
    reply = api.get("/v1/usage")
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
