"""The console's pages (docs/console.md): keys, requests, the audit log, and Django's auth
views with the console's templates. Every page is a ``member_view`` and reaches its rows
through the member's tenant only (another tenant's id is a 404)."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from django.conf import settings
from django.contrib import messages
from django.contrib.auth import get_user_model
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import PasswordResetForm
from django.core.cache import cache
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.views.decorators.http import require_http_methods

from accounts.audit import client_address, record
from accounts.models import ApiKey, AuditEvent, Membership
from console.access import context, member_view, membership_of
from console.forms import KeyForm, RequestFilterForm, RotateForm, audit_value
from inference.models import InferenceRequest

log = logging.getLogger(__name__)


def _page(request: HttpRequest, rows: Any) -> Any:
    """The page of ``rows`` the ``page`` parameter names (the last for one past it)."""
    return Paginator(rows, max(1, min(settings.CONSOLE_PAGE_SIZE, 500))).get_page(
        request.GET.get("page"))


def _key(request: HttpRequest, pk: int) -> ApiKey:
    return get_object_or_404(
        ApiKey.objects.for_tenant(request.membership.tenant).select_related(
            "created_by", "rotated_from"), pk=pk)


def _created(request: HttpRequest, api_key: ApiKey, plaintext: str, title: str) -> HttpResponse:
    """The one response that shows a key's plaintext (never stored, never cached)."""
    response = render(request, "console/key_created.html",
                      context(request, key=api_key, plaintext=plaintext, title=title))
    response["Cache-Control"] = "no-store"
    return response


@member_view("keys")
def home(request: HttpRequest) -> HttpResponse:
    return redirect("console:keys")


@member_view("keys")
def keys(request: HttpRequest) -> HttpResponse:
    rows = ApiKey.objects.for_tenant(request.membership.tenant).select_related(
        "created_by", "rotated_from").prefetch_related("rotated_to")
    return render(request, "console/keys.html", context(request, keys=rows))


@member_view("keys", manage_keys=True)
@require_http_methods(["GET", "POST"])
def key_new(request: HttpRequest) -> HttpResponse:
    tenant = request.membership.tenant
    form = KeyForm(request.POST or None, tenant=tenant)
    if request.method == "POST" and form.is_valid():
        api_key = form.save(commit=False)
        api_key.created_by = request.user
        plaintext = api_key.assign_secret()
        api_key.save()
        detail = {name: [None, audit_value(form.cleaned_data[name])] for name in form.changed_data}
        record(AuditEvent.Action.KEY_CREATE, tenant=tenant, request=request,
                     target=str(api_key), detail=detail)
        return _created(request, api_key, plaintext, "Key created")
    return render(request, "console/key_form.html", context(request, form=form))


@member_view("keys")
@require_http_methods(["GET", "POST"])
def key_detail(request: HttpRequest, pk: int) -> HttpResponse:
    api_key = _key(request, pk)
    can_edit = request.membership.can_manage_keys and api_key.revoked_at is None
    if request.method == "POST" and not can_edit:
        raise PermissionDenied("this role cannot change keys, or the key is revoked")
    form = KeyForm(request.POST or None, tenant=api_key.tenant, instance=api_key)
    if request.method == "POST" and form.is_valid():
        changes = form.changes()
        form.save()
        if changes:
            record(AuditEvent.Action.KEY_UPDATE, tenant=api_key.tenant, request=request,
                         target=str(api_key), detail=changes)
            messages.success(request, f"Saved: {', '.join(changes)}.")
        return redirect("console:key_detail", pk=api_key.pk)
    rows = InferenceRequest.objects.for_tenant(api_key.tenant).filter(api_key=api_key)
    return render(request, "console/key_detail.html", context(
        request, key=api_key, form=form, can_edit=can_edit, recent=rows[:10],
        successors=api_key.rotated_to.all()))


@member_view("keys", manage_keys=True)
@require_http_methods(["GET", "POST"])
def key_rotate(request: HttpRequest, pk: int) -> HttpResponse:
    api_key = _key(request, pk)
    form = RotateForm(request.POST or None)
    refused = redirect("console:key_detail", pk=api_key.pk)
    if not api_key.is_usable or api_key.rotated_to.exists():
        messages.error(request, "A revoked, expired or already rotated key is not rotated.")
        return refused
    if request.method == "POST" and form.is_valid():
        old_expiry = api_key.expires_at
        try:
            successor, plaintext = api_key.rotate(form.overlap, by=request.user)
        except ValueError:  # rotated by another submit meanwhile
            messages.error(request, "This key was rotated already.")
            return refused
        record(AuditEvent.Action.KEY_ROTATE, tenant=api_key.tenant, request=request,
                     target=str(api_key), detail={
                         "expires_at": [audit_value(old_expiry), audit_value(api_key.expires_at)],
                         "rotated_to": [None, str(successor)]})
        return _created(request, successor, plaintext, "Key rotated")
    return render(request, "console/key_rotate.html", context(request, key=api_key, form=form))


@member_view("keys", manage_keys=True)
@require_http_methods(["GET", "POST"])
def key_revoke(request: HttpRequest, pk: int) -> HttpResponse:
    api_key = _key(request, pk)
    if request.method == "POST" and api_key.revoked_at is None:
        api_key.revoke()
        record(AuditEvent.Action.KEY_REVOKE, tenant=api_key.tenant, request=request,
                     target=str(api_key), detail={"revoked_at": [None, audit_value(
                         api_key.revoked_at)]})
        messages.success(request, f"Revoked {api_key}.")
        return redirect("console:key_detail", pk=api_key.pk)
    if request.method == "POST":
        return redirect("console:key_detail", pk=api_key.pk)
    return render(request, "console/key_revoke.html", context(request, key=api_key))


@member_view("requests")
def requests(request: HttpRequest) -> HttpResponse:
    tenant = request.membership.tenant
    form = RequestFilterForm(request.GET, tenant=tenant)
    form.is_valid()
    for name, errors in form.errors.items():
        messages.warning(request, f"Filter {name!r} ignored: {' '.join(errors)}")
    rows = form.apply(InferenceRequest.objects.for_tenant(tenant).select_related("api_key"))
    query = request.GET.copy()
    query.pop("page", None)
    return render(request, "console/requests.html", context(
        request, form=form, page=_page(request, rows.order_by("-created")),
        query=query.urlencode()))


@member_view("requests")
def request_detail(request: HttpRequest, pk: Any) -> HttpResponse:
    row = get_object_or_404(
        InferenceRequest.objects.for_tenant(request.membership.tenant).select_related(
            "api_key"), pk=pk)
    return render(request, "console/request_detail.html", context(request, row=row))


@member_view("audit")
def audit(request: HttpRequest) -> HttpResponse:
    rows = AuditEvent.objects.filter(tenant=request.membership.tenant).select_related(
        "actor").order_by("-created")
    return render(request, "console/audit.html", context(request, page=_page(request, rows)))


# -- Django's auth views, with the console's templates and routes ---------------------------


class ConsolePage:
    """An auth view's page in the console's frame (its nav when the user is a member)."""

    def get_context_data(self, **kwargs: Any) -> dict[str, Any]:
        data = super().get_context_data(**kwargs)
        data.setdefault("membership", membership_of(self.request))
        return data


class LoginView(ConsolePage, auth_views.LoginView):
    """Django's login, rate-limited by django-axes (config/settings.py AXES_*)."""

    template_name = "console/login.html"
    next_page = reverse_lazy("console:keys")


class LogoutView(auth_views.LogoutView):  # POST only (Django's)
    next_page = reverse_lazy("console:login")


class PasswordChangeView(ConsolePage, auth_views.PasswordChangeView):
    template_name = "console/password_change.html"
    success_url = reverse_lazy("console:password_change_done")


class PasswordChangeDoneView(ConsolePage, auth_views.PasswordChangeDoneView):
    template_name = "console/password_change_done.html"


class ResetForm(PasswordResetForm):
    """Django's reset form for tenant members only (an operator's account is the admin's
    business: no console mail resets it); an invited member who has not set a password yet
    (an expired invite) gets a link too."""

    def get_users(self, email: str) -> Any:
        for user in super().get_users(email):
            if _is_member(user):
                yield user
        for user in get_user_model().objects.filter(
                email__iexact=email, is_active=True, membership__isnull=False, is_staff=False):
            if not user.has_usable_password():
                yield user


def _is_member(user: Any) -> bool:
    return not user.is_staff and not user.is_superuser and \
        Membership.objects.filter(user=user).exists()


# Reset mails: at most this many an hour per address asked for and per client address (in
# this process: Django's cache). Over it the page answers as always and sends nothing.
RESETS_PER_EMAIL_HOUR = 3
RESETS_PER_CLIENT_HOUR = 20


def _reset_allowed(request: HttpRequest, email: str) -> bool:
    """Count a reset asked for ``email`` from the request's address; False when either is
    over its hourly allowance."""
    digest = hashlib.sha256(email.strip().lower().encode()).hexdigest()
    allowed = True
    for key, limit in ((f"console:reset:email:{digest}", RESETS_PER_EMAIL_HOUR),
                       (f"console:reset:client:{client_address(request)}",
                        RESETS_PER_CLIENT_HOUR)):
        cache.add(key, 0, 3600)
        try:
            count = cache.incr(key)
        except ValueError:  # expired between add and incr
            cache.set(key, 1, 3600)
            count = 1
        allowed = allowed and count <= limit
    return allowed


class PasswordResetView(ConsolePage, auth_views.PasswordResetView):
    template_name = "console/password_reset.html"
    form_class = ResetForm
    email_template_name = "console/email/reset_body.txt"
    subject_template_name = "console/email/reset_subject.txt"
    success_url = reverse_lazy("console:password_reset_done")

    def form_valid(self, form: ResetForm) -> HttpResponse:
        if _reset_allowed(self.request, form.cleaned_data["email"]):
            return super().form_valid(form)
        log.warning("console password reset over its hourly allowance (client %s)",
                    client_address(self.request))
        return HttpResponseRedirect(self.get_success_url())  # the same answer, no mail


class PasswordResetDoneView(ConsolePage, auth_views.PasswordResetDoneView):
    template_name = "console/password_reset_done.html"


class PasswordResetConfirmView(ConsolePage, auth_views.PasswordResetConfirmView):
    """Sets an invited member's first password, or a forgotten one."""

    template_name = "console/password_reset_confirm.html"
    success_url = reverse_lazy("console:password_reset_complete")


class PasswordResetCompleteView(ConsolePage, auth_views.PasswordResetCompleteView):
    template_name = "console/password_reset_complete.html"
