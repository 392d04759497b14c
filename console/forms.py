"""The console's forms: a key's settings, a rotation's overlap, the requests page's filters,
and an invite (the admin's form and ``manage.py invite`` share ``invite``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django import forms
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.tokens import default_token_generator
from django.core.mail import send_mail
from django.db import transaction
from django.db.models import Q
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.urls import reverse
from django.utils import timezone
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from accounts import audit
from accounts.models import ApiKey, AuditEvent, Membership, Tenant
from config.models import CATALOG
from inference.models import Adapter, InferenceRequest

# What a key's edit form changes; the audit event names each that changed.
KEY_FIELDS = ["name", "expires_at", "allowed_models", "read_only", "requests_per_minute",
              "tokens_per_minute", "monthly_token_budget"]
OVERLAPS = [(0, "none: the old key stops now"), (300, "5 minutes"), (3600, "1 hour"),
            (86400, "24 hours"), (7 * 86400, "7 days")]
DATETIME_FORMAT = "%Y-%m-%dT%H:%M"
# A key's expiry to the second: a form posted back unchanged leaves it as it is (to the
# minute, a rename moved it, and an expired key's was "in the past").
EXPIRY_FORMAT = "%Y-%m-%dT%H:%M:%S"


class DateTimeField(forms.DateTimeField):
    """Django's, refusing a time that has no UTC time (an offset past year 1 or 9999):
    the database stores UTC, and the conversion raised OverflowError (a 500)."""

    def to_python(self, value: Any) -> datetime | None:
        moment = super().to_python(value)
        if moment is not None:
            try:
                moment.astimezone(UTC)
            except OverflowError:
                raise forms.ValidationError(self.error_messages["invalid"],
                                            code="invalid") from None
        return moment


def model_choices(tenant: Tenant, current: list[str]) -> list[tuple[str, str]]:
    """What a key may be limited to: the served models and the catalog's, the tenant's
    adapters as ``<model>:<name>``, and what the key already lists (set in the admin)."""
    names = list(dict.fromkeys([*settings.MODELS, *CATALOG]))
    names += [f"{a.model}:{a.name}" for a in Adapter.objects.filter(tenant=tenant)]
    names += [name for name in current if name not in names]
    return [(name, name) for name in names]


def audit_value(value: Any) -> Any:
    """A field's value as the audit log's JSON holds it."""
    if isinstance(value, datetime):
        return value.isoformat()
    return value


class KeyForm(forms.ModelForm):
    """A key's settings; its limits within its tenant's (``ApiKey.clean``)."""

    allowed_models = forms.MultipleChoiceField(
        required=False, widget=forms.CheckboxSelectMultiple,
        help_text="none ticked: every model (and adapter) of the tenant")
    expires_at = DateTimeField(
        required=False, label="Expires (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local", "step": "1"},
                                   format=EXPIRY_FORMAT),
        help_text="blank: never")

    class Meta:
        model = ApiKey
        fields = KEY_FIELDS

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        kwargs.setdefault("instance", ApiKey(tenant=tenant))
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].choices = model_choices(
            tenant, list(self.instance.allowed_models or []))

    def clean_expires_at(self) -> datetime | None:
        expires_at = self.cleaned_data["expires_at"]
        if expires_at is not None and "expires_at" in self.changed_data \
                and expires_at <= timezone.now():
            raise forms.ValidationError("must be in the future")
        return expires_at

    def changes(self) -> dict[str, list[Any]]:
        """Each changed field → [old, new] (for the audit log), before ``save``."""
        pairs = {name: [audit_value(self.initial.get(name)),
                        audit_value(self.cleaned_data.get(name))] for name in self.changed_data}
        return {name: pair for name, pair in pairs.items() if pair[0] != pair[1]}


class RotateForm(forms.Form):
    overlap_s = forms.TypedChoiceField(
        choices=OVERLAPS, coerce=int, initial=86400, label="The old key keeps working for",
        widget=forms.RadioSelect)

    @property
    def overlap(self) -> timedelta:
        return timedelta(seconds=self.cleaned_data["overlap_s"])


class RequestFilterForm(forms.Form):
    """The requests page's filters (GET); a field that does not validate is left out."""

    model = forms.CharField(required=False, max_length=200)
    key = forms.ModelChoiceField(queryset=ApiKey.objects.none(), required=False)
    status = forms.ChoiceField(required=False,
                               choices=[("", "any"), *InferenceRequest.Status.choices])
    kind = forms.ChoiceField(required=False,
                             choices=[("", "any"), *InferenceRequest.Kind.choices])
    since = DateTimeField(
        required=False, label="from (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format=DATETIME_FORMAT))
    until = DateTimeField(
        required=False, label="to (UTC)",
        widget=forms.DateTimeInput(attrs={"type": "datetime-local"}, format=DATETIME_FORMAT))

    def __init__(self, *args: Any, tenant: Tenant, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fields["key"].queryset = ApiKey.objects.for_tenant(tenant)

    def apply(self, rows: Any) -> Any:
        """``rows`` narrowed by the valid filters (call ``is_valid`` first)."""
        data = self.cleaned_data
        lookups = {"model": data.get("model"), "api_key": data.get("key"),
                   "status": data.get("status"), "kind": data.get("kind"),
                   "created__gte": data.get("since"), "created__lt": data.get("until")}
        return rows.filter(**{name: value for name, value in lookups.items() if value})


class InviteForm(forms.Form):
    """The operator's invite (the admin's page): a new user of a tenant, by email."""

    email = forms.EmailField(max_length=150)
    tenant = forms.ModelChoiceField(queryset=Tenant.objects.filter(is_active=True))
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)

    def clean_email(self) -> str:
        email = get_user_model().objects.normalize_email(self.cleaned_data["email"]).strip()
        users = get_user_model().objects
        if users.filter(Q(username__iexact=email) | Q(email__iexact=email)).exists():
            raise forms.ValidationError("a user with this email exists")
        return email


def invite(email: str, tenant: Tenant, role: str, *, base_url: str,
           request: HttpRequest | None = None, invited_by: Any = None,
           actor_name: str = "") -> tuple[Any, str]:
    """Create a user named ``email`` with no usable password, its membership of ``tenant``,
    the ``member.invite`` audit event, and mail it the link that sets its password
    (``console:password_reset_confirm``, valid PASSWORD_RESET_TIMEOUT). Returns the user
    and the link."""
    with transaction.atomic():
        user = get_user_model().objects.create_user(username=email, email=email)
        Membership.objects.create(user=user, tenant=tenant, role=role, invited_by=invited_by)
        audit.record(AuditEvent.Action.MEMBER_INVITE, tenant=tenant, request=request,
                     actor=invited_by, actor_name=actor_name, target=email,
                     detail={"role": [None, role]})
    path = reverse("console:password_reset_confirm", kwargs={
        "uidb64": urlsafe_base64_encode(force_bytes(user.pk)),
        "token": default_token_generator.make_token(user)})
    link = f"{base_url.rstrip('/')}{path}"
    context = {"link": link, "tenant": tenant, "role": role, "email": email,
               "days": max(1, settings.PASSWORD_RESET_TIMEOUT // 86400)}
    subject = render_to_string("console/email/invite_subject.txt", context).strip()
    body = render_to_string("console/email/invite_body.txt", context)
    send_mail(subject, body, None, [email])
    return user, link
