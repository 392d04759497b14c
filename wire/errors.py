"""Every error code a client can see, in one table, with its HTTP status and OpenAI type.

Both sides name codes from here: the daemon raises ``Refusal`` (before a job starts) or
writes an ``error`` event (after acceptance); the web answers with ``CODES[code]``'s status
and type in OpenAI's shape ({"error": {"message", "type", "param", "code"}}). docs/api.md's
error table names only codes of this table, with their statuses (``tests/test_errors.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

INVALID_REQUEST = "invalid_request_error"
RATE_LIMIT = "rate_limit_error"
SERVER_ERROR = "server_error"


@dataclass(frozen=True, slots=True)
class ErrorCode:
    """A code clients match on: the HTTP status it is answered with, and OpenAI's type."""

    code: str
    status: int
    type: str
    summary: str


def _codes(*entries: tuple[str, int, str]) -> dict[str, ErrorCode]:
    out = {}
    for code, status, summary in entries:
        kind = RATE_LIMIT if status == 429 else SERVER_ERROR if status >= 500 else INVALID_REQUEST
        out[code] = ErrorCode(code, status, kind, summary)
    return out


CODES: dict[str, ErrorCode] = _codes(
    # the request itself
    ("invalid_request_error", 400, "a field has a wrong type or value; param names it"),
    ("parse_error", 400, "the body is not JSON"),
    ("missing_required_parameter", 400, "a required field is missing"),
    ("unknown_parameter", 400, "a field the API does not know"),
    ("unsupported_parameter", 400, "a known field with a value not supported here"),
    ("invalid_message", 400, "a websocket message of the wrong shape"),
    ("request_too_large", 400, "the body is larger than the web accepts"),
    ("request_timeout", 408, "the request's head or body stopped arriving (the door, nginx)"),
    ("empty_prompt", 400, "the prompt has no tokens"),
    ("context_length_exceeded", 400, "prompt + max_tokens exceed the context (n_ctx; priced: "
     "estimated_bytes, limit_bytes), or the prompt text its byte cap"),
    ("device_memory_budget_exceeded", 400, "prompt + max_tokens fit the context but need more "
     "KV memory than one request may reserve (the KV budget, a tenant's share); priced "
     "(estimated_bytes, limit_bytes)"),
    ("request_quarantined", 400, "it stopped the daemon twice (an operator may release it)"),
    ("session_model_mismatch", 400, "the session holds a conversation with another model"),
    ("invalid_api_key", 401, "no key, or not a usable one"),
    ("permission_denied", 403, "the key may not do this"),
    ("model_not_allowed", 403, "the model is not on the key's allow-list"),
    ("key_read_only", 403, "a read-only key: history and usage, no inference"),
    ("not_found", 404, "no such resource (or another tenant's)"),
    ("model_not_found", 404, "no such model, or an adapter the key's tenant does not have"),
    ("events_expired", 404, "the request's event stream has expired"),
    ("no_session", 404, "no such session of the tenant (unknown, expired, deleted, or "
     "another tenant's): send the full history"),
    ("method_not_allowed", 405, "wrong HTTP method"),
    ("duplicate_request_id", 409, "a request with this id is already running"),
    ("idempotency_key_reused", 409, "an Idempotency-Key sent again with a different body"),
    ("request_cancelled", 409, "cancelled before it had its answer (embeddings, tokenize)"),
    ("session_busy", 409, "the session's previous turn is still running"),
    # limits
    ("rate_limited", 429, "too many requests"),
    ("requests_per_second_exceeded", 429, "requests a second from one key (the anonymous API: "
     "one address) over the door's rate (nginx)"),
    ("too_many_connections", 429, "too many requests in progress from one client address"),
    ("auth_throttled", 429, "too many failed key checks from one client address"),
    ("rpm_exceeded", 429, "requests per minute over the tenant's limit"),
    ("tpm_exceeded", 429, "tokens per minute over the tenant's limit"),
    ("concurrency_limited", 429, "too many requests in flight for the tenant"),
    ("budget_exceeded", 429, "the tenant's monthly token budget is spent"),
    ("tenant_queue_full", 429, "the tenant has too many requests queued in the daemon"),
    ("too_many_streams", 429, "the tenant's share of a web process's streams (or one "
     "request's readers) is in use"),
    ("replays_exceeded", 429, "replays of finished streams per minute over the tenant's rate"),
    ("too_many_sessions", 429, "the tenant holds SESSIONS_PER_TENANT sessions already"),
    # the service
    ("internal_error", 500, "a bug; the request alone failed"),
    ("engine_error", 500, "llama.cpp failed on this request"),
    ("adapter_unusable", 500, "the request's adapter file no longer passes the daemon's check "
     "(changed or damaged since it was registered)"),
    ("queue_full", 503, "the daemon's queue is full"),
    ("shutting_down", 503, "the daemon is draining"),
    ("scheduler_unavailable", 503, "no live daemon serves the model"),
    ("service_unavailable", 503, "the web process is at capacity (Redis pool, streams)"),
    ("inference_interrupted", 503, "the daemon died while the request ran"),
    ("adapters_busy", 503, "MAX_LOADED_ADAPTERS adapters are loaded and in use: none can "
     "make room for this request's adapter now"),
    ("context_full", 503, "the KV cache filled while the request ran"),
    ("timeout", 504, "the request ran past its time limit"),
)

# Codes the daemon names (constants for code that spells them).
INVALID_REQUEST_ERROR = "invalid_request_error"
QUEUE_FULL = "queue_full"
TENANT_QUEUE_FULL = "tenant_queue_full"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
DEVICE_MEMORY_BUDGET_EXCEEDED = "device_memory_budget_exceeded"
EMPTY_PROMPT = "empty_prompt"
CONTEXT_FULL = "context_full"
SHUTTING_DOWN = "shutting_down"
DUPLICATE_ID = "duplicate_request_id"
ENGINE_ERROR = "engine_error"
INTERNAL_ERROR = "internal_error"
INFERENCE_INTERRUPTED = "inference_interrupted"
SCHEDULER_UNAVAILABLE = "scheduler_unavailable"
MODEL_NOT_FOUND = "model_not_found"
REQUEST_QUARANTINED = "request_quarantined"
TIMEOUT = "timeout"
CANCELLED = "request_cancelled"
SERVICE_UNAVAILABLE = "service_unavailable"
AUTH_THROTTLED = "auth_throttled"
KEY_READ_ONLY = "key_read_only"
MODEL_NOT_ALLOWED = "model_not_allowed"
TOO_MANY_STREAMS = "too_many_streams"
REPLAYS_EXCEEDED = "replays_exceeded"
NO_SESSION = "no_session"
SESSION_BUSY = "session_busy"
TOO_MANY_SESSIONS = "too_many_sessions"
SESSION_MODEL_MISMATCH = "session_model_mismatch"
ADAPTER_UNUSABLE = "adapter_unusable"
ADAPTERS_BUSY = "adapters_busy"


def status_of(code: str | None) -> int:
    """The HTTP status a code is answered with (500 for a code not in the table)."""
    entry = CODES.get(code or "")
    return entry.status if entry else 500


def type_of(status: int) -> str:
    """OpenAI's error type for an HTTP status."""
    if status == 429:
        return RATE_LIMIT
    return SERVER_ERROR if status >= 500 else INVALID_REQUEST


def error_body(message: str, type: str, code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    """The OpenAI error document."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class Refusal(Exception):
    """A request the scheduler will not take. Raised by ``submit`` before anything is queued."""

    def __init__(self, code: str, message: str, param: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.details = details

    def as_dict(self) -> dict[str, Any]:
        """The refusal as plain data (for logs and the wire)."""
        return {"code": self.code, "message": self.message, "param": self.param, **self.details}


class InvalidParameter(Refusal):
    """A request field with a wrong type or value; ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__("invalid_request_error", f"{param}: {message}", param=param)
