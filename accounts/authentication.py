"""API key authentication: `Authorization: Bearer sk-<prefix>.<secret>`."""

import time

from rest_framework import exceptions
from rest_framework.authentication import TokenAuthentication

from accounts.models import ApiKey, Tenant, split_key
from config.db import PreparedQuery

# Every API request runs this lookup: compiled once (prefix is unique: no ordering needed).
_KEY_BY_PREFIX = PreparedQuery(
    lambda prefix: ApiKey.objects.select_related("tenant").filter(prefix=prefix).order_by()[:1]
)


def authenticate_key(raw: str) -> ApiKey | None:
    """The usable ApiKey (tenant loaded) for a plaintext key, else None.

    Shared by the REST API and the websocket layer. Revoked keys and inactive
    tenants fail at once: nothing is cached. Anything not shaped like a key we issue
    (``split_key``: a NUL or non-ASCII character, a non-string) fails before the database.
    """
    parts = split_key(raw.strip()) if isinstance(raw, str) else None
    if parts is None:
        return None
    prefix, secret = parts
    api_key = _KEY_BY_PREFIX.first(prefix)
    if api_key is None or not api_key.matches(secret) or not api_key.is_usable:
        return None
    api_key.touch()
    api_key.loaded_at = time.monotonic()  # its tenant's limits are this fresh
    return api_key


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


class ApiKeyAuthentication(TokenAuthentication):
    """DRF authentication by API key; refusals become 401 `invalid_api_key`."""

    keyword = "Bearer"

    def authenticate_credentials(self, key: str) -> tuple[ApiKeyUser, ApiKey]:
        api_key = authenticate_key(key)
        if api_key is None:
            raise exceptions.AuthenticationFailed("Incorrect API key provided.")
        return ApiKeyUser(api_key), api_key
