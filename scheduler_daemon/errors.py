"""Refusals and failures the scheduler reports, with the codes clients see.

The codes match the error table in docs (and ../shared/DESIGN.md): the web layer maps
them to HTTP statuses; the scheduler only names them.
"""

from __future__ import annotations

from typing import Any


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


# Codes used across the scheduler (one place, so the web side can import them too).
QUEUE_FULL = "queue_full"
TENANT_QUEUE_FULL = "tenant_queue_full"
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
EMPTY_PROMPT = "empty_prompt"
CONTEXT_FULL = "context_full"
SHUTTING_DOWN = "shutting_down"
DUPLICATE_ID = "duplicate_request_id"
ENGINE_ERROR = "engine_error"
