"""A hostile review of the tenant console (issue 38): what a hostile member or invited user
found, each a test that failed before its fix. tests/test_console.py covers the rest."""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.core import mail
from django.core.cache import cache
from django.test import Client, RequestFactory
from django.utils import timezone

from accounts.models import ApiKey, AuditEvent
from console import views
from tests import test_console as base
from tests.test_console import client_of, new_key

console = base.console  # the fixture: two tenants, their members, keys and rows

# Offsets that move a date past the calendar's ends once in UTC (the database's zone):
# SQLite's adapter raised OverflowError (a 500) on each.
PAST_THE_CALENDAR = ["9999-12-31T23:59-05:00", "0001-01-01T00:00+05:00"]


@pytest.mark.parametrize("value", PAST_THE_CALENDAR)
def test_a_key_expiry_past_the_calendar_is_a_form_error_not_a_500(console, value):
    client = client_of(console.member, raise_request_exception=False)
    created = new_key(client, expires_at=value)
    assert created.status_code == 200 and "expires_at" in created.context["form"].errors
    edited = client.post(f"/console/keys/{console.key.pk}/", {"name": "x", "expires_at": value})
    assert edited.status_code == 200 and "expires_at" in edited.context["form"].errors
    key = ApiKey.objects.get(pk=console.key.pk)
    assert (key.name, key.expires_at) == ("alpha-key", None)
    assert ApiKey.objects.count() == 2 and not AuditEvent.objects.exists()


@pytest.mark.parametrize("value", PAST_THE_CALENDAR)
@pytest.mark.parametrize("name", ["since", "until"])
def test_a_requests_filter_past_the_calendar_is_ignored_not_a_500(console, name, value):
    reply = client_of(console.viewer, raise_request_exception=False).get(
        "/console/requests/", {name: value})
    assert reply.status_code == 200 and reply.context["page"].paginator.count == 1
    assert any(name in str(message) for message in reply.context["messages"])


def test_a_rotated_key_is_not_rotated_again(console):
    """A double-submitted rotation (a reload of the shown-once page) made a second successor
    whose plaintext nobody kept: a live key of the tenant's that no one can name."""
    client = client_of(console.member)
    url = f"/console/keys/{console.key.pk}/rotate/"
    first = client.post(url, {"overlap_s": "86400"})
    assert first.status_code == 200 and first["Cache-Control"] == "no-store"
    expires = ApiKey.objects.get(pk=console.key.pk).expires_at
    again = client.post(url, {"overlap_s": "3600"})
    assert again.status_code == 302 and again["Location"] == f"/console/keys/{console.key.pk}/"
    assert "already rotated" in client.get(again["Location"]).content.decode()
    assert ApiKey.objects.filter(rotated_from=console.key).count() == 1
    assert ApiKey.objects.get(pk=console.key.pk).expires_at == expires
    assert AuditEvent.objects.filter(action="key.rotate").count() == 1
    assert client.get(url).status_code == 302
    assert f'href="{url}"' not in client.get(f"/console/keys/{console.key.pk}/").content.decode()
    with pytest.raises(ValueError):
        ApiKey.objects.get(pk=console.key.pk).rotate(timedelta(0))


def test_renaming_a_key_keeps_its_expiry_to_the_second(console):
    """The form showed the expiry to the minute: a rename posted it back so, which changed the
    expiry (audited as a change), and on an expired key was "must be in the future" (the way
    out the page left: blank the expiry, which brought the key back)."""
    client = client_of(console.member)
    live, _ = ApiKey.issue(console.alpha, "live")
    dead, _ = ApiKey.issue(console.alpha, "dead")
    ApiKey.objects.filter(pk=live.pk).update(
        expires_at=timezone.now() + timedelta(hours=1, seconds=30))
    ApiKey.objects.filter(pk=dead.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    for key in (live, dead):
        url = f"/console/keys/{key.pk}/"
        page = client.get(url).content.decode()
        [shown] = re.findall(r'name="expires_at" value="([^"]*)"', page)
        before = ApiKey.objects.get(pk=key.pk).expires_at
        reply = client.post(url, {"name": "renamed", "expires_at": shown})
        assert reply.status_code == 302, reply.context["form"].errors
        after = ApiKey.objects.get(pk=key.pk)
        assert after.name == "renamed" and abs(after.expires_at - before) < timedelta(seconds=1)
    assert [event.detail for event in AuditEvent.objects.order_by("created")] == [
        {"name": ["live", "renamed"]}, {"name": ["dead", "renamed"]}]
    assert not ApiKey.objects.get(pk=dead.pk).is_usable


# -- the lead's review: what a tenant learns of the operator, reset mails ------------------


def test_an_operator_is_named_as_such_in_a_tenants_audit_log_without_address(console):
    """A tenant sees "the operator" for a staff member's change, never the operator's user
    name or address; a member's own change shows the member and the address."""
    from accounts import audit

    console.staff.username = "ops-jane"
    console.staff.save()
    request = RequestFactory().post("/admin/", REMOTE_ADDR="10.9.8.7")
    request.user = console.staff
    audit.record(AuditEvent.Action.TENANT_LIMITS, tenant=console.alpha, request=request,
                 target="alpha", detail={"tokens_per_minute": [1, 2]})
    mine = RequestFactory().post("/console/", REMOTE_ADDR="10.1.1.1")
    mine.user = console.member
    audit.record(AuditEvent.Action.KEY_UPDATE, tenant=console.alpha, request=mine,
                 target="k", detail={"name": ["a", "b"]})
    page = client_of(console.viewer).get("/console/audit/").content.decode()
    assert "ops-jane" not in page and "10.9.8.7" not in page
    assert "the operator" in page
    assert "member" in page and "10.1.1.1" in page


def test_a_staff_account_gets_no_console_reset_mail(console):
    cache.clear()
    console.staff.email = "ops@example.com"
    console.staff.save()
    reply = Client().post("/console/password/reset/", {"email": "ops@example.com"})
    assert reply.status_code == 302
    assert mail.outbox == []


def test_reset_mails_to_one_address_are_limited_per_hour(console):
    cache.clear()
    for _ in range(6):
        reply = Client().post("/console/password/reset/", {"email": "member@example.com"})
        assert reply.status_code == 302  # the same answer whether sent or not
    assert len(mail.outbox) == views.RESETS_PER_EMAIL_HOUR
    cache.clear()
