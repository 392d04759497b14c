"""Pieces of the OpenAPI schema the views share; drf-spectacular generates the rest from them.

- ``ApiKeyScheme``: ``ApiKeyAuthentication`` as the ``ApiKey`` bearer scheme.
- ``error_responses``: ``extend_schema`` responses for error statuses, each described by
  the codes of the one table (``wire.errors.CODES``) answered with it.
- The OpenAI request and reply bodies of the completion endpoints, as serializers. They
  document; ``inference/openai_request.py`` checks (its errors name the field at fault).
  Value ranges are the shared checks' (``wire/sampling.py``) and docs/api.md's.
"""
from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema_field
from rest_framework import serializers

from inference import idempotency
from wire import errors as codes
from wire import protocol, sampling
from wire.messages import MAX_MESSAGES, ROLES


class ApiKeyScheme(OpenApiAuthenticationExtension):
    target_class = "inference.auth.ApiKeyAuthentication"
    name = "ApiKey"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {"type": "http", "scheme": "bearer",
                "description": "An API key: ``sk-<prefix>.<secret>``."}


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField()
    type = serializers.ChoiceField(
        choices=sorted({entry.type for entry in codes.CODES.values()}))
    param = serializers.CharField(allow_null=True, help_text="the field at fault")
    code = serializers.ChoiceField(choices=sorted(codes.CODES), allow_null=True)


class ErrorSerializer(serializers.Serializer):
    """OpenAI's error document; refusals may add details (``prompt_tokens``, ``limit``...)."""

    error = ErrorDetailSerializer()


def error_responses(*statuses: int) -> dict[int, OpenApiResponse]:
    """``extend_schema(responses=...)`` entries for these error statuses."""
    return {status: OpenApiResponse(ErrorSerializer, description=_codes_of(status))
            for status in statuses}


def _codes_of(status: int) -> str:
    return "; ".join(f"``{entry.code}``: {entry.summary}"
                     for entry in codes.CODES.values() if entry.status == status)


RETRY_AFTER = OpenApiParameter(
    "Retry-After", OpenApiTypes.INT, OpenApiParameter.HEADER, response=[429, 503],
    description="Seconds to wait before trying again.")
REQUEST_ID = OpenApiParameter(
    "X-Request-Id", OpenApiTypes.UUID, OpenApiParameter.HEADER, response=[200],
    description="The request's id (its history row).")
IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key",
    {"type": "string", "minLength": 1, "maxLength": idempotency.MAX_KEY_CHARS,
     "pattern": idempotency.KEY_PATTERN},
    OpenApiParameter.HEADER,
    description="A retry with the same key (same tenant, 24 h) returns the first request's "
    "result, or its stream from the start, under the same id, instead of running it again; "
    "the same key with another body is a 409 ``idempotency_key_reused``.")
SSE = OpenApiResponse(
    OpenApiTypes.STR,
    description="Server-sent events: ``id: <entry id>`` + ``data: <chunk JSON>`` each (resume "
    "after one with Last-Event-ID), ending with ``data: [DONE]``; a failure after the stream "
    'opened is an event ``{"error": {...}}``.')


# -- the completion endpoints' bodies --------------------------------------------------------------


class StreamOptionsSerializer(serializers.Serializer):
    include_usage = serializers.BooleanField(required=False)


def _ranged(name: str, **kwargs: Any) -> serializers.Field:
    """A numeric request field with the range ``wire.sampling`` checks."""
    lo, hi = sampling.RANGES[name]
    field = serializers.IntegerField if isinstance(lo, int) else serializers.FloatField
    return field(required=False, min_value=lo, max_value=hi, **kwargs)


@extend_schema_field({"oneOf": [{"type": "string", "minLength": 1},
                                {"type": "array", "items": {"type": "string", "minLength": 1},
                                 "maxItems": sampling.MAX_STOP_STRINGS}],
                      "nullable": True, "description": "a string or a list of strings"})
class StopField(serializers.JSONField):
    pass


@extend_schema_field({"type": "number", "minimum": 0, "exclusiveMinimum": True,
                      "nullable": True,
                      "description": "seconds; past them the request ends with its output so "
                      "far and a 504 ``timeout`` error (capped by the server's "
                      "REQUEST_TIMEOUT_S)"})
class TimeoutField(serializers.FloatField):
    pass


class CommonRequestSerializer(serializers.Serializer):
    """Fields of both endpoints (docs/api.md, "Request fields"), with the ranges the web
    checks (wire/sampling.py)."""

    model = serializers.CharField(required=False, min_length=1,
                                  help_text="default: the first of the server's MODELS")
    stream = serializers.BooleanField(required=False)
    stream_options = StreamOptionsSerializer(required=False, allow_null=True)
    max_tokens = _ranged("max_tokens", allow_null=True)
    max_completion_tokens = _ranged("max_tokens", allow_null=True)
    temperature = _ranged("temperature")
    top_p = _ranged("top_p")
    top_k = _ranged("top_k")
    min_p = _ranged("min_p")
    repeat_penalty = _ranged("repeat_penalty")
    frequency_penalty = _ranged("frequency_penalty")
    presence_penalty = _ranged("presence_penalty")
    penalty_last_n = _ranged("penalty_last_n")
    seed = _ranged("seed", allow_null=True)
    stop = StopField(required=False)
    logit_bias = serializers.DictField(child=serializers.FloatField(min_value=-100, max_value=100),
                                       required=False, help_text='{"<token id>": bias}')
    ignore_eos = serializers.BooleanField(required=False)
    grammar = serializers.CharField(required=False, help_text="GBNF")
    json_schema = serializers.DictField(required=False)
    response_format = serializers.DictField(required=False, allow_null=True)
    cache_prompt = serializers.BooleanField(required=False, allow_null=True)
    session = serializers.CharField(required=False, allow_null=True, max_length=200,
                                    help_text="keeps a conversation on one slot (prefix cache)")
    user = serializers.CharField(required=False, help_text="taken as the session when none")
    session_id = serializers.CharField(
        required=False, max_length=64,
        help_text='"new" opens a session; its id (returned as session_id) continues it '
                  "(docs/api.md, Sessions)")
    locals()["continue"] = serializers.BooleanField(  # a keyword: named through locals()
        required=False, help_text="with session_id: prompt/messages hold only the new turn")
    n = serializers.IntegerField(required=False, allow_null=True, min_value=1,
                                 max_value=protocol.MAX_CHOICES,
                                 help_text="choices: the prompt prefilled once, sampled n ways")
    timeout = TimeoutField(required=False, allow_null=True)


_LOGPROBS_HELP = "log probabilities of the chosen tokens (from the model's logits, before "\
    "sampling), with this many most likely alternatives each"


@extend_schema_field({"oneOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                "properties": {"type": {"type": "string", "enum": ["text"]},
                                               "text": {"type": "string"}}}},
], "description": 'a string or a list of {"type": "text", "text": ...} parts'})
class ContentField(serializers.JSONField):
    pass


@extend_schema_field({"oneOf": [
    {"type": "string"},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1},
], "description": "a string, a list of token ids, or a one-string list"})
class PromptField(serializers.JSONField):
    pass


class ChatMessageSerializer(serializers.Serializer):
    role = serializers.ChoiceField(sorted(ROLES))
    content = ContentField()


class FunctionSerializer(serializers.Serializer):
    name = serializers.RegexField(r"^[A-Za-z0-9_-]{1,64}$")
    description = serializers.CharField(required=False, max_length=4096)
    parameters = serializers.DictField(required=False, help_text='a JSON schema of "type": '
                                       '"object"')


class ToolSerializer(serializers.Serializer):
    type = serializers.ChoiceField(["function"])
    function = FunctionSerializer()


@extend_schema_field({"oneOf": [
    {"type": "string", "enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"],
     "properties": {"type": {"type": "string", "enum": ["function"]},
                    "function": {"type": "object", "required": ["name"],
                                 "properties": {"name": {"type": "string"}}}}},
], "description": "default auto when tools are given; a named function or required forces a "
                  "call (its arguments follow the function's schema)"})
class ToolChoiceField(serializers.JSONField):
    pass


class ChatCompletionRequestSerializer(CommonRequestSerializer):
    messages = serializers.ListField(child=ChatMessageSerializer(), min_length=1,
                                     max_length=MAX_MESSAGES)
    logprobs = serializers.BooleanField(required=False, allow_null=True,
                                        help_text="log probabilities of the chosen tokens")
    top_logprobs = _ranged("logprobs", allow_null=True, help_text=_LOGPROBS_HELP)
    tools = ToolSerializer(many=True, required=False, allow_null=True,
                           help_text="functions the model may call (docs/api.md, Tools)")
    tool_choice = ToolChoiceField(required=False, allow_null=True)
    parallel_tool_calls = serializers.BooleanField(
        required=False, allow_null=True, help_text="accepted; a turn has one call at most")


class CompletionRequestSerializer(CommonRequestSerializer):
    prompt = PromptField()
    logprobs = _ranged("logprobs", allow_null=True, help_text=_LOGPROBS_HELP)


class PromptTokensDetailsSerializer(serializers.Serializer):
    cached_tokens = serializers.IntegerField()
    cache_read_tokens = serializers.IntegerField(
        required=False, help_text="prompt tokens read from the cache (= cached_tokens)")
    cache_created_tokens = serializers.IntegerField(
        required=False, help_text="prompt tokens computed and kept as a reusable prefix")
    cache_hit = serializers.ChoiceField(
        ["exact", "session", "prefix", "none"], required=False,
        help_text="exact: every prompt token but the last was cached")
    cache_tier = serializers.ChoiceField(
        ["slot", "cross_slot", "ram", "disk"], required=False, allow_null=True,
        help_text="where the cached tokens came from; null without a hit")


class TokenUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()
    prompt_tokens_details = PromptTokensDetailsSerializer()


class AssistantMessageSerializer(serializers.Serializer):
    role = serializers.CharField()
    content = serializers.CharField(allow_null=True)
    tool_calls = serializers.JSONField(required=False,
                                       help_text='[{"id", "type": "function", "function": '
                                       '{"name", "arguments"}}]')


class ChatChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    message = AssistantMessageSerializer()
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = serializers.JSONField(allow_null=True)


class CompletionChoiceSerializer(serializers.Serializer):
    index = serializers.IntegerField()
    text = serializers.CharField()
    finish_reason = serializers.CharField(allow_null=True)
    logprobs = serializers.JSONField(allow_null=True)


class ReplySerializer(serializers.Serializer):
    id = serializers.CharField()
    object = serializers.CharField()
    created = serializers.IntegerField()
    model = serializers.CharField()
    usage = TokenUsageSerializer()
    session_id = serializers.CharField(required=False,
                                       help_text="a session's turn: the session (docs/api.md)")


class ChatCompletionSerializer(ReplySerializer):
    choices = ChatChoiceSerializer(many=True)


class CompletionSerializer(ReplySerializer):
    choices = CompletionChoiceSerializer(many=True)


# -- /v1/tokenize and /v1/detokenize (llama-server's shapes, plus ``model``) -------------------


class TokenizeRequestSerializer(serializers.Serializer):
    model = serializers.CharField(required=False, min_length=1,
                                  help_text="default: the first of the server's MODELS")
    content = serializers.CharField(allow_blank=True, trim_whitespace=False)
    add_special = serializers.BooleanField(required=False,
                                           help_text="add the model's BOS (default false)")
    with_pieces = serializers.BooleanField(
        required=False, help_text='each token as {"id", "piece"}: the piece a string, or its '
        'bytes when they are not UTF-8 alone')


@extend_schema_field({"type": "array", "items": {"oneOf": [
    {"type": "integer"},
    {"type": "object", "properties": {"id": {"type": "integer"},
                                      "piece": {"oneOf": [{"type": "string"},
                                                          {"type": "array",
                                                           "items": {"type": "integer"}}]}}},
]}})
class TokensField(serializers.JSONField):
    pass


class TokenizeResponseSerializer(serializers.Serializer):
    tokens = TokensField()


class DetokenizeRequestSerializer(serializers.Serializer):
    model = serializers.CharField(required=False, min_length=1,
                                  help_text="default: the first of the server's MODELS")
    tokens = serializers.ListField(child=serializers.IntegerField(min_value=0),
                                   max_length=protocol.MAX_DETOKENIZE_TOKENS)


class DetokenizeResponseSerializer(serializers.Serializer):
    content = serializers.CharField()


# -- /v1/embeddings -----------------------------------------------------------------------------


@extend_schema_field({"oneOf": [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1,
     "maxItems": protocol.MAX_EMBEDDING_INPUTS},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0},
                                "minItems": 1},
     "minItems": 1, "maxItems": protocol.MAX_EMBEDDING_INPUTS},
], "description": "a text, texts, token ids, or lists of token ids"})
class EmbeddingInputField(serializers.JSONField):
    pass


class EmbeddingsRequestSerializer(serializers.Serializer):
    model = serializers.CharField(required=False, min_length=1,
                                  help_text="default: the first of the server's MODELS")
    input = EmbeddingInputField()
    encoding_format = serializers.ChoiceField(["float", "base64"], required=False)
    user = serializers.CharField(required=False)


@extend_schema_field({"oneOf": [{"type": "array", "items": {"type": "number"}},
                                {"type": "string", "description": "base64 of float32"}]})
class EmbeddingField(serializers.JSONField):
    pass


class EmbeddingSerializer(serializers.Serializer):
    object = serializers.CharField()
    index = serializers.IntegerField()
    embedding = EmbeddingField()


class EmbeddingsUsageSerializer(serializers.Serializer):
    prompt_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class EmbeddingsResponseSerializer(serializers.Serializer):
    object = serializers.CharField()
    data = EmbeddingSerializer(many=True)
    model = serializers.CharField()
    usage = EmbeddingsUsageSerializer()
