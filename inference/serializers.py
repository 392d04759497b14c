from rest_framework import serializers

from inference.models import InferenceRequest


class InferenceRequestSerializer(serializers.ModelSerializer):
    class Meta:
        model = InferenceRequest
        fields = [
            "id",
            "kind",
            "model",
            "status",
            "session",
            "prompt_tokens",
            "cached_tokens",
            "completion_tokens",
            "finish_reason",
            "ttft_ms",
            "duration_ms",
            "error_code",
            "created",
            "started",
            "finished",
        ]
        read_only_fields = fields
