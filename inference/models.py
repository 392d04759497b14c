import re
import secrets
import uuid
from typing import Any

from django.core.exceptions import ValidationError
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from accounts.models import ApiKey, Tenant
from inference import adapter_files
from wire import status as request_status

# An adapter's name: what a request puts after "<model>:" (never a ':' itself).
ADAPTER_NAME = re.compile(r"\A[a-z0-9][a-z0-9._-]{0,63}\Z")
ADAPTER_KEY = re.compile(r"\Aad_[0-9a-f]{16}\Z")
ADAPTER_KEY_START = "ad_"
# A request's (or an adapter's default) scale: more than MIN, at most MAX.
MIN_ADAPTER_SCALE = 0.0
MAX_ADAPTER_SCALE = 4.0


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


def _adapter_key() -> str:
    return f"{ADAPTER_KEY_START}{secrets.token_hex(8)}"


class Adapter(models.Model):
    """A tenant's LoRA adapter for one base model (docs/adapters.md): requests of the
    tenant's keys name it as ``<model>:<name>`` (or ``lora``); jobs carry its ``key``, its
    file's absolute path, hash and a scale. The file is checked when the row is added
    (``clean``: inference/adapter_files.py) and is not changed afterwards."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    model = models.CharField(max_length=200, help_text="the base model's name (as in MODELS)")
    name = models.CharField(
        max_length=64, validators=[RegexValidator(
            ADAPTER_NAME, "a-z, 0-9, '.', '_' and '-', starting with a letter or digit; at "
            "most 64 characters")],
        help_text="requests name it as <model>:<name>")
    file = models.CharField(max_length=1000,
                            help_text="the GGUF LoRA file, relative to ADAPTERS_DIR")
    sha256 = models.CharField(max_length=64, editable=False)
    size_bytes = models.PositiveBigIntegerField(editable=False)
    rank = models.PositiveIntegerField(editable=False)
    alpha = models.FloatField(null=True, blank=True, editable=False)
    default_scale = models.FloatField(
        default=1.0, help_text=f"the scale a request gets when it names none: more than "
                               f"{MIN_ADAPTER_SCALE:g}, at most {MAX_ADAPTER_SCALE:g}")
    key = models.CharField(max_length=19, unique=True, default=_adapter_key, editable=False,
                           help_text="its public id: metrics, daemons, control commands")
    created = models.DateTimeField(default=timezone.now, editable=False)

    class Meta:
        ordering = ["tenant", "model", "name"]
        constraints = [models.UniqueConstraint(fields=["tenant", "model", "name"],
                                               name="adapter_unique_per_tenant_model")]

    def __str__(self) -> str:
        return f"{self.model}:{self.name}"

    def clean(self) -> None:
        """The scale's range; when the row is new, its file (the fields found in it are
        filled here): a ValidationError on ``file`` naming what is wrong."""
        if not is_adapter_scale(self.default_scale):
            raise ValidationError({"default_scale": f"more than {MIN_ADAPTER_SCALE:g}, at most "
                                                    f"{MAX_ADAPTER_SCALE:g}"})
        if self._state.adding and self.model and self.file:
            try:
                found = adapter_files.inspect(self.model, self.file)
            except adapter_files.AdapterFileError as exc:
                raise ValidationError({"file": str(exc)}) from None
            self.file, self.sha256, self.size_bytes = found.file, found.sha256, found.size_bytes
            self.rank, self.alpha = found.rank, found.alpha

    def job_adapter(self, scale: float | None = None) -> dict[str, Any]:
        """What a job carries (wire/protocol.py ``Job.adapter``)."""
        return {"id": self.key, "path": adapter_files.absolute_path(self.file),
                "sha256": self.sha256,
                "scale": float(self.default_scale if scale is None else scale)}


def is_adapter_scale(value: Any) -> bool:
    """A finite number in (MIN_ADAPTER_SCALE, MAX_ADAPTER_SCALE] (ints compared as ints)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return MIN_ADAPTER_SCALE < value <= MAX_ADAPTER_SCALE  # NaN fails both; inf the second


class StoredResponseQuerySet(models.QuerySet):
    def for_tenant(self, tenant_id: int) -> "StoredResponseQuerySet":
        """One tenant's stored responses that have not expired: the only way views reach
        them."""
        return self.filter(tenant_id=tenant_id, expires__gt=timezone.now())


class StoredResponse(models.Model):
    """A ``/v1/responses`` response kept (``store``: true) for ``GET /v1/responses/<id>`` and
    ``previous_response_id`` until ``expires`` (RESPONSES_RETENTION_DAYS). Unlike a history
    row it holds text: the conversation to continue (as OpenAI keeps it), written and read by
    inference/responses_store.py only. JSON as text: PostgreSQL's jsonb cannot hold NUL."""

    id = models.CharField(primary_key=True, max_length=40, editable=False,
                          help_text="resp_<the request's id>")
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE,
                               related_name="stored_responses")
    request_id = models.UUIDField(help_text="its history row (InferenceRequest)")
    model = models.CharField(max_length=200)
    conversation = models.TextField(
        help_text="JSON: the chat messages so far, this response's output included "
                  "(its instructions are not: they do not carry over)")
    response = models.TextField(help_text="JSON: the Response object as answered")
    created = models.DateTimeField(default=timezone.now)
    expires = models.DateTimeField()

    objects = StoredResponseQuerySet.as_manager()

    class Meta:
        ordering = ["-created"]
        indexes = [models.Index(fields=["expires"])]  # the sweep of expired rows

    def __str__(self) -> str:
        return self.id
