import hashlib
import hmac
import secrets
import string
import time
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models, transaction
from django.db.models import Q
from django.utils import timezone

KEY_START = "sk-"
PREFIX_LENGTH = 10
# last_used_at is a hint, not an audit log: write it at most this often per key.
LAST_USED_RESOLUTION = timedelta(minutes=1)
_PREFIX_ALPHABET = string.ascii_letters + string.digits
_PREFIX_CHARS = frozenset(_PREFIX_ALPHABET)
# A key's own limits, each within its tenant's limit of the same name (``ApiKey.clean``).
KEY_LIMITS = ("requests_per_minute", "tokens_per_minute", "monthly_token_budget")
MAX_SECRET_LENGTH = 256  # issued secrets are 43 characters (token_urlsafe(32))


def secret_digest(secret: str) -> str:
    """HMAC-SHA256 of a key's secret part, keyed with SECRET_KEY (hex)."""
    return hmac.new(settings.SECRET_KEY.encode(), secret.encode(), hashlib.sha256).hexdigest()


def split_key(raw: str) -> tuple[str, str] | None:
    """`sk-<prefix>.<secret>` -> (prefix, secret), or None when it is not shaped so.

    The prefix must be made of the characters keys are issued with, and the secret of
    printable ASCII of a sane length: anything else (a NUL, which PostgreSQL cannot
    compare; a lone surrogate, which has no bytes to hash) cannot be a key we issued.
    """
    if not isinstance(raw, str) or not raw.startswith(KEY_START):
        return None
    prefix, dot, secret = raw[len(KEY_START) :].partition(".")
    if not dot or len(prefix) != PREFIX_LENGTH or not secret:
        return None
    if not _PREFIX_CHARS.issuperset(prefix) or not _is_secret_text(secret):
        return None
    return prefix, secret


def _is_secret_text(secret: str) -> bool:
    return len(secret) <= MAX_SECRET_LENGTH and secret.isascii() and secret.isprintable()


class Tenant(models.Model):
    """A customer: owns API keys, request history, and its own prompt cache scope."""

    name = models.CharField(max_length=200)
    slug = models.SlugField(max_length=64, unique=True)
    is_active = models.BooleanField(default=True)
    created = models.DateTimeField(auto_now_add=True)
    # Limits (blank: unlimited), enforced when a request is queued (inference/limits.py).
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests admitted per UTC minute; blank: unlimited")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="prompt + completion tokens per UTC minute, counted when requests end")
    max_concurrent = models.PositiveIntegerField(
        null=True, blank=True, help_text="requests queued or running at once; blank: unlimited")
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True, blank=True,
        help_text="prompt + completion tokens per UTC month; blank: unlimited")
    max_queued = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="requests waiting in a daemon's queue at once; blank: MAX_QUEUE_PER_TENANT")

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug


class ApiKeyQuerySet(models.QuerySet):
    def usable(self) -> "ApiKeyQuerySet":
        """Keys that authenticate: not revoked, not expired, tenant active."""
        return self.filter(revoked_at__isnull=True, tenant__is_active=True).filter(
            Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))

    def for_tenant(self, tenant: Tenant) -> "ApiKeyQuerySet":
        """One tenant's keys: the only way the console reaches keys."""
        return self.filter(tenant=tenant)


class ApiKey(models.Model):
    """`sk-<prefix>.<secret>`: the prefix is stored for lookup, the secret only as a digest."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100, default="default")
    prefix = models.CharField(max_length=PREFIX_LENGTH, unique=True, editable=False)
    digest = models.CharField(max_length=64, editable=False)
    created = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)
    revoked_at = models.DateTimeField(null=True, blank=True, editable=False)
    # After ``expires_at`` the key no longer authenticates (a rotated key's overlap ends so).
    expires_at = models.DateTimeField(
        null=True, blank=True, help_text="after this the key no longer works; blank: never")
    # What the key may do, within its tenant's (docs/console.md; the allow-list is read by
    # inference/service.py model_allowed):
    allowed_models = models.JSONField(
        default=list, blank=True,
        help_text='model names (or "<model>:<adapter>") the key may use; empty: every model')
    read_only = models.BooleanField(
        default=False, help_text="history and usage only: no inference")
    requests_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="the key's own limit within the tenant's; blank: none")
    tokens_per_minute = models.PositiveIntegerField(
        null=True, blank=True, help_text="the key's own limit within the tenant's; blank: none")
    monthly_token_budget = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="the key's own limit within the tenant's; blank: none")
    rotated_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rotated_to",
        editable=False, help_text="the key this one replaced (rotation)")
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL,
        related_name="+", editable=False)

    objects = ApiKeyQuerySet.as_manager()

    # When this instance (and a tenant loaded with it) was read from the database, in
    # time.monotonic() seconds; None for one never loaded. inference/limits.py trusts the
    # tenant limits of a key loaded this second (a REST request loads its key each time).
    loaded_at: float | None = None

    class Meta:
        ordering = ["-created"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{KEY_START}{self.prefix}… ({self.name})"

    @classmethod
    def from_db(cls, db: str | None, field_names: list[str], values: list) -> "ApiKey":
        instance = super().from_db(db, field_names, values)
        instance.loaded_at = time.monotonic()
        return instance

    @classmethod
    def issue(cls, tenant: Tenant, name: str = "default") -> tuple["ApiKey", str]:
        """Create a key; returns it with its plaintext, which is never stored."""
        api_key = cls(tenant=tenant, name=name)
        plaintext = api_key.assign_secret()
        api_key.save()
        return api_key, plaintext

    def clean(self) -> None:
        """A key's own limits within its tenant's (a tenant without a limit: any)."""
        tenant = self.tenant if self.tenant_id is not None else None
        errors = {}
        for field in KEY_LIMITS:
            own, tenants = getattr(self, field), getattr(tenant, field, None)
            if own is not None and tenants is not None and own > tenants:
                errors[field] = f"at most the tenant's ({tenants})"
        if errors:
            raise ValidationError(errors)

    def assign_secret(self) -> str:
        """Give an unsaved key a fresh prefix and secret; returns the plaintext key."""
        self.prefix = "".join(secrets.choice(_PREFIX_ALPHABET) for _ in range(PREFIX_LENGTH))
        secret = secrets.token_urlsafe(32)
        self.digest = secret_digest(secret)
        return f"{KEY_START}{self.prefix}.{secret}"

    def matches(self, secret: str) -> bool:
        return hmac.compare_digest(self.digest, secret_digest(secret))

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def is_usable(self) -> bool:
        return self.revoked_at is None and not self.is_expired and self.tenant.is_active

    def revoke(self) -> None:
        self.revoked_at = timezone.now()
        self.save(update_fields=["revoked_at"])

    def rotate(self, overlap: timedelta, by: Any = None) -> tuple["ApiKey", str]:
        """A new key with this one's settings (name, expiry, allow-list, read-only, limits)
        and ``rotated_from`` this one; this one stops working after ``overlap`` (its own
        expiry kept when sooner). Returns the new key and its plaintext, never stored.
        A revoked or expired key, or one rotated already, is not rotated (ValueError): a
        second successor (a double submit) would be a live key no one has the plaintext of."""
        if overlap < timedelta(0):
            raise ValueError("a negative overlap")
        if self.revoked_at is not None or self.is_expired:
            raise ValueError("a revoked or expired key is not rotated")
        successor = ApiKey(
            tenant=self.tenant, name=self.name, expires_at=self.expires_at,
            allowed_models=list(self.allowed_models or []), read_only=self.read_only,
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
            monthly_token_budget=self.monthly_token_budget, rotated_from=self, created_by=by)
        plaintext = successor.assign_secret()
        ends = timezone.now() + overlap
        with transaction.atomic():
            # the key's row locked (PostgreSQL): two rotations at once make one successor
            ApiKey.objects.select_for_update().filter(pk=self.pk).first()
            if self.rotated_to.exists():
                raise ValueError("a key is rotated once")
            successor.save()
            if self.expires_at is None or self.expires_at > ends:
                self.expires_at = ends
                self.save(update_fields=["expires_at"])
        return successor, plaintext

    def touch(self) -> None:
        """Record use, writing at most once per LAST_USED_RESOLUTION."""
        now = timezone.now()
        if self.last_used_at is None or now - self.last_used_at >= LAST_USED_RESOLUTION:
            ApiKey.objects.filter(pk=self.pk).update(last_used_at=now)
            self.last_used_at = now


class Membership(models.Model):
    """A Django user's place in a tenant (the console, docs/console.md): one tenant per user.
    Owners and members manage keys; viewers see keys, usage, requests and the audit log."""

    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"
        VIEWER = "viewer", "Viewer"

    user = models.OneToOneField(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                                related_name="membership")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.MEMBER)
    created = models.DateTimeField(auto_now_add=True)
    invited_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                   on_delete=models.SET_NULL, related_name="+", editable=False)

    class Meta:
        ordering = ["tenant", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} ({self.role} of {self.tenant})"

    @property
    def can_manage_keys(self) -> bool:
        return self.role in (self.Role.OWNER, self.Role.MEMBER)


class AuditEvent(models.Model):
    """Who did what to a tenant's keys, limits or members, when and from where (written by
    accounts/audit.py only; shown in the console and the admin, never edited)."""

    class Action(models.TextChoices):
        KEY_CREATE = "key.create", "key created"
        KEY_REVOKE = "key.revoke", "key revoked"
        KEY_ROTATE = "key.rotate", "key rotated"
        KEY_UPDATE = "key.update", "key changed"
        TENANT_LIMITS = "tenant.limits", "tenant limits changed"
        MEMBER_INVITE = "member.invite", "member invited"
        MEMBER_UPDATE = "member.update", "member changed"
        MEMBER_REMOVE = "member.remove", "member removed"

    tenant = models.ForeignKey(Tenant, null=True, blank=True, on_delete=models.SET_NULL,
                               related_name="audit_events")
    actor = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.SET_NULL, related_name="+")
    actor_name = models.CharField(max_length=150, blank=True,
                                  help_text="who, as named then (a user, or a command)")
    action = models.CharField(max_length=32, choices=Action.choices)
    target = models.CharField(max_length=200, blank=True)
    detail = models.JSONField(default=dict, blank=True)
    address = models.GenericIPAddressField(null=True, blank=True)
    created = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["tenant", "-created"], name="audit_tenant_created")]

    def __str__(self) -> str:
        return f"{self.created:%Y-%m-%d %H:%M} {self.actor_name} {self.action} {self.target}"
