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

WEB = "web"  # the owner name of a request the web has ended
OWNER_TTL_S = 24 * 3600  # an owner outlives any request (REQUEST_TIMEOUT_S caps them)

# KEYS[1] owner key. ARGV[1] the new owner, ARGV[2] TTL, ARGV[3..] the owners it may take
# over from ("" stands for no owner yet). 1 when taken.
TAKE = """
local current = redis.call('GET', KEYS[1]) or ''
for i = 3, #ARGV do
  if current == ARGV[i] then
    redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
    return 1
  end
end
return 0
"""

# KEYS[1] owner key, KEYS[2] events stream. ARGV[1] the owner given up on ("" for none),
# ARGV[2] TTL, ARGV[3] the error event's data, ARGV[4] the stream's retention. 1 when this
# call ended the request. No owner at all passes too (a daemon that predates owners), unless
# the stream has ended (an owner is deleted with its request's end).
GIVE_UP = """
local current = redis.call('GET', KEYS[1]) or ''
if current ~= ARGV[1] and current ~= '' then return 0 end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1]
if last then
  local fields = last[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'type' and (fields[i + 1] == 'done' or fields[i + 1] == 'error') then
      return 0
    end
  end
end
redis.call('SET', KEYS[1], 'web', 'EX', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'type', 'error', 'data', ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""


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
