from datetime import timedelta

import pytest

from accounts.authentication import authenticate_key
from accounts.models import ApiKey
from tests.conftest import bearer

URL = "/v1/requests"


def assert_invalid_key(response) -> None:
    assert response.status_code == 401
    assert response["WWW-Authenticate"] == "Bearer"
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"
    assert error["param"] is None
    assert error["message"]


def test_good_key_works(api, parties):
    response = api.get(URL, **bearer(parties.owner))
    assert response.status_code == 200


def test_wrong_secret_is_refused(api, parties):
    prefix = parties.owner_key.prefix
    assert_invalid_key(api.get(URL, **bearer(f"sk-{prefix}.not-the-secret")))


def test_revoked_key_is_refused_at_once(api, parties):
    assert api.get(URL, **bearer(parties.owner)).status_code == 200
    parties.owner_key.revoke()
    assert_invalid_key(api.get(URL, **bearer(parties.owner)))


def test_inactive_tenants_key_is_refused(api, parties):
    parties.a.is_active = False
    parties.a.save()
    assert_invalid_key(api.get(URL, **bearer(parties.member)))


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Bearer",
        "Bearer ",
        "Token {key}",
        "{key}",
        "Bearer {key} extra",
        "Bearer garbage",
        "Bearer sk-nodothere",
        "Bearer sk-.",
        "Bearer sk-{prefix}.",
        "Basic dXNlcjpwYXNz",
    ],
)
def test_malformed_header_is_refused(api, parties, header):
    value = header.format(key=parties.owner, prefix=parties.owner_key.prefix)
    assert_invalid_key(api.get(URL, HTTP_AUTHORIZATION=value))


def test_missing_header_is_refused(api, parties):
    assert_invalid_key(api.get(URL))


def test_database_holds_no_secret(parties):
    secret = parties.owner.split(".", 1)[1]
    row = ApiKey.objects.filter(pk=parties.owner_key.pk).values().get()
    for column, value in row.items():
        assert secret not in str(value), column
        assert parties.owner not in str(value), column


def test_authenticate_key_returns_key_with_tenant(parties):
    api_key = authenticate_key(parties.member)
    assert api_key is not None
    assert api_key.tenant == parties.a
    assert authenticate_key("sk-junk") is None
    assert authenticate_key("") is None


def test_last_used_at_is_written_at_most_once_a_minute(api, parties):
    api.get(URL, **bearer(parties.owner))
    first = ApiKey.objects.get(pk=parties.owner_key.pk).last_used_at
    assert first is not None
    api.get(URL, **bearer(parties.owner))
    assert ApiKey.objects.get(pk=parties.owner_key.pk).last_used_at == first

    ApiKey.objects.filter(pk=parties.owner_key.pk).update(last_used_at=first - timedelta(minutes=2))
    api.get(URL, **bearer(parties.owner))
    assert ApiKey.objects.get(pk=parties.owner_key.pk).last_used_at > first
