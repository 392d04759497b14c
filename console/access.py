"""Who may see a console page: a logged-in user with a ``Membership``; the page sees only its
tenant (``request.membership``). Every console view is wrapped by ``member_view``."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse

from accounts.models import Membership


def membership_of(request: HttpRequest) -> Membership | None:
    """The logged-in user's membership (its tenant loaded), or None."""
    user = request.user
    if not user.is_authenticated or not user.is_active:
        return None
    return Membership.objects.select_related("tenant").filter(
        user=user, tenant__is_active=True).first()


def member_view(section: str, *, manage_keys: bool = False) -> Callable:
    """A console view: login required (else the login page), a membership of an active
    tenant required (else 403), and for ``manage_keys`` a role that manages keys (owner,
    member; a viewer gets 403). The view gets ``request.membership``; ``context(request)``
    gives the base template's ``membership`` and ``section``."""

    def decorate(view: Callable[..., HttpResponse]) -> Callable[..., HttpResponse]:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path(), "console:login")
            membership = membership_of(request)
            if membership is None:
                raise PermissionDenied("not a member of an active tenant")
            if manage_keys and not membership.can_manage_keys:
                raise PermissionDenied("this role cannot manage keys")
            request.membership = membership
            request.console_section = section
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def context(request: HttpRequest, **extra: Any) -> dict[str, Any]:
    """The base template's context for a ``member_view`` page, plus ``extra``."""
    return {"membership": request.membership, "section": request.console_section, **extra}
