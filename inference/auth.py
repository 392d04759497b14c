"""The API's authentication: one DRF class for every view, the same lookup for websockets.

``ApiKeyAuthentication`` (REST_FRAMEWORK's default: every /v1/ view, sync or async) reads
``Authorization: Bearer sk-...``; ``key_for`` is the same lookup for async code (the
websocket's middleware and its ``auth`` message). A key is looked up in the database
(``accounts.authentication.authenticate_key``, on the web's database thread) and then
trusted for ``KEY_CACHE_S`` in this process: a revoked key, or one whose tenant was
deactivated, stops authenticating within that second in every web process, and at once
in a process that changed it through the model (``revoke()``, a save in the admin: the
cache forgets it on ``post_save``/``post_delete``). Open websockets notice within
``WS_REVOCATION_CHECK_S`` (consumers.py), the same second.
"""
from __future__ import annotations

import time
from typing import Any

from channels.middleware import BaseMiddleware
from django.db.models.signals import post_delete, post_save
from django.dispatch import receiver
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from accounts.authentication import ApiKeyUser, authenticate_key
from accounts.models import ApiKey, Tenant, split_key
from inference import db

KEYWORD = "Bearer"
NO_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
BAD_KEY = "Incorrect API key provided."
INVALID_API_KEY = "invalid_api_key"  # the code of both refusals (wire.errors.CODES)
# How long a key read from the database is trusted; at most inference.limits.FRESH_KEY_S,
# so that admission takes the tenant limits loaded with the key.
KEY_CACHE_S = 1.0
MAX_CACHED_KEYS = 10_000


def bearer_token(header: str) -> str | None:
    """The key in ``Authorization: Bearer <key>``; None when the header is absent or other."""
    keyword, _, token = header.strip().partition(" ")
    if keyword.lower() != KEYWORD.lower() or not token.strip():
        return None
    return token.strip()


class KeyCache:
    """Usable keys by prefix, as read from the database at ``ApiKey.loaded_at``."""

    def __init__(self) -> None:
        self._keys: dict[str, ApiKey] = {}

    def get(self, raw: str) -> ApiKey | None | bool:
        """The cached key for ``raw``; None when it is not a usable key; False when the
        database must say (not cached, or cached over KEY_CACHE_S ago)."""
        parts = split_key(raw.strip())
        if parts is None:
            return None
        prefix, secret = parts
        api_key = self._keys.get(prefix)
        if api_key is None or time.monotonic() - (api_key.loaded_at or 0) > KEY_CACHE_S:
            return False
        return api_key if api_key.matches(secret) else None

    def put(self, api_key: ApiKey) -> None:
        if len(self._keys) >= MAX_CACHED_KEYS:
            self._keys.clear()
        self._keys[api_key.prefix] = api_key

    def forget(self, prefix: str | None = None, tenant_id: int | None = None) -> None:
        """Drop one key, a tenant's keys, or (no argument) every key."""
        if prefix is None and tenant_id is None:
            self._keys.clear()
        for key in list(self._keys.values()):
            if key.prefix == prefix or key.tenant_id == tenant_id:
                self._keys.pop(key.prefix, None)


keys = KeyCache()


def lookup(raw: str) -> ApiKey | None:
    """The usable key for a plaintext key; from sync code (DRF's request thread)."""
    found = keys.get(raw)
    if found is False:
        found = db.call(authenticate_key, raw)
        if found is not None:
            keys.put(found)
    return found


async def key_for(raw: str) -> ApiKey | None:
    """``lookup`` for async code (the websocket)."""
    found = keys.get(raw)
    if found is False:
        found = await db.run(authenticate_key, raw)
        if found is not None:
            keys.put(found)
    return found


@receiver(post_save, sender=ApiKey)
@receiver(post_delete, sender=ApiKey)
def _forget_key(sender: type, instance: ApiKey, **kwargs: Any) -> None:
    keys.forget(prefix=instance.prefix)


@receiver(post_save, sender=Tenant)
@receiver(post_delete, sender=Tenant)
def _forget_tenant(sender: type, instance: Tenant, **kwargs: Any) -> None:
    keys.forget(tenant_id=instance.pk)


class ApiKeyAuthentication(BaseAuthentication):
    """DRF authentication by API key: ``request.auth`` is the ``ApiKey``, ``request.user``
    an ``ApiKeyUser``. No header: None (the permission check answers 401 ``NO_KEY``); any
    other header that is not a usable key: 401 ``BAD_KEY``. DRF calls ``authenticate`` on
    the request's thread (adrf's async views too), which waits for the database thread
    when the key is not cached."""

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, ApiKey] | None:
        header = request.headers.get("Authorization", "")
        if not header:
            return None
        token = bearer_token(header)
        api_key = lookup(token) if token else None
        if api_key is None:
            raise exceptions.AuthenticationFailed(BAD_KEY, INVALID_API_KEY)
        return ApiKeyUser(api_key), api_key

    def authenticate_header(self, request: Request) -> str:
        return KEYWORD


class ApiKeyAuthMiddleware(BaseMiddleware):
    """Websocket scopes: ``scope["api_key"]`` is the key from an Authorization header
    (None without one: the client may send ``{"type": "auth"}`` first);
    ``scope["auth_error"]`` is set when a header was sent but did not authenticate."""

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> Any:
        scope = dict(scope, api_key=None, auth_error=None)
        headers = dict(scope.get("headers") or [])
        raw = headers.get(b"authorization", b"").decode("latin1")
        if raw:
            token = bearer_token(raw)
            scope["api_key"] = await key_for(token) if token else None
            if scope["api_key"] is None:
                scope["auth_error"] = BAD_KEY
        return await super().__call__(scope, receive, send)
