from django.contrib import admin
from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from django.views.generic import RedirectView

from config import errors
from inference import admin_live, metrics

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="playground", permanent=False)),
    path("admin/live/", include(admin_live.urls())),
    path("admin/", admin.site.urls),
    path("metrics", metrics.metrics_view, name="metrics"),
    path("", include("inference.urls")),
    # Unknown /v1/ URLs answer in the API's error shape, DEBUG or not.
    re_path(r"^v1/", csrf_exempt(errors.not_found)),  # API clients send no CSRF token
]

handler400 = errors.bad_request
handler404 = errors.not_found
handler500 = errors.server_error
