from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command

from accounts.authentication import authenticate_key
from accounts.models import ApiKey, Tenant


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_tenant_then_key(db):
    run("create_tenant", "acme", "--name", "Acme Corp")
    assert Tenant.objects.get(slug="acme").name == "Acme Corp"
    last_line = run("create_api_key", "acme", "--name", "ci").strip().splitlines()[-1]
    api_key = authenticate_key(last_line)
    assert api_key is not None
    assert api_key.tenant.slug == "acme"
    assert api_key.name == "ci"


def test_create_tenant_twice_fails(db):
    run("create_tenant", "acme")
    with pytest.raises(CommandError):
        run("create_tenant", "acme")


def test_create_api_key_for_unknown_tenant_fails(db):
    with pytest.raises(CommandError, match="create_tenant"):
        run("create_api_key", "nobody")


def test_seed_demo_is_idempotent(db):
    first = run("seed_demo")
    second = run("seed_demo")
    assert Tenant.objects.count() == 1
    assert ApiKey.objects.count() == 1
    assert get_user_model().objects.filter(is_superuser=True).count() == 1
    assert "sk-" in first
    assert "sk-" not in second
    assert "create_api_key demo" in second
    key = next(word for word in first.split() if word.startswith("sk-"))
    assert authenticate_key(key).tenant.slug == "demo"
