from django.urls import path
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularRedocView

from inference import api_views, metrics, views

PUBLIC = {"authentication_classes": [], "permission_classes": []}  # no key needed
history_list = views.InferenceRequestViewSet.as_view({"get": "list"})
history_detail = views.InferenceRequestViewSet.as_view({"get": "retrieve"})
history_cancel = views.InferenceRequestViewSet.as_view({"post": "cancel"})

urlpatterns = [
    path("v1/health", views.HealthView.as_view(), name="health"),
    path("v1/models", views.ModelListView.as_view(), name="model-list"),
    path("v1/models/<path:model>", views.ModelDetailView.as_view(), name="model-detail"),
    path("v1/completions", api_views.completions, name="completions"),
    path("v1/chat/completions", api_views.chat_completions, name="chat-completions"),
    path("v1/requests", history_list, name="request-list"),
    path("v1/requests/<uuid:pk>", history_detail, name="request-detail"),
    path("v1/requests/<uuid:pk>/cancel", history_cancel, name="request-cancel"),
    path("v1/requests/<uuid:pk>/events", api_views.request_events, name="request-events"),
    path("v1/usage", views.UsageView.as_view(), name="usage"),
    path("v1/openapi.json", SpectacularJSONAPIView.as_view(**PUBLIC), name="openapi-schema"),
    path("v1/docs", SpectacularRedocView.as_view(url_name="openapi-schema", **PUBLIC),
         name="api-docs"),
    # also at /metrics once config/urls.py routes it there
    path("v1/metrics", metrics.metrics_view, name="metrics-v1"),
    path("playground/", views.PlaygroundView.as_view(), name="playground"),
]
