"""The Redis wire between the web processes and the scheduler daemons.

Every key name and message shape lives here; both sides import this module and no other
module spells a key. Nothing here imports llama_cpp or Django.

Jobs      ``llm:jobs:<model>``       Stream, consumer group ``daemons``; field ``job`` = JSON
                                     (``Job``). One daemon gets each job; it XACKs and XDELs
                                     the entry with the job's terminal event (no prompt text
                                     stays in Redis after a request ends).
Events    ``llm:events:<request>``   Stream per request; fields ``type`` and ``data`` (JSON).
                                     Types: accepted, token, done, error. Entry ids are the
                                     SSE event ids (resume with XREAD after the last one seen).
                                     Expires ``Job.retention()`` (STREAM_RETENTION_S) after
                                     its last event.
Cancel    ``llm:cancelled:<request>`` flag with a TTL (durable: checked before a job starts)
          ``llm:cancel``             pub/sub channel of request ids (fast: aborts in-flight work)
Daemons   ``llm:daemons``            sorted set: daemon id -> last heartbeat (unix seconds)
          ``llm:daemon:<id>``        the daemon's snapshot JSON, expiring HEARTBEAT_TTL_S after
                                     its last heartbeat: a missing key means a dead daemon
Control   ``llm:control:<id>``       Stream of operator commands for one daemon (admin actions)
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import (  # noqa: F401  (re-exported: codes the wire names)
    INFERENCE_INTERRUPTED,
    REQUEST_QUARANTINED,
    SCHEDULER_UNAVAILABLE,
)
from .scripts import lua

PREFIX = "llm"
JOBS_GROUP = "daemons"
CANCEL_CHANNEL = f"{PREFIX}:cancel"
DAEMONS_ZSET = f"{PREFIX}:daemons"

HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TTL_S = 3.0  # a daemon silent this long is dead
# A request's events stream expires this long after its last event (setting
# STREAM_RETENTION_S; a client may resume until then). Requests sent with an
# Idempotency-Key keep theirs IDEMPOTENCY_TTL_S (the retry replays them): ``Job.retention_s``.
STREAM_RETENTION_S = 600
IDEMPOTENCY_TTL_S = 24 * 3600
CANCEL_TTL_S = 3600
# The jobs stream is never trimmed: the daemons delete each entry when its request ends
# (XACK + XDEL), so it holds only jobs not yet ended. The web refuses an enqueue (503)
# when it holds this many (a backlog no daemon is reading).
JOBS_MAX_PENDING = 10_000
# A job whose daemon died is continued by another (recovery.py); the web waits this long
# for one to take it over before it ends the request with inference_interrupted (setting).
RECOVERY_TIMEOUT_S = 60.0
# A request whose reader went away (dropped connection) runs on this long for a client to
# resume it (setting RESUME_GRACE_S); past it, the daemon cancels it.
RESUME_GRACE_S = 10.0

# Event types
ACCEPTED = "accepted"
TOKEN = "token"
DONE = "done"
ERROR = "error"
TERMINAL = frozenset({DONE, ERROR})

# Job kinds. The vocabulary ones are answered by the daemon's preparer without a slot: one
# ``done`` event whose data holds the answer (``tokens`` / ``content``).
COMPLETION_KIND, CHAT_KIND = "completion", "chat"
TOKENIZE_KIND, DETOKENIZE_KIND = "tokenize", "detokenize"
VOCAB_KINDS = frozenset({TOKENIZE_KIND, DETOKENIZE_KIND})
# The most token ids one detokenize job may carry (the web and the daemon both check).
MAX_DETOKENIZE_TOKENS = 65_536
MAX_CHOICES = 8  # n of one request
EMBEDDING_KIND = "embedding"
MAX_EMBEDDING_INPUTS = 256  # inputs of one embeddings request
EMBEDDING_N_CTX = 2048  # the embeddings context's tokens: the most one input may have
MAX_EMBEDDING_TOKENS = 32_768  # tokens of one embeddings request, all inputs together
ANSWER_RETENTION_S = 60  # events of a request with one answer (tokenize, embeddings)

# Error codes live in wire/errors.py (each with its HTTP status and OpenAI type).


def jobs_stream(model: str) -> str:
    return f"{PREFIX}:jobs:{model}"


def events_stream(request_id: str) -> str:
    return f"{PREFIX}:events:{request_id}"


def entry_order(entry_id: str | None) -> tuple[int, int]:
    """A stream entry id ("1712345678901-0") as a sortable pair; None counts as "0-0"."""
    ms, _, seq = (entry_id or "0-0").partition("-")
    return int(ms), int(seq or 0)


def as_text(value: Any) -> str:
    """A Redis reply value (bytes or not) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def reader_wake_stream(reader_id: str) -> str:
    """A web process's stream reader's wake stream: an entry ends its blocked XREAD (a new
    follower's stream joins the next one). One entry at most; expires with its process."""
    return f"{PREFIX}:wake:{reader_id}"


def owner_key(request_id: str) -> str:
    """Which daemon owns a started request: set by the daemon that starts it, handed to the
    one that continues it after a death, taken by the web ("web") when it gives up on it.
    Only the owner may write the request's end (each move is a compare-and-set)."""
    return f"{PREFIX}:owner:{request_id}"


def watch_key(request_id: str) -> str:
    """Kept alive by the web while some reader follows the request (``Job.watched``): when it
    expires (RESUME_GRACE_S after the last reader left), the daemon cancels the request."""
    return f"{PREFIX}:watch:{request_id}"


def idempotency_key(tenant_id: str, key_digest: str) -> str:
    """A tenant's Idempotency-Key (its sha256): JSON {request_id, body}; IDEMPOTENCY_TTL_S."""
    return f"{PREFIX}:idem:{tenant_id}:{key_digest}"


def cancel_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def daemon_key(daemon_id: str) -> str:
    return f"{PREFIX}:daemon:{daemon_id}"


def control_stream(daemon_id: str) -> str:
    return f"{PREFIX}:control:{daemon_id}"


# Operator commands on a daemon's control stream (field ``command`` = JSON):
#   {"action": "drain"}                       stop taking jobs; in-flight ones finish
#   {"action": "resume"}                      take jobs again after a drain
#   {"action": "evict_scope", "scope": "42"}  drop one tenant's cached prefixes, every tier
#   {"action": "unload_adapter", "adapter": "ad_..."}  an adapter deleted: unloaded once no
#                                             running request uses it, never loaded again
# Cancelling a request needs no daemon command: publish it like any cancel.
CONTROL_ACTIONS = frozenset({"drain", "resume", "evict_scope", "unload_adapter"})


def encode_command(action: str, **args: Any) -> dict[str, str]:
    """Fields for an XADD to ``control_stream(daemon_id)``."""
    if action not in CONTROL_ACTIONS:
        raise ValueError(f"unknown control action {action!r}")
    return {"command": json.dumps({"action": action, **args}, separators=(",", ":"))}


def decode_command(fields: dict[Any, Any]) -> dict[str, Any]:
    raw = fields.get(b"command", fields.get("command"))
    return json.loads(raw)


# Containment of native crashes and hangs (what a daemon was running when it died, and
# poison jobs). A *death* is one run of one daemon ending uncleanly (a crash, a kill, the
# watchdog's kill of a hung loop); a run is one process under the daemon id (the supervisor
# restarts it under the same id), named by a run id the process draws at start.
# Running    ``llm:running:<daemon id>``  hash: request id -> ``running_entry``: the run id and
#                                         the job fingerprint, for every job the daemon has
#                                         started and not ended (written before any native
#                                         code sees the job)
# Deaths     ``llm:deaths:<fingerprint>`` set of the deaths (``death_id``) the job was running
#                                         at; copies of it at one death add one member
# Quarantine ``llm:quarantine``           hash: fingerprint -> JSON record; such jobs are
#                                         refused with request_quarantined (admin releases)
RUNNING_TTL_S = 24 * 3600  # refreshed by every heartbeat
DEATHS_TTL_S = 24 * 3600
QUARANTINE_HASH = f"{PREFIX}:quarantine"
QUARANTINE_AFTER_DEATHS = 2  # distinct deaths a fingerprint was running at before it is refused

COUNT_DEATH = lua("count_death")  # one death added to a fingerprint's set, once
FORGET_RUNNING = lua("forget_running")  # a dead run's records of recovered jobs deleted


GONE_TTL_S = 600


def gone_key(daemon_id: str) -> str:
    """Set by a daemon that stopped cleanly (SIGTERM): its pending jobs are free to take at
    once, without waiting for its consumer to look idle (which a Redis restart can fake)."""
    return f"{PREFIX}:gone:{daemon_id}"


def running_key(daemon_id: str) -> str:
    return f"{PREFIX}:running:{daemon_id}"


def deaths_key(fingerprint: str) -> str:
    return f"{PREFIX}:deaths:{fingerprint}"


def running_entry(run_id: str, fingerprint: str) -> str:
    """The running hash's value for a job started by run ``run_id``."""
    return f"{run_id}:{fingerprint}"


def parse_running_entry(entry: str) -> tuple[str, str]:
    """(run id, fingerprint) of a running hash's value ("" for a run that wrote none)."""
    run_id, _, fingerprint = entry.rpartition(":")
    return run_id, fingerprint


def hang_key(daemon_id: str, run_id: str) -> str:
    """The request a stuck run of a daemon was sampling for (its heartbeat writes it while the
    loop is stuck; recovery counts that run's death for this request alone)."""
    return f"{PREFIX}:hang:{daemon_id}/{run_id}"


def death_id(daemon_id: str, run_id: str) -> str:
    """One death: the run ``run_id`` of the daemon ``daemon_id`` ended uncleanly."""
    return f"{daemon_id}/{run_id}"


def count_death_args(fingerprint: str, death: str) -> tuple[list[str], list[Any]]:
    """(keys, args) of COUNT_DEATH."""
    return [deaths_key(fingerprint)], [death, DEATHS_TTL_S]


@dataclass(slots=True)
class Job:
    """A request as queued for a daemon. ``cache_scope`` is set by the web from the tenant."""

    id: str
    kind: str  # "completion" | "chat" | "tokenize" | "detokenize"
    model: str
    tenant_id: str
    cache_scope: str
    prompt: str | list[int] | None = None
    # a chat's messages; on a tokenize job instead of prompt: the chat's prompt counted
    # (answered {"input_tokens"}, Anthropic's count_tokens), its tools with it
    messages: list[dict[str, Any]] | None = None
    params: dict[str, Any] = field(default_factory=dict)  # SamplingParams fields, as sent
    session: str | None = None
    cache_prompt: bool | None = None
    max_queued: int | None = None  # the tenant's cap on waiting jobs (None: MAX_QUEUE_PER_TENANT)
    enqueued_at: float = field(default_factory=time.time)
    deadline: float | None = None  # unix seconds: the daemon ends it with ``timeout`` after
    watched: bool = False  # the web keeps ``watch_key`` alive while a reader follows it
    retention_s: int | None = None  # its events stream's retention (None: STREAM_RETENTION_S)
    echo: bool = False  # a completion's prompt text comes back first (its ``accepted`` event)
    n: int = 1  # choices: the prompt is prefilled once and sampled n ways (seed + index)
    prompts: list[Any] | None = None  # a completion's several prompts (then ``prompt`` is None)
    # Routing in a fleet (wire/affinity.py): the chain of its leading text's piece hashes and
    # its session's hash, both salted by the tenant; the daemon that starts it records them.
    affinity: list[str] | None = None
    session_hash: str | None = None
    # A session's turn (wire/sessions.py): its id, and whether ``prompt``/``messages`` are
    # only the new turn (the daemon reads the conversation's tokens from the session)
    session_id: str | None = None
    continue_session: bool = False
    # A tenant's LoRA adapter (its registered row, resolved by the web): {"id": "ad_...",
    # "path": absolute file path, "sha256": the file's hash, "scale": float}; None: the base
    adapter: dict[str, Any] | None = None
    # A chat's tools for a model whose template renders them (the daemon's snapshot says
    # ``chat_tools``): {"mode": "call" | "auto", "functions": [OpenAI function tools]};
    # None: no tools, or tools shown by the web's generic prompt in ``messages``
    tools: dict[str, Any] | None = None

    def encode(self) -> dict[str, str]:
        """Fields for XADD."""
        return {"job": json.dumps(asdict(self), separators=(",", ":"))}

    @classmethod
    def decode(cls, fields: dict[Any, Any]) -> Job:
        raw = fields.get(b"job", fields.get("job"))
        return cls(**json.loads(raw))

    def retention(self) -> int:
        """Seconds its events stream lives after its last event."""
        return int(self.retention_s or STREAM_RETENTION_S)


# Deleted adapters (the web's deletions): a sorted set of adapter ids by deletion time, read
# by a daemon as it starts (one that was down when ``unload_adapter`` went out never loads
# a deleted adapter for a job still queued); entries older than DELETED_ADAPTERS_TTL_S go.
DELETED_ADAPTERS = f"{PREFIX}:adapters:deleted"
DELETED_ADAPTERS_TTL_S = 30 * 24 * 3600


def adapter_tag(adapter: dict[str, Any] | None) -> str:
    """What a job's adapter adds to its prefix cache identity and its affinity salt: the file's
    hash and the scale ("" for the base model): a prefix computed under one adapter and scale
    is never reused under another, nor without it."""
    if not adapter:
        return ""
    return f"lora:{adapter['sha256']}@{float(adapter['scale'])!r}"


def encode_event(kind: str, data: dict[str, Any]) -> dict[str, str]:
    """Fields for an XADD to a request's events stream."""
    return {"type": kind, "data": json.dumps(data, separators=(",", ":"))}


def decode_event(fields: dict[Any, Any] | list[Any]) -> tuple[str, dict[str, Any]]:
    """(type, data) of an events-stream entry (bytes or str fields; a dict, or the flat
    ``[name, value, ...]`` list of a raw XREAD reply)."""
    if isinstance(fields, list):
        fields = dict(zip(fields[::2], fields[1::2], strict=True))
    kind = fields.get(b"type", fields.get("type"))
    data = fields.get(b"data", fields.get("data"))
    if isinstance(kind, bytes):
        kind = kind.decode()
    return kind, json.loads(data)


def usage(
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    created_tokens: int = 0,
    hit: str = "none",
    tier: str | None = None,
) -> dict[str, Any]:
    """OpenAI's ``usage`` object, with the prompt cache's account in its
    ``prompt_tokens_details``: ``cache_read_tokens`` (= ``cached_tokens``: prompt tokens read
    from the cache instead of computed), ``cache_created_tokens`` (prompt tokens computed
    and kept as a reusable prefix), ``cache_hit`` (exact | session | prefix | none) and
    ``cache_tier`` (slot | cross_slot | ram | disk; null without a hit)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "cache_read_tokens": cached_tokens,
            "cache_created_tokens": created_tokens,
            "cache_hit": hit,
            "cache_tier": tier,
        },
    }


# Event payloads, for reference (what each ``data`` holds):
#   accepted  {"daemon_id", "prompt_tokens", "model"}
#   token     {"text", "n_tokens"}                       (one per request per tick)
#   done      {"finish_reason", "stop", "usage", "timings"}
#   error     {"code", "message", "param"?, "status"?, "usage"?, ...details}
#     refusals before a job starts carry "status" (the HTTP status to answer with):
#     queue_full 503, context_length_exceeded 400, empty_prompt 400,
#     invalid_request_error 400, shutting_down 503; after acceptance: context_full,
#     engine_error, inference_interrupted (no status: the stream is already open).


# Tenant limits and usage (their keys, the admission script, the end-of-request accounting
# the daemon queues): wire/limits.py.
