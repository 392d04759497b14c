"""The web's probe for bench/ttft_phases.py (never imported by the service): daphne loads
``web_probe:application``, which is ``config.asgi.application`` with wall-clock marks at each
step of a streamed completion's path, written as one JSON line per request to
``$PROBE_FILE``. It wraps this project's own functions (the module attributes the service
calls through), nothing of Django's, DRF's or daphne's."""
from __future__ import annotations

import json
import os
import time
from typing import Any

from config.asgi import application as _app
from inference import api_views, broker, limits, service

_out = open(os.environ["PROBE_FILE"], "a", buffering=1)  # noqa: SIM115 (lives with the process)
_marks: dict[str, dict[str, float]] = {}  # request id -> mark -> unix time
_view: dict[str, float] = {}  # the view's entry, until the request id is known


def _mark(request_id: str, name: str) -> None:
    _marks.setdefault(request_id, {})[name] = time.time()


_admit_key = limits.admit_key


async def _probed_admit(api_key: Any, request_id: str, *args: Any, **kwargs: Any) -> None:
    _marks.setdefault(request_id, {}).update(_view)
    _view.clear()
    _mark(request_id, "admit_start")
    try:
        return await _admit_key(api_key, request_id, *args, **kwargs)
    finally:
        _mark(request_id, "admit_end")


_record = service._record


def _probed_record(api_key: Any, parsed: Any, request_id: str) -> Any:
    _mark(request_id, "row_start")
    try:
        return _record(api_key, parsed, request_id)
    finally:
        _mark(request_id, "row_end")


_enqueue = broker.enqueue


async def _probed_enqueue(job: Any, *args: Any, **kwargs: Any) -> None:
    _mark(job.id, "enqueue_start")
    try:
        return await _enqueue(job, *args, **kwargs)
    finally:
        _mark(job.id, "enqueue_end")


_answer = service.answer


async def _probed_answer(queued: Any) -> Any:
    try:
        return await _answer(queued)
    finally:
        _mark(queued.request_id, "accepted_read")


_events = service.events


async def _probed_events(submission: Any) -> Any:
    async for event in _events(submission):
        marks = _marks.get(submission.request_id)
        if event is not None and event.kind == "token" and marks is not None:
            marks.setdefault("token_read", time.time())
        yield event


_post = api_views.CompletionView.post


async def _probed_post(self: Any, request: Any) -> Any:
    _view["view"] = time.time()
    return await _post(self, request)


limits.admit_key = _probed_admit
service._record = _probed_record
broker.enqueue = _probed_enqueue
service.answer = _probed_answer
service.events = _probed_events
api_views.CompletionView.post = _probed_post


async def application(scope: dict[str, Any], receive: Any, send: Any) -> Any:
    if scope["type"] != "http" or not scope["path"].endswith("/completions"):
        return await _app(scope, receive, send)
    seen: dict[str, Any] = {"app": time.time()}

    async def probed_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            for name, value in message.get("headers", []):
                if name.lower() == b"x-request-id":
                    seen["id"] = value.decode()
        body = message.get("body", b"") if message["type"] == "http.response.body" else b""
        first_text = b'"text"' in body and b'"text":""' not in body and "send" not in seen
        if first_text:
            seen["send"] = time.time()
        await send(message)
        if first_text and "id" in seen:
            marks = _marks.pop(seen["id"], {})
            marks.update(app=seen["app"], first_send=seen["send"], first_sent=time.time(),
                         id=seen["id"])
            _out.write(json.dumps(marks) + "\n")

    return await _app(scope, receive, probed_send)
