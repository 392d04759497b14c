"""The tenant console (docs/console.md): invites, login, roles, keys (create, edit, rotate,
revoke, each audited), requests with filters, the audit log, and the walls between tenants."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core import mail
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from accounts.authentication import find_key
from accounts.models import ApiKey, AuditEvent, Membership, Tenant
from config.models import GEMMA, SMOLLM2
from inference.models import Adapter, InferenceRequest

BASE_DIR = Path(__file__).resolve().parent.parent
BACKEND = "django.contrib.auth.backends.ModelBackend"
PASSWORD = "a-Console-password-7"


@dataclass
class Console:
    alpha: Tenant
    beta: Tenant
    owner: User
    member: User
    viewer: User
    outsider: User  # beta's owner
    staff: User  # an operator without a membership
    key: ApiKey  # alpha's
    beta_key: ApiKey
    row: InferenceRequest  # alpha's
    beta_row: InferenceRequest


def user(name: str, tenant: Tenant | None = None, role: str = "", **extra) -> User:
    person = User.objects.create_user(name, f"{name}@example.com", PASSWORD, **extra)
    if tenant is not None:
        Membership.objects.create(user=person, tenant=tenant, role=role)
    return person


@pytest.fixture
def console(db) -> Console:
    alpha = Tenant.objects.create(slug="alpha", name="Alpha", requests_per_minute=100,
                                  tokens_per_minute=10_000, monthly_token_budget=1_000_000)
    beta = Tenant.objects.create(slug="beta", name="Beta")
    key, _ = ApiKey.issue(alpha, "alpha-key")
    beta_key, _ = ApiKey.issue(beta, "beta-key")
    return Console(
        alpha, beta, user("owner", alpha, "owner"), user("member", alpha, "member"),
        user("viewer", alpha, "viewer"), user("outsider", beta, "owner"),
        user("operator", is_staff=True), key, beta_key,
        InferenceRequest.objects.create(tenant=alpha, api_key=key, kind="chat", model=SMOLLM2),
        InferenceRequest.objects.create(tenant=beta, api_key=beta_key, kind="chat",
                                        model=SMOLLM2))


def client_of(person: User, **kwargs) -> Client:
    client = Client(**kwargs)
    client.force_login(person, backend=BACKEND)
    return client


def plaintext_in(response) -> str:
    [found] = set(re.findall(r"sk-[A-Za-z0-9]{10}\.[A-Za-z0-9_-]+", response.content.decode()))
    return found


def logs_in(username: str, password: str) -> bool:
    """A console login (django-axes needs the request Client.login does not give it)."""
    reply = Client().post("/console/login/", {"username": username, "password": password})
    return reply.status_code == 302 and reply["Location"] == "/console/keys/"


def events(action: str) -> list[AuditEvent]:
    return list(AuditEvent.objects.filter(action=action))


# -- invites, passwords, login ---------------------------------------------------------------


def set_password_by(link: str, password: str = "a-Fresh-password-9") -> Client:
    client = Client()
    form = client.get(link, follow=True)  # Django moves the token into the session
    assert form.status_code == 200 and form.context["validlink"]
    done = client.post(form.redirect_chain[-1][0],
                       {"new_password1": password, "new_password2": password})
    assert done.status_code == 302 and done["Location"] == "/console/password/reset/done/"
    return client


def test_the_invite_command_mails_the_link_that_sets_a_password(console):
    out = io.StringIO()
    call_command("invite", "alpha", "new@example.com", "--role", "viewer", stdout=out)
    link = out.getvalue().splitlines()[-1]
    assert re.fullmatch(r"http://127\.0\.0\.1:8000/console/password/reset/[^/]+/[^/]+/", link)
    [sent] = mail.outbox
    assert sent.to == ["new@example.com"] and link in sent.body
    invited = User.objects.get(username="new@example.com")
    assert not invited.has_usable_password() and not invited.is_staff
    assert invited.membership.tenant == console.alpha and invited.membership.role == "viewer"
    [event] = events("member.invite")
    assert (event.tenant, event.actor_name, event.target) == (
        console.alpha, "manage.py invite", "new@example.com")
    set_password_by(link.removeprefix("http://127.0.0.1:8000"))
    login = Client().post("/console/login/", {"username": "new@example.com",
                                              "password": "a-Fresh-password-9"})
    assert login.status_code == 302 and login["Location"] == "/console/keys/"
    # the link worked once
    again = Client().get(link.removeprefix("http://127.0.0.1:8000"), follow=True)
    assert not again.context["validlink"]


def test_the_invite_command_refuses_an_unknown_tenant_and_a_known_user(console):
    with pytest.raises(CommandError, match="create_tenant nowhere"):
        call_command("invite", "nowhere", "x@example.com", stdout=io.StringIO())
    with pytest.raises(CommandError, match="valid email"):
        call_command("invite", "alpha", "owner", stdout=io.StringIO())
    with pytest.raises(CommandError, match="exists"):
        call_command("invite", "alpha", "OWNER@example.com", stdout=io.StringIO())
    call_command("invite", "alpha", "twice@example.com", stdout=io.StringIO())
    with pytest.raises(CommandError, match="exists"):
        call_command("invite", "beta", "twice@example.com", stdout=io.StringIO())
    assert Membership.objects.get(user__username="twice@example.com").tenant == console.alpha


def test_the_admin_invites(console, admin_client):
    assert admin_client.get("/admin/accounts/membership/add/")["Location"] == \
        "/admin/accounts/membership/invite/"
    reply = admin_client.post("/admin/accounts/membership/invite/", {
        "email": "guest@example.com", "tenant": console.beta.pk, "role": "member"})
    assert reply.status_code == 302
    [sent] = mail.outbox
    [link] = re.findall(r"http://testserver(/console/password/reset/\S+/)", sent.body)
    [event] = events("member.invite")
    assert event.tenant == console.beta and event.actor.username == "admin"
    assert event.address == "127.0.0.1"
    set_password_by(link)
    assert logs_in("guest@example.com", "a-Fresh-password-9")
    # the operator (staff) is refused by the console: no membership
    refused = admin_client.get("/console/keys/")
    assert refused.status_code == 403


def test_a_forgotten_password_is_reset_by_mail(console):
    reply = Client().post("/console/password/reset/", {"email": "member@example.com"})
    assert reply.status_code == 302
    [sent] = mail.outbox
    [link] = re.findall(r"http://testserver(/console/password/reset/\S+/)", sent.body)
    set_password_by(link, "another-Password-3")
    assert logs_in("member", "another-Password-3")


def test_a_member_changes_the_password(console):
    client = client_of(console.member)
    assert client.get("/console/password/").status_code == 200
    reply = client.post("/console/password/", {
        "old_password": PASSWORD, "new_password1": "changed-Password-5",
        "new_password2": "changed-Password-5"})
    assert reply.status_code == 302 and reply["Location"] == "/console/password/done/"
    assert logs_in("member", "changed-Password-5")


def test_login_lands_on_the_keys_page_and_logout_is_a_post(console):
    client = Client()
    assert client.get("/console/")["Location"] == "/console/login/?next=/console/"
    reply = client.post("/console/login/", {"username": "member", "password": PASSWORD})
    assert reply.status_code == 302 and reply["Location"] == "/console/keys/"
    assert client.get("/console/")["Location"] == "/console/keys/"
    assert client.get("/console/keys/").status_code == 200
    assert client.get("/console/logout/").status_code == 405
    assert client.post("/console/logout/")["Location"] == "/console/login/"
    assert client.get("/console/keys/").status_code == 302


def test_console_logins_lock_out_like_the_admins(console, settings):
    attacker = Client(REMOTE_ADDR="192.0.2.7")
    for _ in range(settings.AXES_FAILURE_LIMIT - 1):
        reply = attacker.post("/console/login/", {"username": "member", "password": "wrong"})
        assert reply.status_code == 200 and reply.context["form"].errors
    assert attacker.post("/console/login/", {"username": "member",
                                             "password": "wrong"}).status_code == 429
    assert attacker.post("/console/login/", {"username": "member",
                                             "password": PASSWORD}).status_code == 429
    assert attacker.get("/console/keys/").status_code == 302  # not logged in
    assert Client(REMOTE_ADDR="198.51.100.7").post(
        "/console/login/", {"username": "member", "password": PASSWORD}).status_code == 302


def test_tenant_members_never_reach_the_admin(console):
    client = client_of(console.owner)
    reply = client.get("/admin/")
    assert reply.status_code == 302 and reply["Location"].startswith("/admin/login/")
    login = Client().post("/admin/login/?next=/admin/",
                          {"username": "owner", "password": PASSWORD, "next": "/admin/"})
    assert login.status_code == 200  # the form again: not staff
    assert client.get("/admin/accounts/apikey/").status_code == 302


def test_a_staff_user_without_a_membership_gets_403(console):
    assert client_of(console.staff).get("/console/keys/").status_code == 403


def test_production_settings_keep_the_cookies_secure():
    env = {"HOME": os.environ["HOME"], "PATH": os.environ["PATH"], "SECRET_KEY": "x" * 50,
           "DJANGO_SETTINGS_MODULE": "config.settings"}
    code = ("from django.conf import settings as s; "
            "print(s.DEBUG, s.SESSION_COOKIE_SECURE, s.CSRF_COOKIE_SECURE)")
    done = subprocess.run([sys.executable, "-c", code], cwd=BASE_DIR, env=env,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["False", "True", "True"]


# -- keys ------------------------------------------------------------------------------------


def new_key(client: Client, **fields):
    return client.post("/console/keys/new/", {"name": "laptop", **fields})


def test_a_created_key_is_shown_once_and_authenticates(console):
    Adapter.objects.create(tenant=console.alpha, model=SMOLLM2, name="mine", file="m.gguf",
                           sha256="0" * 64, size_bytes=1, rank=1)
    client = client_of(console.member)
    form = client.get("/console/keys/new/").content.decode()
    assert f"{SMOLLM2}:mine" in form and GEMMA in form
    expires = (timezone.now() + timedelta(days=30)).strftime("%Y-%m-%dT%H:%M")
    reply = new_key(client, allowed_models=[SMOLLM2, f"{SMOLLM2}:mine"], expires_at=expires,
                    requests_per_minute="10", tokens_per_minute="", read_only="on")
    assert reply.status_code == 200 and reply["Cache-Control"] == "no-store"
    plaintext = plaintext_in(reply)
    found = find_key(plaintext).api_key
    assert found is not None and found.tenant == console.alpha
    assert found.allowed_models == [SMOLLM2, f"{SMOLLM2}:mine"] and found.read_only
    assert found.requests_per_minute == 10 and found.tokens_per_minute is None
    assert found.created_by == console.member and found.expires_at is not None
    for page in ("/console/keys/", f"/console/keys/{found.pk}/"):
        shown = client.get(page).content.decode()
        assert f"sk-{found.prefix}…" in shown and plaintext not in shown
    [event] = events("key.create")
    assert event.actor == console.member and event.address == "127.0.0.1"
    assert event.detail["requests_per_minute"] == [None, 10]
    assert plaintext not in str(event.detail)
    # beta's form offers no alpha adapter
    assert f"{SMOLLM2}:mine" not in client_of(console.outsider).get(
        "/console/keys/new/").content.decode()


def test_key_limits_above_the_tenants_are_refused(console):
    client = client_of(console.owner)
    reply = new_key(client, requests_per_minute="101", monthly_token_budget="1000001")
    assert reply.status_code == 200
    assert set(reply.context["form"].errors) == {"requests_per_minute", "monthly_token_budget"}
    assert new_key(client, expires_at="2001-01-01T00:00").context["form"].errors == {
        "expires_at": ["must be in the future"]}
    assert new_key(client, allowed_models=["no-such-model"]).context["form"].errors
    assert ApiKey.objects.for_tenant(console.alpha).count() == 1
    # a tenant without limits: any
    assert new_key(client_of(console.outsider), requests_per_minute="100000").status_code == 200
    assert ApiKey.objects.get(tenant=console.beta, name="laptop").requests_per_minute == 100000


def test_editing_a_key_is_audited_field_by_field(console):
    client = client_of(console.member)
    url = f"/console/keys/{console.key.pk}/"
    reply = client.post(url, {"name": "renamed", "allowed_models": [GEMMA],
                              "tokens_per_minute": "500"})
    assert reply.status_code == 302, reply.context["form"].errors
    key = ApiKey.objects.get(pk=console.key.pk)
    assert (key.name, key.allowed_models, key.tokens_per_minute) == ("renamed", [GEMMA], 500)
    [event] = events("key.update")
    assert event.detail == {"name": ["alpha-key", "renamed"], "allowed_models": [[], [GEMMA]],
                            "tokens_per_minute": [None, 500]}
    refused = client.post(url, {"name": "x", "tokens_per_minute": "10001"})
    assert refused.status_code == 200 and "tokens_per_minute" in refused.context["form"].errors
    assert len(events("key.update")) == 1


def test_rotation_overlaps_then_only_the_new_key_works(console):
    old, old_plaintext = ApiKey.issue(console.alpha, "rotating")
    old.allowed_models, old.read_only, old.requests_per_minute = [GEMMA], True, 5
    old.save()
    client = client_of(console.member)
    assert client.get(f"/console/keys/{old.pk}/rotate/").status_code == 200
    reply = client.post(f"/console/keys/{old.pk}/rotate/", {"overlap_s": "3600"})
    assert reply.status_code == 200 and reply["Cache-Control"] == "no-store"
    new = find_key(plaintext_in(reply)).api_key
    assert new.rotated_from == old and new.created_by == console.member
    assert (new.allowed_models, new.read_only, new.requests_per_minute) == ([GEMMA], True, 5)
    old.refresh_from_db()
    assert timedelta(minutes=59) < old.expires_at - timezone.now() <= timedelta(hours=1)
    assert find_key(old_plaintext).api_key == old  # both work during the overlap
    [event] = events("key.rotate")
    assert event.detail["expires_at"][0] is None and event.target == str(old)
    assert "rotated_to" in event.detail
    # no overlap: the old one stops now
    newest = find_key(plaintext_in(client.post(f"/console/keys/{new.pk}/rotate/",
                                               {"overlap_s": "0"}))).api_key
    assert newest.rotated_from == new and find_key(plaintext_in(reply)).api_key is None
    # an expired key is not rotated again
    assert client.post(f"/console/keys/{new.pk}/rotate/", {"overlap_s": "0"}).status_code == 302
    assert not ApiKey.objects.filter(rotated_from=newest).exists()
    # a bad overlap: the form (on a key not rotated yet: a rotated one is not rotated again)
    url = f"/console/keys/{console.key.pk}/rotate/"
    assert client.post(url, {"overlap_s": "12"}).status_code == 200
    assert not ApiKey.objects.filter(rotated_from=console.key).exists()


def test_rotate_keeps_a_sooner_expiry(console):
    soon = timezone.now() + timedelta(minutes=5)
    console.key.expires_at = soon
    console.key.save()
    console.key.rotate(timedelta(days=7))
    console.key.refresh_from_db()
    assert console.key.expires_at == soon
    console.key.revoke()
    with pytest.raises(ValueError):
        console.key.rotate(timedelta(0))


def test_revoking_asks_first_then_the_key_stops(console):
    key, plaintext = ApiKey.issue(console.alpha, "doomed")
    client = client_of(console.owner)
    confirm = client.get(f"/console/keys/{key.pk}/revoke/")
    assert confirm.status_code == 200 and find_key(plaintext).api_key is not None
    assert client.post(f"/console/keys/{key.pk}/revoke/").status_code == 302
    assert find_key(plaintext).api_key is None
    [event] = events("key.revoke")
    assert event.actor == console.owner and event.target == str(key)
    page = client.get("/console/keys/").content.decode()
    assert "revoked" in page
    # a revoked key is not edited
    assert client.post(f"/console/keys/{key.pk}/", {"name": "back"}).status_code == 403


def test_a_viewer_reads_keys_but_changes_nothing(console):
    client = client_of(console.viewer)
    page = client.get("/console/keys/").content.decode()
    assert f"sk-{console.key.prefix}…" in page and "/console/keys/new/" not in page
    detail = client.get(f"/console/keys/{console.key.pk}/").content.decode()
    assert "/rotate/" not in detail and "/revoke/" not in detail and "<form method=\"post\" " \
        f"action=\"/console/keys/{console.key.pk}/\"" not in detail
    pk = console.key.pk
    for url in ("/console/keys/new/", f"/console/keys/{pk}/rotate/", f"/console/keys/{pk}/revoke/"):
        assert client.get(url).status_code == 403, url
        assert client.post(url, {"name": "x", "overlap_s": "0"}).status_code == 403, url
    assert client.post(f"/console/keys/{pk}/", {"name": "x"}).status_code == 403
    assert ApiKey.objects.count() == 2 and not AuditEvent.objects.exists()
    assert ApiKey.objects.get(pk=pk).is_usable and ApiKey.objects.get(pk=pk).name == "alpha-key"


# -- tenants' walls, CSRF ----------------------------------------------------------------------


def test_another_tenants_ids_are_404_on_every_url(console):
    client = client_of(console.outsider)
    pk = console.key.pk
    for url in (f"/console/keys/{pk}/", f"/console/keys/{pk}/rotate/",
                f"/console/keys/{pk}/revoke/", f"/console/requests/{console.row.pk}/"):
        assert client.get(url).status_code == 404, url
        assert client.post(url, {"name": "x", "overlap_s": "0"}).status_code in (404, 405), url
    assert ApiKey.objects.get(pk=pk).is_usable and ApiKey.objects.get(pk=pk).name == "alpha-key"
    assert not ApiKey.objects.filter(rotated_from=pk).exists()
    # its own work
    assert client.get(f"/console/keys/{console.beta_key.pk}/").status_code == 200
    assert client.get(f"/console/requests/{console.beta_row.pk}/").status_code == 200


def test_list_pages_show_nothing_of_another_tenant_even_when_asked(console):
    AuditEvent.objects.create(tenant=console.alpha, action="key.create", target="alpha-secret")
    client = client_of(console.outsider)
    keys = client.get("/console/keys/").content.decode()
    assert console.key.prefix not in keys and console.beta_key.prefix in keys
    reply = client.get(f"/console/requests/?key={console.key.pk}")
    assert reply.status_code == 200
    assert [row.pk for row in reply.context["page"]] == [console.beta_row.pk]
    assert any("key" in str(m) for m in reply.context["messages"])
    assert "alpha-secret" not in client.get("/console/audit/").content.decode()


def test_every_console_form_needs_the_csrf_token(console):
    client = client_of(console.member, enforce_csrf_checks=True)
    pk = console.key.pk
    for url in ("/console/keys/new/", f"/console/keys/{pk}/", f"/console/keys/{pk}/rotate/",
                f"/console/keys/{pk}/revoke/", "/console/password/", "/console/logout/"):
        assert client.post(url, {"name": "x", "overlap_s": "0"}).status_code == 403, url
    assert Client(enforce_csrf_checks=True).post(
        "/console/login/", {"username": "member", "password": PASSWORD}).status_code == 403
    client.get("/console/keys/new/")  # the form sets the cookie
    token = client.cookies["csrftoken"].value
    reply = client.post("/console/keys/new/", {"name": "x", "csrfmiddlewaretoken": token})
    assert reply.status_code == 200 and find_key(plaintext_in(reply)).api_key.name == "x"


# -- requests, audit log ----------------------------------------------------------------------


def test_requests_filter_and_page(console, settings):
    settings.CONSOLE_PAGE_SIZE = 2
    other_key, _ = ApiKey.issue(console.alpha, "other")
    old = timezone.now() - timedelta(days=3)
    InferenceRequest.objects.create(tenant=console.alpha, api_key=other_key, kind="completion",
                                    model=GEMMA, status="error", error_code="timeout",
                                    created=old)
    InferenceRequest.objects.create(tenant=console.alpha, api_key=console.key, kind="chat",
                                    model=SMOLLM2, status="done", prompt_tokens=7,
                                    cached_tokens=3, completion_tokens=5, ttft_ms=12.5)
    client = client_of(console.viewer)

    def listed(query: str) -> list:
        reply = client.get(f"/console/requests/?{query}")
        assert reply.status_code == 200
        return [(row.model, row.status) for row in reply.context["page"]]

    assert listed("") == [(SMOLLM2, "done"), (SMOLLM2, "queued")]
    assert listed("page=2") == [(GEMMA, "error")]
    assert listed("page=99") == [(GEMMA, "error")] and listed("page=x") == listed("")
    assert listed(f"model={GEMMA}") == [(GEMMA, "error")]
    assert listed("status=error") == listed(f"key={other_key.pk}") == [(GEMMA, "error")]
    assert listed("kind=completion") == [(GEMMA, "error")]
    since = (old + timedelta(days=1)).strftime("%Y-%m-%dT%H:%M")
    assert len(listed(f"since={since}&page=1")) == 2
    assert listed(f"until={since}") == [(GEMMA, "error")]
    reply = client.get("/console/requests/?status=bogus&since=yesterday&key=abc&kind=%00")
    assert reply.status_code == 200 and reply.context["page"].paginator.count == 3
    assert len(list(reply.context["messages"])) == 4
    page = client.get("/console/requests/?status=done").content.decode()
    assert "timeout" not in page and "12" in page and "status=done&amp;page" not in page
    detail = client.get(f"/console/requests/{console.row.pk}/")
    assert detail.status_code == 200 and str(console.row.pk) in detail.content.decode()
    assert client.get("/console/requests/not-a-uuid/").status_code == 404


def test_the_audit_log_shows_the_tenants_events(console, settings):
    settings.CONSOLE_PAGE_SIZE = 1
    client = client_of(console.member)
    client.post(f"/console/keys/{console.key.pk}/revoke/")
    new_key(client)
    reply = client_of(console.viewer).get("/console/audit/")
    assert reply.status_code == 200 and reply.context["page"].paginator.count == 2
    assert "key created" in reply.content.decode() and "member" in reply.content.decode()
    assert "key revoked" in client_of(console.viewer).get(
        "/console/audit/?page=2").content.decode()


def test_the_operator_sees_every_audit_event_read_only(console, admin_client):
    admin_client.post(f"/admin/accounts/tenant/{console.alpha.pk}/change/", {
        "name": "Alpha", "slug": "alpha", "is_active": "on", "requests_per_minute": "50",
        "tokens_per_minute": "10000", "monthly_token_budget": "1000000"})
    [limits] = events("tenant.limits")
    assert limits.tenant == console.alpha and limits.detail == {"requests_per_minute": [100, 50]}
    admin_client.post(f"/admin/accounts/apikey/{console.beta_key.pk}/change/", {
        "name": "beta-key", "allowed_models": "[]", "tokens_per_minute": "7"})
    [update] = events("key.update")
    assert update.detail == {"tokens_per_minute": [None, 7]}
    admin_client.post("/admin/accounts/apikey/", {
        "action": "revoke_keys", "_selected_action": [console.key.pk]})
    assert events("key.revoke")[0].tenant == console.alpha
    assert admin_client.get("/admin/accounts/auditevent/").status_code == 200
    assert admin_client.get("/admin/accounts/auditevent/add/").status_code == 403
    page = admin_client.get(f"/admin/accounts/auditevent/{limits.pk}/change/")
    assert page.status_code == 200 and b'name="_save"' not in page.content
    assert admin_client.get(f"/admin/accounts/auditevent/{limits.pk}/delete/").status_code == 403
    assert admin_client.get("/admin/accounts/membership/").status_code == 200


def test_hostile_parameters_are_ignored_never_a_500(console):
    client = client_of(console.member)
    for query in ("key=99999999999999999999999", "key=-1", "page=-1", "page=9" * 30,
                  "since=9999-12-31T23:59", "until=0001-01-01T00:00", "model=" + "x" * 300,
                  "model=%00"):
        assert client.get(f"/console/requests/?{query}").status_code == 200, query
    assert client.get("/console/audit/?page=zz").status_code == 200
    assert client.get("/console/keys/99999999999999999999999/").status_code == 404
