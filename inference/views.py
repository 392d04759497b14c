from django.db.models import QuerySet
from django.views.generic import TemplateView
from rest_framework import exceptions, permissions, viewsets
from rest_framework.decorators import action
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from inference import broker
from inference.health import health_report, model_list
from inference.models import InferenceRequest
from inference.serializers import InferenceRequestSerializer


class HealthView(APIView):
    """GET /v1/health: no key needed; always 200, with the daemons' state."""

    authentication_classes = []
    permission_classes = [permissions.AllowAny]

    def get(self, request: Request) -> Response:
        return Response(health_report())


class ModelListView(APIView):
    """GET /v1/models: the models live daemons serve."""

    def get(self, request: Request) -> Response:
        return Response({"object": "list", "data": model_list()})


class ModelDetailView(APIView):
    """GET /v1/models/<model>"""

    def get(self, request: Request, model: str) -> Response:
        found = next((m for m in model_list() if m["id"] == model), None)
        if found is None:
            raise exceptions.NotFound(f"The model {model!r} does not exist.", "model_not_found")
        return Response(found)


class HistoryPagination(CursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500


class InferenceRequestViewSet(viewsets.ReadOnlyModelViewSet):
    """GET /v1/requests and /v1/requests/<id>: the caller's tenant's history;
    POST /v1/requests/<id>/cancel."""

    serializer_class = InferenceRequestSerializer
    pagination_class = HistoryPagination

    def get_queryset(self) -> QuerySet[InferenceRequest]:
        return InferenceRequest.objects.for_tenant(self.request.auth.tenant)

    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: str | None = None) -> Response:
        """Ask the daemon to stop the request; it ends with finish_reason ``cancelled``."""
        row = self.get_object()
        broker.publish_cancel_sync(str(row.id))
        return Response({**self.get_serializer(row).data, "cancel_requested": True})


class PlaygroundView(TemplateView):
    template_name = "inference/playground.html"
