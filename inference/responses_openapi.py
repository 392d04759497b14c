"""The OpenAPI description of ``/v1/responses`` (drf-spectacular): request and reply bodies as
serializers. They document; ``inference/responses_request.py`` checks."""
from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from inference.responses_request import (
    INPUT_ROLES,
    MAX_METADATA_KEYS,
    MAX_METADATA_VALUE_CHARS,
)
from wire import sampling


def _ranged(name: str, **kwargs: Any) -> serializers.Field:
    """A numeric field with the range ``wire.sampling`` checks."""
    lo, hi = sampling.RANGES[name]
    field = serializers.IntegerField if isinstance(lo, int) else serializers.FloatField
    return field(required=False, min_value=lo, max_value=hi, **kwargs)

_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"type": "string", "enum": ["input_text", "output_text"]},
                             "text": {"type": "string"}}}
_ITEM = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "type": {"type": "string", "enum": ["message"]},
        "role": {"type": "string", "enum": list(INPUT_ROLES)},
        "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}},
    {"type": "object", "required": ["type", "call_id", "name", "arguments"], "properties": {
        "type": {"type": "string", "enum": ["function_call"]},
        "call_id": {"type": "string", "minLength": 1, "maxLength": 256},
        "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
        "arguments": {"type": "string"}}},
    {"type": "object", "required": ["type", "call_id", "output"], "properties": {
        "type": {"type": "string", "enum": ["function_call_output"]},
        "call_id": {"type": "string", "minLength": 1, "maxLength": 256},
        "output": {"type": "string"}}},
]}


@extend_schema_field({"oneOf": [{"type": "string"},
                                {"type": "array", "items": _ITEM, "minItems": 1}],
                      "description": "a user message's text, or a list of items: messages, "
                                     "function calls and their outputs"})
class InputField(serializers.JSONField):
    pass


@extend_schema_field({"oneOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "name"],
     "properties": {"type": {"type": "string", "enum": ["function"]},
                    "name": {"type": "string"}}},
]})
class ResponsesToolChoiceField(serializers.JSONField):
    pass


class FunctionToolSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["function"])
    name = serializers.RegexField(r"^[A-Za-z0-9_-]{1,64}$")
    description = serializers.CharField(required=False, allow_null=True, max_length=4096)
    parameters = serializers.DictField(required=False, allow_null=True,
                                       help_text='a JSON schema of "type": "object"')
    strict = serializers.BooleanField(required=False, allow_null=True,
                                      help_text="accepted: the call always follows the schema")


@extend_schema_field({"type": "object", "properties": {"format": {"oneOf": [
    {"type": "object", "required": ["type"],
     "properties": {"type": {"type": "string", "enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "schema"],
     "properties": {"type": {"type": "string", "enum": ["json_schema"]},
                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                    "schema": {"type": "object"}, "strict": {"type": "boolean"}}},
]}}, "description": "the output's format: text, or JSON following a schema"})
class TextConfigField(serializers.JSONField):
    pass


class ResponseRequestSerializer(serializers.Serializer):
    """docs/api.md, "Responses"."""

    model = serializers.CharField(required=False, min_length=1,
                                  help_text="default: the first of the server's MODELS")
    input = InputField()
    instructions = serializers.CharField(required=False, allow_null=True,
                                         help_text="a system message first (not carried "
                                                   "over by previous_response_id)")
    tools = FunctionToolSerializer(many=True, required=False, allow_null=True)
    tool_choice = ResponsesToolChoiceField(required=False, allow_null=True)
    text = TextConfigField(required=False, allow_null=True)
    max_output_tokens = _ranged("max_tokens", allow_null=True)
    temperature = _ranged("temperature", allow_null=True)
    top_p = _ranged("top_p", allow_null=True)
    stream = serializers.BooleanField(required=False, allow_null=True)
    store = serializers.BooleanField(required=False, allow_null=True,
                                     help_text="keep it (default true): GET, "
                                               "previous_response_id")
    previous_response_id = serializers.CharField(required=False, allow_null=True,
                                                 help_text="continue that stored response's "
                                                           "conversation")
    metadata = serializers.DictField(child=serializers.CharField(
        max_length=MAX_METADATA_VALUE_CHARS), required=False, allow_null=True,
        help_text=f"at most {MAX_METADATA_KEYS} keys")
    user = serializers.CharField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(required=False, allow_null=True)


class InputTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField(help_text="read from the prompt cache")
    cache_write_tokens = serializers.IntegerField(
        help_text="computed and kept as a reusable prefix")


class OutputTokensDetailsSerializer(serializers.Serializer):
    reasoning_tokens = serializers.IntegerField()


class ResponseUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()
    input_tokens_details = InputTokensDetailsSerializer()
    output_tokens = serializers.IntegerField()
    output_tokens_details = OutputTokensDetailsSerializer()
    total_tokens = serializers.IntegerField()


class ResponseSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="resp_<hex>")
    object = serializers.ChoiceField(["response"])
    created_at = serializers.IntegerField()
    status = serializers.ChoiceField(["completed", "incomplete", "cancelled", "failed",
                                      "in_progress"])
    error = serializers.JSONField(allow_null=True)
    incomplete_details = serializers.JSONField(allow_null=True)
    model = serializers.CharField()
    output = serializers.JSONField(help_text='"message" and "function_call" items')
    usage = ResponseUsageSerializer(allow_null=True)
    instructions = serializers.CharField(allow_null=True)
    previous_response_id = serializers.CharField(allow_null=True)
    store = serializers.BooleanField()
    metadata = serializers.DictField(child=serializers.CharField())


class DeletedResponseSerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.ChoiceField(["response"])
    deleted = serializers.BooleanField()
