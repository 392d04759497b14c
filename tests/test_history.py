"""/v1/requests: each tenant sees its own history and nobody else's; /v1/health."""

import uuid
from datetime import timedelta

from django.utils import timezone

from inference.models import InferenceRequest
from tests.conftest import bearer


def make_rows(tenant, count: int) -> list[InferenceRequest]:
    now = timezone.now()
    return [
        InferenceRequest.objects.create(
            tenant=tenant,
            kind=InferenceRequest.Kind.CHAT,
            model="gemma-3-270m",
            status=InferenceRequest.Status.DONE,
            prompt_tokens=10 + i,
            created=now - timedelta(seconds=count - i),
        )
        for i in range(count)
    ]


def listed_ids(response) -> list[str]:
    assert response.status_code == 200
    return [row["id"] for row in response.json()["results"]]


def test_owner_and_member_see_own_rows_newest_first(api, parties):
    rows = make_rows(parties.a, 3)
    newest_first = [str(row.id) for row in reversed(rows)]
    assert listed_ids(api.get("/v1/requests", **bearer(parties.owner))) == newest_first
    assert listed_ids(api.get("/v1/requests", **bearer(parties.member))) == newest_first


def test_outsider_list_has_no_foreign_rows(api, parties):
    make_rows(parties.a, 2)
    theirs = make_rows(parties.b, 1)
    assert listed_ids(api.get("/v1/requests", **bearer(parties.outsider))) == [str(theirs[0].id)]


def test_detail_is_404_for_another_tenants_row(api, parties):
    row = make_rows(parties.a, 1)[0]
    assert api.get(f"/v1/requests/{row.id}", **bearer(parties.owner)).json()["id"] == str(row.id)
    response = api.get(f"/v1/requests/{row.id}", **bearer(parties.outsider))
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_id_and_unknown_url_are_json_404(api, parties):
    for path in [f"/v1/requests/{uuid.uuid4()}", "/v1/requests/not-a-uuid", "/v1/nothing"]:
        response = api.get(path, **bearer(parties.owner))
        assert response.status_code == 404, path
        assert response.json()["error"]["code"] == "not_found", path


def test_history_pages_with_limit(api, parties):
    make_rows(parties.a, 5)
    first = api.get("/v1/requests?limit=2", **bearer(parties.owner)).json()
    assert len(first["results"]) == 2
    second = api.get(first["next"], **bearer(parties.owner)).json()
    assert len(second["results"]) == 2
    assert not {r["id"] for r in first["results"]} & {r["id"] for r in second["results"]}


def test_history_has_no_text_fields(api, parties):
    make_rows(parties.a, 1)
    row = api.get("/v1/requests", **bearer(parties.owner)).json()["results"][0]
    assert not {"prompt", "completion", "messages", "text", "tenant"} & row.keys()


def test_health_needs_no_key(api, db):
    response = api.get("/v1/health")
    assert response.status_code == 200
    assert response["Content-Type"] == "application/json"
    assert response.json()["status"] == "ok"


def test_unknown_api_url_answers_json_even_for_a_post_without_csrf(db):
    from django.test import Client

    response = Client(enforce_csrf_checks=True).post("/v1/no-such-endpoint", {"a": 1})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"
