from django.db.models import QuerySet
from django.views.generic import TemplateView
from rest_framework import permissions, viewsets
from rest_framework.pagination import CursorPagination
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from inference.health import health_report
from inference.models import InferenceRequest
from inference.serializers import InferenceRequestSerializer


class HealthView(APIView):
    """GET /v1/health: no key needed."""

    authentication_classes = []
    permission_classes = [permissions.AllowAny]

    def get(self, request: Request) -> Response:
        return Response(health_report())


class HistoryPagination(CursorPagination):
    ordering = "-created"
    page_size = 50
    page_size_query_param = "limit"
    max_page_size = 500


class InferenceRequestViewSet(viewsets.ReadOnlyModelViewSet):
    """GET /v1/requests and /v1/requests/<id>: the caller's tenant's history."""

    serializer_class = InferenceRequestSerializer
    pagination_class = HistoryPagination

    def get_queryset(self) -> QuerySet[InferenceRequest]:
        return InferenceRequest.objects.for_tenant(self.request.auth.tenant)


class PlaygroundView(TemplateView):
    template_name = "inference/playground.html"
