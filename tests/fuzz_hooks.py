"""schemathesis hooks for tests/test_fuzz_live.py: the CLI loads this module through
``SCHEMATHESIS_HOOKS=tests.fuzz_hooks`` (it is not a test module and imports no Django).

Set by the test through the environment:

- ``FUZZ_MODEL``: the live daemon's model. A completion body's ``model`` (absent, or a
  printable string) becomes it, so generated requests reach the daemon and the model
  instead of stopping at ``model_not_found`` or, for a missing or null model (the web's
  default model, the first of ``MODELS``, which no daemon here serves), at 503
  ``scheduler_unavailable``.
  An empty or non-printable model (NUL, a surrogate) is left as generated: the web must
  refuse it. ``GET /v1/models/{model}`` asks for it every other time.
- A tokenize/detokenize/embeddings body's ``model`` becomes it the same way: its content
  and token ids (out of the vocabulary, huge, negative) meet the live daemon.
- Every other completion body loses its ``grammar``, ``json_schema``, ``response_format``
  and ``logit_bias`` (random ones are refused; the other half still sends them).
- The Responses and Anthropic Messages bodies (``/v1/responses``, ``/v1/messages``,
  ``/v1/messages/count_tokens``) are completion bodies here: their ``model`` the same way.
- ``FUZZ_MAX_TOKENS``: ``max_tokens`` / ``max_completion_tokens`` / ``max_output_tokens``
  above it, up to the context, become it (bounded generation on two cores); larger values
  are left alone (the refusal path: ``context_length_exceeded``).
- A valid ``timeout`` under ``MIN_TIMEOUT_S`` becomes it (a short one is a 504 by design);
  invalid ones (0, negative, not a number) are left: the web must refuse them.
- ``FUZZ_LOG``: a file that gets one JSON line per call (operation, status, error code), for
  the test's summary.

``/v1/requests/{id}...`` operations: a generated id that parses as a UUID is replaced, every
other time, by the id of a request this run made (from ``X-Request-Id``), so cancels,
replays and hostile ``Last-Event-ID`` values also meet real rows and real event streams.

The check ``openai_error_shape``: every 4xx body is OpenAI's error object.
"""
from __future__ import annotations

import json
import os
import uuid
from typing import Any

import schemathesis

MODEL = os.environ.get("FUZZ_MODEL", "")
MAX_TOKENS = int(os.environ.get("FUZZ_MAX_TOKENS", "8"))
N_CTX = int(os.environ.get("N_CTX", "2048"))
LOG = os.environ.get("FUZZ_LOG")
COMPLETIONS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
               "/v1/messages/count_tokens")
VOCABULARY = ("/v1/tokenize", "/v1/detokenize", "/v1/embeddings")
MIN_TIMEOUT_S = 120
CONSTRAINTS = ("grammar", "json_schema", "response_format", "logit_bias")
_seen_ids: list[str] = []
_swaps: dict[str, int] = {}  # per operation: swap every other generated value


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: dict[str, Any]) -> None:
    path = case.operation.path
    body = case.body
    if path in COMPLETIONS and isinstance(body, dict) and MODEL:
        model = body.get("model")
        if model is None or (isinstance(model, str) and model and model.isprintable()
                             and _is_text(model)):
            body["model"] = MODEL
        if _turn("constraints"):  # every other call: no free-form constraint fields, whose
            for name in CONSTRAINTS:  # random values are nearly always refused, so that some
                body.pop(name, None)  # generated requests reach the model
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = body.get(name)
            if type(value) is int and MAX_TOKENS < value <= N_CTX:
                body[name] = MAX_TOKENS
        value = body.get("timeout")
        if type(value) in (int, float) and 0 < value < MIN_TIMEOUT_S:
            # a valid timeout this short ends in 504 ``timeout`` on a busy machine: the
            # answer the client asked for, not a server fault (docs/api.md, Deadlines)
            body["timeout"] = MIN_TIMEOUT_S
    if path in VOCABULARY and isinstance(body, dict) and MODEL:
        model = body.get("model")  # hostile content and token ids reach the daemon
        if model is None or (isinstance(model, str) and model.isprintable() and _is_text(model)):
            body["model"] = MODEL
    params = case.path_parameters
    if path == "/v1/models/{model}" and isinstance(params, dict) and MODEL and _turn(path):
        params["model"] = MODEL
    if path.startswith("/v1/requests/{id}") and isinstance(params, dict) and _seen_ids:
        generated = params.get("id")
        if isinstance(generated, str) and _is_uuid(generated) and _turn(path):
            params["id"] = _seen_ids[_swaps[path] % len(_seen_ids)]


@schemathesis.hook
def after_call(context: Any, case: Any, response: Any) -> None:
    request_id = (response.headers.get("x-request-id") or [None])[0]  # lowercase, lists
    if request_id and _is_uuid(request_id) and request_id not in _seen_ids:
        _seen_ids.append(request_id)
        del _seen_ids[:-20]
    if LOG:
        code = None
        if response.status_code >= 400:
            try:
                code = json.loads(response.content).get("error", {}).get("code")
            except Exception:
                code = "<not json>"
        with open(LOG, "a") as log:
            log.write(json.dumps({"op": f"{case.method.upper()} {case.operation.path}",
                                  "status": response.status_code, "code": code}) + "\n")


@schemathesis.check
def openai_error_shape(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 4xx answers ``{"error": {"message": str, "type": str, "param", "code"}}`` in JSON."""
    if not 400 <= response.status_code < 500:
        return None
    if case.method.upper() == "HEAD":
        return None  # no body by definition
    if (response.status_code == 400 and not response.content
            and str(response.request.headers.get("Content-Type", "")).startswith(
                "multipart/form-data")):
        # Twisted (under daphne) parses multipart bodies itself and answers one it cannot
        # parse with a bare 400 before the request reaches the application: nothing in the
        # project shapes that answer (reported in issue 12's fuzz run).
        return None
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(
            f"{response.status_code} answer is not JSON: {response.content[:300]!r}") from None
    error = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(error, dict) and isinstance(error.get("message"), str)
            and isinstance(error.get("type"), str) and "param" in error and "code" in error):
        raise AssertionError(
            f"{response.status_code} answer is not OpenAI's error shape: {body!r:.300}")
    return True


def _turn(path: str) -> bool:
    _swaps[path] = _swaps.get(path, 0) + 1
    return _swaps[path] % 2 == 1


def _is_uuid(value: str) -> bool:
    try:
        uuid.UUID(value)
    except ValueError:
        return False
    return True


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
