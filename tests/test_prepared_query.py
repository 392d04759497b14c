"""config.db.PreparedQuery: compiled once, same answers as the ORM."""
import threading

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from accounts.models import ApiKey, Tenant
from config.db import PreparedQuery

pytestmark = pytest.mark.django_db


def by_prefix():
    return PreparedQuery(
        lambda prefix: ApiKey.objects.select_related("tenant").filter(prefix=prefix)
        .order_by()[:1]
    )


@pytest.fixture
def keys():
    tenant = Tenant.objects.create(slug="acme", name="Acme", max_concurrent=3)
    other = Tenant.objects.create(slug="other", name="Other", is_active=False)
    return ApiKey.issue(tenant, "one")[0], ApiKey.issue(other, "two")[0]


def test_rows_match_the_orm_with_the_related_object_loaded(keys):
    query = by_prefix()
    for key in keys:
        expected = ApiKey.objects.select_related("tenant").get(pk=key.pk)
        with CaptureQueriesContext(connection) as queries:
            got = query.first(key.prefix)
            tenant = got.tenant  # loaded with the key: no second query
        assert len(queries) == 1
        assert isinstance(got, ApiKey) and not got._state.adding and got._state.db == "default"
        for field in ApiKey._meta.concrete_fields:
            assert getattr(got, field.attname) == getattr(expected, field.attname), field.name
        for field in Tenant._meta.concrete_fields:
            assert getattr(tenant, field.attname) == getattr(expected.tenant, field.attname)
    assert query.first("nosuchkey0") is None


def test_compiled_once_per_thread_and_values_never_leak(keys):
    query = by_prefix()
    assert query.first(keys[0].prefix).pk == keys[0].pk
    compiled = query._compiled("default")
    assert query.first(keys[1].prefix).pk == keys[1].pk  # the second value, same SQL
    assert query._compiled("default") is compiled
    assert keys[0].prefix not in compiled.sql and keys[1].prefix not in compiled.params

    seen = []
    thread = threading.Thread(target=lambda: seen.append(query._compiled("default")))
    thread.start()
    thread.join()
    assert seen[0] is not compiled  # each thread compiles with its own connection


def test_a_value_that_is_not_a_parameter_is_refused(keys):
    query = PreparedQuery(lambda prefix: ApiKey.objects.all()[:1])
    with pytest.raises(ValueError):
        query.first(keys[0].prefix)
