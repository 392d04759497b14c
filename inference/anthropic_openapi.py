"""The OpenAPI description of /v1/messages and /v1/messages/count_tokens: Anthropic's
request and reply bodies and its error shape, as serializers drf-spectacular reads. They
document; inference/anthropic_request.py checks (its errors name the field at fault)."""
from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema_field
from rest_framework import serializers

from inference.anthropic_format import error_type
from inference.anthropic_request import CACHE_TTLS, MAX_METADATA_USER_CHARS
from wire import errors as codes
from wire import sampling

_CACHE_CONTROL = {"type": "object", "required": ["type"], "nullable": True,
                  "properties": {"type": {"type": "string", "enum": ["ephemeral"]},
                                 "ttl": {"type": "string", "enum": list(CACHE_TTLS)}},
                  "description": "a cache breakpoint (accepted: every prompt prefix is cached; "
                                 "docs/api.md)"}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"],
               "properties": {"type": {"type": "string", "enum": ["text"]},
                              "text": {"type": "string", "minLength": 1},
                              "cache_control": _CACHE_CONTROL}}
_TOOL_USE_ID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,256}$"}
_BLOCK = {"oneOf": [
    _TEXT_BLOCK,
    {"type": "object", "required": ["type", "id", "name", "input"],
     "properties": {"type": {"type": "string", "enum": ["tool_use"]}, "id": _TOOL_USE_ID,
                    "name": {"type": "string", "minLength": 1}, "input": {"type": "object"},
                    "cache_control": _CACHE_CONTROL}},
    {"type": "object", "required": ["type", "tool_use_id"],
     "properties": {"type": {"type": "string", "enum": ["tool_result"]},
                    "tool_use_id": _TOOL_USE_ID, "is_error": {"type": "boolean"},
                    "content": {"oneOf": [{"type": "string"},
                                          {"type": "array", "items": _TEXT_BLOCK}]},
                    "cache_control": _CACHE_CONTROL}},
]}


@extend_schema_field({"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "items": _BLOCK, "minItems": 1}],
                      "description": "a string or content blocks: text, tool_use (assistant), "
                                     "tool_result (user)"})
class MessageContentField(serializers.JSONField):
    pass


@extend_schema_field({"oneOf": [{"type": "string"},
                                {"type": "array", "items": _TEXT_BLOCK, "minItems": 1}],
                      "description": "a string or text blocks"})
class SystemField(serializers.JSONField):
    pass


@extend_schema_field(_CACHE_CONTROL)
class CacheControlField(serializers.JSONField):
    pass


@extend_schema_field({"type": "object", "required": ["type"],
                      "properties": {"type": {"type": "string",
                                              "enum": ["auto", "any", "tool", "none"]},
                                     "name": {"type": "string"},
                                     "disable_parallel_tool_use": {"type": "boolean"}},
                      "description": '"tool" with a name forces that tool; "any" some tool'})
class AnthropicToolChoiceField(serializers.JSONField):
    pass


@extend_schema_field({"type": "object", "required": ["type"],
                      "properties": {"type": {"type": "string", "enum": ["disabled"]}},
                      "description": "extended thinking: only disabled"})
class ThinkingField(serializers.JSONField):
    pass


class InputMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(["user", "assistant"])
    content = MessageContentField()


class AnthropicToolSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9_-]{1,64}$")
    description = serializers.CharField(required=False, max_length=4096)
    input_schema = serializers.DictField(help_text='a JSON schema of "type": "object"')
    type = serializers.ChoiceField(["custom"], required=False)
    cache_control = CacheControlField(required=False)


class MetadataSerializer(serializers.Serializer):
    user_id = serializers.CharField(required=False, allow_null=True,
                                    max_length=MAX_METADATA_USER_CHARS)


class CountTokensRequestSerializer(serializers.Serializer):
    """The fields ``count_tokens`` takes (docs/api.md, "Anthropic Messages")."""

    model = serializers.CharField(min_length=1)
    messages = InputMessageSerializer(many=True)
    system = SystemField(required=False)
    tools = AnthropicToolSerializer(many=True, required=False)
    tool_choice = AnthropicToolChoiceField(required=False)
    cache_control = CacheControlField(required=False)
    thinking = ThinkingField(required=False)


class MessagesRequestSerializer(CountTokensRequestSerializer):
    max_tokens = serializers.IntegerField(min_value=1, max_value=sampling.RANGES["max_tokens"][1])
    stop_sequences = serializers.ListField(
        child=serializers.CharField(min_length=1, max_length=sampling.MAX_STOP_CHARS),
        required=False, max_length=sampling.MAX_STOP_STRINGS)
    temperature = serializers.FloatField(required=False, min_value=0, max_value=1)
    top_p = serializers.FloatField(required=False, min_value=0, max_value=1)
    top_k = serializers.IntegerField(required=False, min_value=0,
                                     max_value=sampling.RANGES["top_k"][1])
    stream = serializers.BooleanField(required=False)
    metadata = MetadataSerializer(required=False)
    service_tier = serializers.ChoiceField(["auto", "standard_only"], required=False)


class ContentBlockSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["text", "tool_use"])
    text = serializers.CharField(required=False)
    id = serializers.CharField(required=False, help_text="toolu_...")
    name = serializers.CharField(required=False)
    input = serializers.DictField(required=False)


class MessageUsageSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField(help_text="prompt tokens neither read from nor "
                                            "written to the cache")
    output_tokens = serializers.IntegerField()
    cache_read_input_tokens = serializers.IntegerField(
        help_text="prompt tokens read from the tenant's prefix cache")
    cache_creation_input_tokens = serializers.IntegerField(
        help_text="with a cache_control breakpoint: prompt tokens computed and kept")


class MessageSerializer(serializers.Serializer):
    id = serializers.CharField(help_text="msg_...")
    type = serializers.ChoiceField(["message"])
    role = serializers.ChoiceField(["assistant"])
    model = serializers.CharField()
    content = ContentBlockSerializer(many=True)
    stop_reason = serializers.ChoiceField(
        ["end_turn", "max_tokens", "stop_sequence", "tool_use", "cancelled"], allow_null=True)
    stop_sequence = serializers.CharField(allow_null=True)
    usage = MessageUsageSerializer()


class CountTokensSerializer(serializers.Serializer):
    input_tokens = serializers.IntegerField()


class AnthropicErrorDetailSerializer(serializers.Serializer):
    type = serializers.ChoiceField(sorted({error_type(entry.status, entry.code)
                                           for entry in codes.CODES.values()}))
    message = serializers.CharField()
    code = serializers.ChoiceField(sorted(codes.CODES), allow_null=True,
                                   help_text="our code (docs/api.md, Errors)")
    param = serializers.CharField(required=False, allow_null=True,
                                  help_text="the field at fault")


class AnthropicErrorSerializer(serializers.Serializer):
    """Anthropic's error document, with our code and the field at fault added."""

    type = serializers.ChoiceField(["error"])
    error = AnthropicErrorDetailSerializer()


def anthropic_errors(*statuses: int) -> dict[int, OpenApiResponse]:
    """``extend_schema(responses=...)`` entries for these error statuses."""
    return {status: OpenApiResponse(AnthropicErrorSerializer, description="; ".join(
        f"``{entry.code}``: {entry.summary}" for entry in codes.CODES.values()
        if entry.status == status)) for status in statuses}
