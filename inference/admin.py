from django.contrib import admin
from django.http import HttpRequest

from inference.models import InferenceRequest


@admin.register(InferenceRequest)
class InferenceRequestAdmin(admin.ModelAdmin):
    """History is written by the service; the admin only reads it."""

    list_display = [
        "id",
        "tenant",
        "kind",
        "model",
        "status",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "ttft_ms",
        "duration_ms",
        "created",
    ]
    list_filter = ["tenant", "status", ("created", admin.DateFieldListFilter)]
    list_select_related = ["tenant"]
    search_fields = ["id", "session"]
    date_hierarchy = "created"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False
