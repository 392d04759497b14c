from django.urls import path

from inference import views

history_list = views.InferenceRequestViewSet.as_view({"get": "list"})
history_detail = views.InferenceRequestViewSet.as_view({"get": "retrieve"})

urlpatterns = [
    path("v1/health", views.HealthView.as_view(), name="health"),
    path("v1/requests", history_list, name="request-list"),
    path("v1/requests/<uuid:pk>", history_detail, name="request-detail"),
    path("playground/", views.PlaygroundView.as_view(), name="playground"),
]
