"""API keys for the async views and the websocket (the DRF views use ApiKeyAuthentication)."""
from __future__ import annotations

from typing import Any

from channels.middleware import BaseMiddleware
from django.http import HttpRequest

from accounts.authentication import authenticate_key
from accounts.models import ApiKey
from inference import db
from inference.api_errors import ApiError

NO_KEY = "You didn't provide an API key. Send it as 'Authorization: Bearer sk-...'."
BAD_KEY = "Incorrect API key provided."
KEYWORD = "bearer"


def bearer_token(header: str) -> str | None:
    """The key in ``Authorization: Bearer <key>``; None when the header is absent or other."""
    keyword, _, token = header.strip().partition(" ")
    if keyword.lower() != KEYWORD or not token.strip():
        return None
    return token.strip()


async def key_for(raw: str) -> ApiKey | None:
    """``authenticate_key`` on the database thread."""
    return await db.run(authenticate_key, raw)


async def authenticate_request(request: HttpRequest) -> ApiKey:
    """The request's usable key, else ApiError 401 invalid_api_key."""
    header = request.headers.get("Authorization", "")
    if not header:
        raise ApiError(401, NO_KEY, "invalid_api_key")
    token = bearer_token(header)
    api_key = await key_for(token) if token else None
    if api_key is None:
        raise ApiError(401, BAD_KEY, "invalid_api_key")
    return api_key


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
