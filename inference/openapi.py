"""The OpenAPI schema's hand-written parts (drf-spectacular writes the DRF views' own).

- ``ERRORS``: the OpenAI error document every endpoint answers errors with.
- ``add_async_endpoints``: a postprocessing hook that describes the async completion views
  (plain Django views, which drf-spectacular does not see) and the shared error responses.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import OpenApiResponse, inline_serializer
from rest_framework import serializers

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {
                    "type": "string",
                    "enum": ["invalid_request_error", "rate_limit_error", "server_error"],
                },
                "param": {"type": "string", "nullable": True, "description": "the field at fault"},
                "code": {
                    "type": "string",
                    "nullable": True,
                    "description": (
                        "invalid_api_key, invalid_request_error, context_length_exceeded, "
                        "model_not_found, "
                        "rate_limited, concurrency_limited, budget_exceeded, queue_full, "
                        "scheduler_unavailable, not_found, ..."
                    ),
                },
            },
            "additionalProperties": True,
        }
    },
}

ErrorSerializer = inline_serializer(
    "Error",
    {
        "error": inline_serializer(
            "ErrorDetail",
            {
                "message": serializers.CharField(),
                "type": serializers.CharField(),
                "param": serializers.CharField(allow_null=True),
                "code": serializers.CharField(allow_null=True),
            },
        ),
    },
)

_DESCRIPTIONS = {
    400: "Bad parameter (``param`` names it).",
    401: "No, bad or revoked API key (``invalid_api_key``).",
    404: "Not found (another tenant's id looks exactly like an unknown one).",
    405: "Method not allowed.",
    409: "Conflict.",
    429: "Over a tenant limit: ``rate_limited``, ``concurrency_limited`` or ``budget_exceeded``; "
    "see ``Retry-After``.",
    503: "``queue_full`` or ``scheduler_unavailable`` (no daemon serves the model); "
    "see ``Retry-After``.",
    504: "The request took too long and was cancelled.",
}


def errors(*statuses: int) -> dict[int, OpenApiResponse]:
    """``extend_schema(responses=...)`` entries for these error statuses."""
    return {s: OpenApiResponse(ErrorSerializer, description=_DESCRIPTIONS[s]) for s in statuses}


_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
        "content": {
            "oneOf": [
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
    },
}
_SAMPLING = {
    "model": {"type": "string", "minLength": 1},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 1_000_000, "nullable": True},
    "max_completion_tokens": {"type": "integer", "minimum": 1, "nullable": True},
    "temperature": {"type": "number", "minimum": 0, "maximum": 5},
    "top_p": {"type": "number", "minimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": 0, "maximum": 1_000_000},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "repeat_penalty": {"type": "number", "minimum": 0.01, "maximum": 10},
    "seed": {"type": "integer", "minimum": 0, "maximum": 2**32 - 2, "nullable": True},
    "stop": {
        "oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}],
        "nullable": True,
    },
    "stream": {"type": "boolean"},
    "stream_options": {
        "type": "object",
        "nullable": True,
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "n": {"type": "integer", "enum": [1]},
    "response_format": {"type": "object", "nullable": True},
    "session": {
        "type": "string",
        "maxLength": 200,
        "nullable": True,
        "description": "keeps a conversation on one slot (prefix cache)",
    },
    "cache_prompt": {"type": "boolean", "nullable": True},
    "user": {"type": "string"},
}
_USAGE = {
    "type": "object",
    "properties": {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "prompt_tokens_details": {
            "type": "object",
            "properties": {"cached_tokens": {"type": "integer"}},
        },
    },
}
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": (
                "``data: {chunk}`` events with ids (resume with Last-Event-ID), "
                "ending with ``data: [DONE]``; "
                'a failure after the stream opened is an event ``{"error": {...}}``.'
            ),
        }
    }
}


def _completion_path(kind: str) -> dict[str, Any]:
    chat = kind == "chat"
    body = {
        "type": "object",
        "required": ["model", "messages" if chat else "prompt"],
        "properties": {
            **_SAMPLING,
            **(
                {"messages": {"type": "array", "minItems": 1, "items": _MESSAGE}}
                if chat
                else {
                    "prompt": {
                        "oneOf": [
                            {"type": "string", "minLength": 1},
                            {"type": "array", "minItems": 1, "items": {"type": "integer"}},
                        ]
                    }
                }
            ),
        },
        "additionalProperties": True,
    }
    choice = (
        {
            "message": {
                "type": "object",
                "properties": {"role": {"type": "string"}, "content": {"type": "string"}},
            }
        }
        if chat
        else {"text": {"type": "string"}}
    )
    reply = {
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string"},
            "created": {"type": "integer"},
            "model": {"type": "string", "minLength": 1},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        **choice,
                        "finish_reason": {"type": "string", "nullable": True},
                    },
                },
            },
            "usage": _USAGE,
        },
    }
    return {
        "post": {
            "operationId": "chat_completions_create" if chat else "completions_create",
            "summary": "Create a chat completion" if chat else "Create a completion",
            "description": "OpenAI-compatible. ``stream: true`` answers with server-sent events.",
            "tags": ["completions"],
            "security": [{"ApiKey": []}],
            "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
            "responses": {
                "200": {
                    "description": "The completion (JSON), or its events (SSE).",
                    "headers": {"X-Request-Id": {"schema": {"type": "string", "format": "uuid"}}},
                    "content": {"application/json": {"schema": reply}, **_SSE},
                },
                **_error_responses(400, 401, 405, 429, 503, 504),
            },
        }
    }


def _events_path() -> dict[str, Any]:
    return {
        "get": {
            "operationId": "requests_events",
            "summary": "A request's events as SSE, after Last-Event-ID (resume)",
            "tags": ["requests"],
            "security": [{"ApiKey": []}],
            "parameters": [
                {
                    "name": "id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "format": "uuid"},
                },
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "schema": {"type": "string", "pattern": r"^\d+-\d+$"},
                },
                {
                    "name": "last_event_id",
                    "in": "query",
                    "schema": {"type": "string", "pattern": r"^\d+-\d+$"},
                },
                {"name": "include_usage", "in": "query", "schema": {"type": "boolean"}},
            ],
            "responses": {
                "200": {"description": "The events", "content": _SSE},
                **_error_responses(400, 401, 404, 405),
            },
        }
    }


def _error_responses(*statuses: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for status in statuses:
        out[str(status)] = {
            "description": _DESCRIPTIONS[status],
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
        }
        if status in (429, 503):
            out[str(status)]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
    return out


def add_async_endpoints(
    result: dict[str, Any], generator: Any, request: Any, public: bool
) -> dict[str, Any]:
    """drf-spectacular postprocessing hook: the async views, the error schema, the key scheme."""
    components = result.setdefault("components", {})
    components.setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    components.setdefault("securitySchemes", {})["ApiKey"] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API key: ``sk-<prefix>.<secret>``.",
    }
    paths = result.setdefault("paths", {})
    paths["/v1/completions"] = _completion_path("completion")
    paths["/v1/chat/completions"] = _completion_path("chat")
    paths["/v1/requests/{id}/events"] = _events_path()
    for item in paths.values():  # DRF's views: the key scheme under one name
        for operation in item.values():
            if isinstance(operation, dict) and operation.get("security"):
                operation["security"] = [
                    {"ApiKey": []} if any(k != "ApiKey" for k in s) else s
                    for s in operation["security"]
                    if s
                ] or [{"ApiKey": []}]
    result["paths"] = dict(sorted(paths.items()))
    return result
