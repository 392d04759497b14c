"""Who may write a started request's end: its owner (``protocol.owner_key``).

A request has one end, written once, whatever dies. The daemon that starts a job takes its
ownership; when that daemon dies, the daemon that continues the job takes it over from the
dead one; when no daemon comes back within RECOVERY_TIMEOUT_S, the web takes it over
("web") and writes ``inference_interrupted``. Each move is a compare-and-set in one Lua
script, so a daemon continuing a job and a web giving up on it cannot both win.
"""

from __future__ import annotations

import json
from typing import Any

from . import protocol
from .scripts import lua

WEB = "web"  # the owner name of a request the web has ended
OWNER_TTL_S = 24 * 3600  # an owner outlives any request (REQUEST_TIMEOUT_S caps them)

TAKE = lua("take_owner")  # a compare-and-set of the owner (wire/lua/take_owner.lua)
GIVE_UP = lua("give_up")  # the web's end of an orphaned request (wire/lua/give_up.lua)


def take_args(request_id: str, new_owner: str, *from_owners: str) -> tuple[list[str], list[Any]]:
    """(keys, args) of TAKE: ``new_owner`` takes the request if its owner is one of
    ``from_owners``."""
    return [protocol.owner_key(request_id)], [new_owner, OWNER_TTL_S, *from_owners]


def give_up_args(request_id: str, owner: str, message: str,
                 retention_s: int = protocol.STREAM_RETENTION_S) -> tuple[list[str], list[Any]]:
    """(keys, args) of GIVE_UP: end the request with ``inference_interrupted`` if ``owner``
    (dead) still owns it."""
    data = {"code": protocol.INFERENCE_INTERRUPTED, "message": message, "finish_reason": "error"}
    return (
        [protocol.owner_key(request_id), protocol.events_stream(request_id)],
        [owner, OWNER_TTL_S, json.dumps(data, separators=(",", ":")), retention_s],
    )
