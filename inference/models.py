import uuid

from django.db import models
from django.utils import timezone

from accounts.models import ApiKey, Tenant
from wire import status as request_status


class InferenceRequestQuerySet(models.QuerySet):
    def for_tenant(self, tenant: Tenant) -> "InferenceRequestQuerySet":
        """The only way views reach history: one tenant's rows."""
        return self.filter(tenant=tenant)


class InferenceRequest(models.Model):
    """One completion or chat request: its accounting, never its text."""

    class Kind(models.TextChoices):
        COMPLETION = "completion", "Completion"
        CHAT = "chat", "Chat completion"
        TOKENIZE = "tokenize", "Tokenize"
        DETOKENIZE = "detokenize", "Detokenize"
        EMBEDDING = "embedding", "Embeddings"

    class Status(models.TextChoices):
        QUEUED = request_status.QUEUED, "Queued"
        RUNNING = request_status.RUNNING, "Running"
        DONE = request_status.DONE, "Done"
        CANCELLED = request_status.CANCELLED, "Cancelled"
        ERROR = request_status.ERROR, "Error"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="requests")
    api_key = models.ForeignKey(
        ApiKey, null=True, blank=True, on_delete=models.SET_NULL, related_name="requests"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    model = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    session = models.CharField(max_length=200, blank=True, help_text="client's session id")
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)
    # the prompt cache's account (wire.protocol.usage): tokens computed and kept as a
    # reusable prefix, the hit's kind and the tier it came from
    cache_created_tokens = models.PositiveIntegerField(null=True, blank=True)
    cache_hit = models.CharField(max_length=16, blank=True)
    cache_tier = models.CharField(max_length=16, blank=True)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    finish_reason = models.CharField(max_length=32, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    error_code = models.CharField(max_length=64, blank=True)
    created = models.DateTimeField(default=timezone.now)
    started = models.DateTimeField(null=True, blank=True)
    finished = models.DateTimeField(null=True, blank=True)

    objects = InferenceRequestQuerySet.as_manager()

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["tenant", "-created"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.id} ({self.status})"
