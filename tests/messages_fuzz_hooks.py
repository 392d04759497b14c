"""schemathesis hooks for tests/test_messages_hostile.py (loaded by the CLI through
``SCHEMATHESIS_HOOKS=tests.messages_fuzz_hooks``; imports no Django).

- ``FUZZ_MODEL``: the live daemon's model. A ``/v1/messages`` body's ``model`` (absent, or a
  printable string) becomes it every other time, so generated requests reach the daemon and
  the model instead of stopping at ``model_not_found``.
- ``FUZZ_MAX_TOKENS``: ``max_tokens`` above it, up to the context, becomes it.
- The check ``anthropic_error_shape``: every 4xx body is Anthropic's error object
  ``{"type": "error", "error": {"type": str, "message": str}}``.
"""
from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

MODEL = os.environ.get("FUZZ_MODEL", "")
MAX_TOKENS = int(os.environ.get("FUZZ_MAX_TOKENS", "4"))
N_CTX = int(os.environ.get("N_CTX", "2048"))
_turns = [0]


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    body = case.body
    if not (case.operation.path.startswith("/v1/messages") and isinstance(body, dict)):
        return
    _turns[0] += 1
    model = body.get("model")
    if MODEL and _turns[0] % 2 and (model is None or (
            isinstance(model, str) and model.isprintable() and _is_text(model))):
        body["model"] = MODEL
    value = body.get("max_tokens")
    if type(value) is int and MAX_TOKENS < value <= N_CTX:
        body["max_tokens"] = MAX_TOKENS


@schemathesis.check
def anthropic_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 4xx answers Anthropic's error document in JSON."""
    if not 400 <= response.status_code < 500 or case.method.upper() == "HEAD":
        return None
    if (response.status_code == 400 and not response.content
            and str(response.request.headers.get("Content-Type", "")).startswith(
                "multipart/form-data")):
        return None  # Twisted's own bare 400 (see tests/fuzz_hooks.py)
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} answer is not JSON: {response.content[:300]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if not (body.get("type") == "error" and isinstance(error, dict)
            and isinstance(error.get("type"), str) and isinstance(error.get("message"), str)):
        raise AssertionError(
            f"{response.status_code} answer is not Anthropic's error shape: {body!r:.300}")
    return True


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
