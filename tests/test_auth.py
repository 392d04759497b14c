from datetime import timedelta

import pytest
from django.utils import timezone

from accounts.authentication import authenticate_key
from accounts.models import ApiKey, Tenant
from inference import auth
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
    auth.keys.forget()  # a bulk update bypasses the model: the key would be trusted 1 s more
    api.get(URL, **bearer(parties.owner))
    assert ApiKey.objects.get(pk=parties.owner_key.pk).last_used_at > first


@pytest.fixture
def fresh_cache():
    auth.keys.forget()
    yield
    auth.keys.forget()


def age_cached_keys(seconds: float) -> None:
    for key in auth.keys._keys.values():
        key.loaded_at -= seconds


def test_a_key_is_read_from_the_database_once_a_second(api, parties, fresh_cache,
                                                       django_assert_num_queries):
    assert api.get("/v1/models", **bearer(parties.owner)).status_code == 200  # looked up
    with django_assert_num_queries(0):
        assert api.get("/v1/models", **bearer(parties.owner)).status_code == 200
        assert_invalid_key(api.get("/v1/models", **bearer(parties.owner + "x")))  # its secret
    age_cached_keys(auth.KEY_CACHE_S)
    with django_assert_num_queries(1):
        assert api.get("/v1/models", **bearer(parties.owner)).status_code == 200


@pytest.mark.parametrize("change", [
    lambda p: ApiKey.objects.filter(pk=p.owner_key.pk).update(revoked_at=timezone.now()),
    lambda p: Tenant.objects.filter(pk=p.a.pk).update(is_active=False),
], ids=["revoked", "tenant-deactivated"])
def test_a_bulk_update_takes_effect_within_the_cache_second(api, parties, fresh_cache, change):
    """A change that bypasses the model (a bulk update, another process) is seen when the
    cached key is KEY_CACHE_S old."""
    assert api.get(URL, **bearer(parties.owner)).status_code == 200
    change(parties)
    assert api.get(URL, **bearer(parties.owner)).status_code == 200  # still trusted
    age_cached_keys(auth.KEY_CACHE_S)
    assert_invalid_key(api.get(URL, **bearer(parties.owner)))


def test_a_model_change_takes_effect_at_once(api, parties, fresh_cache):
    assert api.get(URL, **bearer(parties.member)).status_code == 200
    parties.a.is_active = False
    parties.a.save()
    assert_invalid_key(api.get(URL, **bearer(parties.member)))
    parties.a.is_active = True
    parties.a.save()
    assert api.get(URL, **bearer(parties.member)).status_code == 200
    ApiKey.objects.get(name="member").delete()
    assert_invalid_key(api.get(URL, **bearer(parties.member)))
