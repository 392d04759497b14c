from django.conf import settings
from django.urls import include, path
from drf_spectacular.views import SpectacularJSONAPIView, SpectacularRedocView

from inference import anthropic_api, api_views, auth, metrics, responses_api, views

PUBLIC = {"authentication_classes": [], "permission_classes": []}  # no key needed
history_list = views.InferenceRequestViewSet.as_view({"get": "list"})
history_detail = views.InferenceRequestViewSet.as_view({"get": "retrieve"})
history_cancel = views.InferenceRequestViewSet.as_view({"post": "cancel"})

api_patterns = [
    path("health", views.HealthView.as_view(), name="health"),
    path("models", views.ModelListView.as_view(), name="model-list"),
    path("models/<path:model>", views.ModelDetailView.as_view(), name="model-detail"),
    path("completions", api_views.CompletionsView.as_view(), name="completions"),
    path("chat/completions", api_views.ChatCompletionsView.as_view(), name="chat-completions"),
    path("responses", responses_api.ResponsesView.as_view(), name="responses"),
    path("responses/<str:response_id>", responses_api.ResponseDetailView.as_view(),
         name="response-detail"),
    path("messages", anthropic_api.MessagesView.as_view(), name="messages"),
    path("messages/count_tokens", anthropic_api.CountTokensView.as_view(),
         name="messages-count-tokens"),
    path("embeddings", api_views.EmbeddingsView.as_view(), name="embeddings"),
    path("tokenize", api_views.TokenizeView.as_view(), name="tokenize"),
    path("detokenize", api_views.DetokenizeView.as_view(), name="detokenize"),
    path("requests", history_list, name="request-list"),
    path("requests/<uuid:pk>", history_detail, name="request-detail"),
    path("requests/<uuid:pk>/cancel", history_cancel, name="request-cancel"),
    path("requests/<uuid:pk>/events", api_views.RequestEventsView.as_view(),
         name="request-events"),
    path("usage", views.UsageView.as_view(), name="usage"),
    path("sessions/<str:session_id>", api_views.SessionView.as_view(), name="session-detail"),
    # nginx's auth_request (config/proxy.py); the door answers 404 to clients asking for it
    path("internal/key-check", auth.key_check, name="key-check"),
    path("openapi.json", SpectacularJSONAPIView.as_view(**PUBLIC), name="openapi-schema"),
    path("docs", SpectacularRedocView.as_view(url_name="openapi-schema", **PUBLIC),
         name="api-docs"),
    # also at /metrics once config/urls.py routes it there
    path("metrics", metrics.metrics_view, name="metrics-v1"),
]

urlpatterns = [
    path(settings.API_PREFIX.lstrip("/"), include(api_patterns)),
    path("playground/", views.PlaygroundView.as_view(), name="playground"),
]
