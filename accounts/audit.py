"""The audit log's one writer: who created, revoked, rotated a key or changed a limit or a
member, when and from where (``AuditEvent``; shown in the console and the admin)."""

from __future__ import annotations

import ipaddress
from typing import Any

from django.http import HttpRequest

from accounts.models import AuditEvent, Tenant


def client_address(request: HttpRequest | None) -> str | None:
    """The request's client address as Django sees it (behind the door: nginx's
    X-Real-IP becomes daphne's client; docs/security.md), or None."""
    if request is None:
        return None
    address = request.META.get("REMOTE_ADDR") or ""
    try:
        return str(ipaddress.ip_address(address))
    except ValueError:
        return None


def record(action: str, *, tenant: Tenant | None, request: HttpRequest | None = None,
           actor: Any = None, actor_name: str = "", target: str = "",
           detail: dict[str, Any] | None = None) -> AuditEvent:
    """Write one audit event. The actor is ``request.user`` unless given; ``actor_name``
    names one that is not a user (a ``manage.py`` command)."""
    if actor is None and request is not None and getattr(request, "user", None) is not None \
            and request.user.is_authenticated:
        actor = request.user
    if actor is not None and not actor_name:
        actor_name = actor.get_username()
    return AuditEvent.objects.create(
        tenant=tenant, actor=actor, actor_name=actor_name[:150], action=action,
        target=target[:200], detail=detail or {}, address=client_address(request))
