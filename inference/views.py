from datetime import UTC, date, datetime, time, timedelta
from importlib import import_module

from django.conf import settings
from django.contrib.auth import get_user
from django.db.models import Count, QuerySet, Sum
from django.db.models.functions import Coalesce, TruncDate
from django.http import HttpRequest
from django.utils.dateparse import parse_datetime
from django.views.generic import TemplateView
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import (
    OpenApiParameter,
    extend_schema,
    extend_schema_view,
    inline_serializer,
)
from rest_framework import exceptions, permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.pagination import Cursor, CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts.models import ApiKey, Tenant
from inference import adapters, broker, db, limits, service
from inference.auth import ApiKeyAuthentication
from inference.errors import model_not_found
from inference.health import health_report, model_list, public_health
from inference.models import InferenceRequest
from inference.openapi import error_responses
from inference.serializers import InferenceRequestSerializer, UsageQuerySerializer, UsageSerializer

MODEL_FIELDS = {
    "id": serializers.CharField(), "object": serializers.CharField(),
    "created": serializers.IntegerField(), "owned_by": serializers.CharField(),
    "embeddings": serializers.BooleanField(help_text="its daemon serves /v1/embeddings"),
    "parent": serializers.CharField(required=False,
                                    help_text="an adapter's base model (its id: <base>:<name>)"),
}
MODEL = inline_serializer("Model", MODEL_FIELDS)
MODEL_LIST = inline_serializer("ModelList", {
    "object": serializers.CharField(), "data": inline_serializer("Model", MODEL_FIELDS, many=True),
})


class HealthView(APIView):
    """GET /v1/health: no key needed; always 200. Anyone learns which models are up; a
    valid API key or a staff session also sees each daemon's state."""

    authentication_classes = [ApiKeyAuthentication]
    permission_classes = [permissions.AllowAny]

    @extend_schema(responses={200: OpenApiTypes.OBJECT}, auth=[],
                   summary="Service and daemon health")
    def get(self, request: Request) -> Response:
        if request.auth is not None or _staff_session(request):
            return Response(health_report())
        return Response(public_health())


def _staff_session(request: Request) -> bool:
    """Whether the request carries the session cookie of an active staff user (the API runs
    no session middleware: the session is read here, on the database thread)."""
    session_key = request.COOKIES.get(settings.SESSION_COOKIE_NAME)
    return bool(session_key) and db.call(_is_staff_session, session_key)


def _is_staff_session(session_key: str) -> bool:
    holder = HttpRequest()
    holder.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(holder)
    return user.is_active and user.is_staff


def _key_models(request: Request) -> list[dict]:
    """The models live daemons serve, then the key's tenant's adapters of them: those the
    key may use (``service.model_allowed``: its allow-list, when it has one)."""
    served = model_list()
    found = served + adapters.model_entries(request.auth.tenant_id, served)
    return [m for m in found if _allowed(request.auth, m)]


def _allowed(api_key: ApiKey, entry: dict) -> bool:
    """``service.model_allowed`` for a ``/v1/models`` entry (an adapter's names its
    ``parent``)."""
    parent = entry.get("parent")
    if parent is None:
        return service.model_allowed(api_key, entry["id"])
    return service.model_allowed(api_key, parent, entry["id"][len(parent) + 1:])


class ModelListView(APIView):
    """GET /v1/models: the models live daemons serve, and the key's tenant's adapters of
    them (``<base>:<name>``), those the key may use (a key with an allow-list sees only
    its models; another is 404 as an unknown one)."""

    @extend_schema(responses={200: MODEL_LIST, **error_responses(401)},
                   summary="Models live daemons serve, and the tenant's adapters of them")
    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": _key_models(request)})


class ModelDetailView(APIView):
    """GET /v1/models/<model>: another tenant's adapter is 404 like an unknown model."""

    @extend_schema(responses={200: MODEL, **error_responses(401, 404)}, summary="One model",
                   operation_id="models_detail")
    def get(self, request: Request, model: str) -> Response:
        found = next((m for m in _key_models(request) if m["id"] == model), None)
        if found is None:
            raise model_not_found(model)
        return Response(found)


class HistoryPagination(CursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500

    def decode_cursor(self, request: Request) -> Cursor | None:
        """DRF's, and the position must be a timestamp: a forged cursor's position would
        otherwise reach the ``created`` filter (a ValidationError there is a 500)."""
        cursor = super().decode_cursor(request)
        if cursor is not None and cursor.position is not None:
            try:
                valid = parse_datetime(cursor.position) is not None
            except ValueError:  # well-formed but impossible (month 13)
                valid = False
            if not valid:
                raise exceptions.NotFound(self.invalid_cursor_message)
        return cursor


@extend_schema_view(
    list=extend_schema(responses={200: InferenceRequestSerializer(many=True),
                                  **error_responses(400, 401, 404)},
                       summary="The tenant's request history, newest first"),
    retrieve=extend_schema(responses={200: InferenceRequestSerializer,
                                      **error_responses(401, 404)},
                           summary="One request's accounting"),
)
class InferenceRequestViewSet(viewsets.ReadOnlyModelViewSet):
    """GET /v1/requests and /v1/requests/<id>: the caller's tenant's history;
    POST /v1/requests/<id>/cancel."""

    serializer_class = InferenceRequestSerializer
    pagination_class = HistoryPagination

    def get_queryset(self) -> QuerySet[InferenceRequest]:
        return InferenceRequest.objects.for_tenant(self.request.auth.tenant)

    @extend_schema(request=None,
                   responses={200: InferenceRequestSerializer, **error_responses(401, 404)},
                   summary="Cancel a request")
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Ask the daemon to stop the request; it ends with finish_reason ``cancelled``."""
        row = self.get_object()
        broker.publish_cancel_sync(str(row.id))
        return Response({**self.get_serializer(row).data, "cancel_requested": True})


class UsageView(APIView):
    """GET /v1/usage?start=&end=: the caller's tenant's requests and tokens by day and
    model (UTC dates, inclusive; default: this month so far), its limits and its counters."""

    TOKEN_FIELDS = ("prompt_tokens", "cached_tokens", "cache_created_tokens",
                    "completion_tokens")

    @extend_schema(
        parameters=[
            OpenApiParameter("start", OpenApiTypes.DATE,
                             description="first day (UTC); default: the 1st of this month"),
            OpenApiParameter("end", OpenApiTypes.DATE,
                             description="last day, inclusive; default: today"),
        ],
        responses={200: UsageSerializer, **error_responses(400, 401)},
        summary="The tenant's usage by day and model",
    )
    def get(self, request: Request) -> Response:
        query = UsageQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        start, end = query.validated_data["start"], query.validated_data["end"]
        tenant = request.auth.tenant
        rows = [self._row(r) for r in self._by_day_and_model(tenant, start, end)]
        fields = ("requests", *self.TOKEN_FIELDS, "total_tokens")
        totals = {k: sum(r[k] for r in rows) for k in fields}
        body = {
            "object": "usage", "start": start, "end": end, "data": rows, "totals": totals,
            "limits": {f: getattr(tenant, f) for f in limits.FIELDS},
            "current": limits.current_usage_sync(tenant.id),
        }
        return Response(UsageSerializer(body).data)

    def _by_day_and_model(self, tenant: Tenant, start: date, end: date) -> QuerySet:
        since = datetime.combine(start, time.min, tzinfo=UTC)
        until = datetime.combine(end + timedelta(days=1), time.min, tzinfo=UTC)
        sums = {f: Coalesce(Sum(f), 0) for f in self.TOKEN_FIELDS}
        return (
            InferenceRequest.objects.for_tenant(tenant)
            .filter(created__gte=since, created__lt=until)
            .annotate(date=TruncDate("created", tzinfo=UTC))
            .values("date", "model")
            .annotate(requests=Count("id"), **sums)
            .order_by("date", "model")
        )

    @staticmethod
    def _row(row: dict) -> dict:
        return {**row, "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}


class PlaygroundView(TemplateView):
    template_name = "inference/playground.html"
