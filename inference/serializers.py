from datetime import date, timedelta

from django.utils import timezone
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
            "cache_created_tokens",
            "cache_hit",
            "cache_tier",
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


class UsageQuerySerializer(serializers.Serializer):
    """?start=&end= (ISO dates, inclusive, UTC); both default to the current month."""

    MAX_DAYS = 366
    # Far enough from date.max that the range arithmetic (start + 30 days, end + 1 day)
    # cannot overflow; far past any history row.
    LAST_DAY = date(9999, 11, 30)

    start = serializers.DateField(required=False, input_formats=["iso-8601"])
    end = serializers.DateField(required=False, input_formats=["iso-8601"])

    def validate(self, attrs: dict) -> dict:
        for name in ("start", "end"):
            if name in self.initial_data and name not in attrs:  # sent empty
                raise serializers.ValidationError({name: "Give a date as YYYY-MM-DD."})
        for name in ("start", "end"):
            if name in attrs and attrs[name] > self.LAST_DAY:
                raise serializers.ValidationError(
                    {name: f"Give a date on or before {self.LAST_DAY.isoformat()}."})
        today = timezone.now().date()
        start = attrs.get("start") or today.replace(day=1)
        end = attrs.get("end") or (today if "start" not in attrs else start + timedelta(days=30))
        if end < start:
            raise serializers.ValidationError({"end": "end must not be before start."})
        if (end - start).days >= self.MAX_DAYS:
            raise serializers.ValidationError(
                {"end": f"A range may span at most {self.MAX_DAYS} days."})
        return {"start": start, "end": end}


class UsageTotalsSerializer(serializers.Serializer):
    requests = serializers.IntegerField()
    prompt_tokens = serializers.IntegerField()
    cached_tokens = serializers.IntegerField()
    cache_created_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    total_tokens = serializers.IntegerField()


class UsageRowSerializer(UsageTotalsSerializer):
    """One day and model's totals."""

    date = serializers.DateField()
    model = serializers.CharField()

    def get_fields(self) -> dict:
        fields = super().get_fields()  # date and model first, as the rows have always been
        return {name: fields.pop(name) for name in ("date", "model")} | fields


def _counts(name: str, fields: tuple[str, ...], allow_null: bool = False) -> type:
    """A serializer of integer fields (the schema names it ``name``)."""
    attrs = {field: serializers.IntegerField(allow_null=allow_null) for field in fields}
    return type(name, (serializers.Serializer,), attrs)


UsageLimitsSerializer = _counts("UsageLimitsSerializer", (
    "requests_per_minute", "tokens_per_minute", "max_concurrent", "monthly_token_budget",
), allow_null=True)
UsageCurrentSerializer = _counts("UsageCurrentSerializer", (
    "requests_this_minute", "tokens_this_minute", "tokens_this_month", "concurrent",
))


class UsageSerializer(serializers.Serializer):
    """GET /v1/usage's reply."""

    object = serializers.CharField(default="usage")
    start = serializers.DateField()
    end = serializers.DateField()
    data = UsageRowSerializer(many=True)
    totals = UsageTotalsSerializer()
    limits = UsageLimitsSerializer()
    current = UsageCurrentSerializer()
