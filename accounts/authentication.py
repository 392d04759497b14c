"""API keys: a plaintext ``sk-<prefix>.<secret>`` to its usable ``ApiKey`` (the API's DRF
authentication and the websocket use this lookup: inference/auth.py)."""

from typing import NamedTuple

from accounts.models import ApiKey, Tenant, split_key


class Found(NamedTuple):
    """What the database says of a plaintext key."""

    api_key: ApiKey | None  # the usable key (tenant loaded), else None
    prefix_exists: bool  # whether any key, usable or not, has the key's prefix


def find_key(raw: str) -> Found:
    """The usable ApiKey for a plaintext key, and whether its prefix names a key at all
    (inference/auth.py remembers a prefix that names none, so that it costs no query again).

    Revoked keys and inactive tenants fail at once: nothing is cached. Anything not shaped
    like a key we issue (``split_key``: a NUL or non-ASCII character, a non-string) fails
    before the database.
    """
    parts = split_key(raw.strip()) if isinstance(raw, str) else None
    if parts is None:
        return Found(None, False)
    prefix, secret = parts
    api_key = ApiKey.objects.select_related("tenant").filter(prefix=prefix).first()
    if api_key is None:
        return Found(None, False)
    if not api_key.matches(secret) or not api_key.is_usable:
        return Found(None, True)
    api_key.touch()
    return Found(api_key, True)


def authenticate_key(raw: str) -> ApiKey | None:
    """The usable ApiKey (tenant loaded) for a plaintext key, else None (``find_key``)."""
    return find_key(raw).api_key


class ApiKeyUser:
    """What `request.user` is for a key-authenticated request; `request.auth` is the key."""

    is_authenticated = True
    is_anonymous = False
    is_active = True
    is_staff = False
    is_superuser = False

    def __init__(self, api_key: ApiKey) -> None:
        self.api_key = api_key

    def __str__(self) -> str:
        return f"tenant:{self.tenant.slug}"

    @property
    def tenant(self) -> Tenant:
        return self.api_key.tenant

    @property
    def pk(self) -> int:
        # DRF's user throttles key on user.pk: limit per tenant, not per key.
        return self.api_key.tenant_id
