"""Sessions that continue: a conversation the service holds, so that a client sends only its
new turn (``"continue": true``).

A session is a Redis hash ``llm:session:<id>``: its tenant, model, the conversation's tokens
(int32, little-endian: never text), how many tokens and turns, and the request of the turn
that runs (``busy``, until ``busy_until``: its deadline and a margin). Every tenant's
sessions are in ``llm:sessions:<tenant>`` (id -> expiry) for the cap. Ids are 32 random
bytes (url-safe base64): not guessable. A session lives ``SESSION_TTL_S`` after its last
turn.

- the web, inside a request's admission: ``begin.lua`` makes a session (``new``) or marks an
  existing one busy (``continue``; ``reset``: a full history replaces it); its rollback and
  a request that never reached a daemon end the turn without tokens;
- the daemon: reads the tokens when it starts a continued turn, and at the turn's last
  event ends it (``end.lua``), with the conversation's tokens when the turn finished
  (``stop`` or ``length``), without when it failed or was cancelled (the session stays as
  it was before the turn);
- ``DELETE /v1/sessions/<id>``: ``delete.lua``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import struct
from typing import Any

from .scripts import lua

PREFIX = "llm:session"
ID_PREFIX = "sess_"
ID_MAX_LEN = 64
_ID = re.compile(rf"{ID_PREFIX}[A-Za-z0-9_-]{{1,{ID_MAX_LEN - len(ID_PREFIX)}}}")
BUSY_MARGIN_S = 60.0  # a turn's busy mark outlives its deadline by this much
DEFAULT_TTL_S = 3600  # SESSION_TTL_S's default

BEGIN = lua("session_begin")
END = lua("session_end")
DELETE = lua("session_delete")

# begin's refusals (wire.errors codes)
NO_SESSION = "no_session"
SESSION_BUSY = "session_busy"
TOO_MANY_SESSIONS = "too_many_sessions"
MODEL_MISMATCH = "session_model_mismatch"


def new_id() -> str:
    return ID_PREFIX + secrets.token_urlsafe(32)


def id_for_request(secret: str, tenant_id: str, request_id: str) -> str:
    """A new session's id fixed by its request (an Idempotency-Key's retries name the same
    session): a keyed hash, as unguessable as ``new_id`` without the secret."""
    digest = hmac.new(secret.encode(), f"session\x00{tenant_id}\x00{request_id}".encode(),
                      hashlib.sha256).digest()
    return ID_PREFIX + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def is_id(value: Any) -> bool:
    """The shape of an id this service gives (anything else is no session of anyone's)."""
    return isinstance(value, str) and _ID.fullmatch(value) is not None


def key(session_id: str) -> str:
    return f"{PREFIX}:{session_id}"


def tenant_key(tenant_id: str) -> str:
    return f"{PREFIX}s:{tenant_id}"


def pack(tokens: list[int] | tuple[int, ...]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def unpack(data: bytes | None) -> list[int]:
    if not data or len(data) % 4:
        return []
    return list(struct.unpack(f"<{len(data) // 4}i", data))


def end_args(session_id: str, tenant_id: str, request_id: str, tokens: bytes, ttl_s: int,
             now: float) -> tuple[list[str], list[Any]]:
    """(keys, args) of END."""
    return [key(session_id), tenant_key(tenant_id)], [request_id, tokens, ttl_s, now,
                                                       session_id]
