"""The API's authentication: one DRF class for every view, the same lookup for websockets.

``ApiKeyAuthentication`` (REST_FRAMEWORK's default: every /v1/ view, sync or async) reads
``Authorization: Bearer sk-...``; ``key_for`` is the same lookup for async code (the
websocket's middleware and its ``auth`` message). Both look the key up with
``accounts.authentication.authenticate_key`` on the web's database thread
(``inference.db``): revoked keys and inactive tenants fail at once, nothing is cached.
"""
from __future__ import annotations

from typing import Any

from channels.middleware import BaseMiddleware
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication
from rest_framework.request import Request

from accounts.authentication import ApiKeyUser, authenticate_key
from accounts.models import ApiKey
from inference import db

KEYWORD = "Bearer"
NO_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
BAD_KEY = "Incorrect API key provided."
INVALID_API_KEY = "invalid_api_key"  # the code of both refusals (wire.errors.CODES)


def bearer_token(header: str) -> str | None:
    """The key in ``Authorization: Bearer <key>``; None when the header is absent or other."""
    keyword, _, token = header.strip().partition(" ")
    if keyword.lower() != KEYWORD.lower() or not token.strip():
        return None
    return token.strip()


async def key_for(raw: str) -> ApiKey | None:
    """The usable key for a plaintext key (``authenticate_key`` on the database thread)."""
    return await db.run(authenticate_key, raw)


class ApiKeyAuthentication(BaseAuthentication):
    """DRF authentication by API key: ``request.auth`` is the ``ApiKey``, ``request.user``
    an ``ApiKeyUser``. No header: None (the permission check answers 401 ``NO_KEY``); any
    other header that is not a usable key: 401 ``BAD_KEY``. DRF calls ``authenticate`` on
    the request's thread (adrf's async views too), which waits for the database thread."""

    def authenticate(self, request: Request) -> tuple[ApiKeyUser, ApiKey] | None:
        header = request.headers.get("Authorization", "")
        if not header:
            return None
        token = bearer_token(header)
        api_key = db.call(authenticate_key, token) if token else None
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
