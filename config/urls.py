from django.conf import settings
from django.contrib import admin
from django.urls import include, path, re_path
from django.views.decorators.csrf import csrf_exempt
from django.views.generic import RedirectView

from inference import admin_live, admin_overview, errors, metrics

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="playground", permanent=False)),
    path("admin/live/", include(admin_live.urls())),
    path("admin/overview/", admin_overview.overview, name="admin_overview"),
    path("console/", include("console.urls")),
    path("admin/", admin.site.urls),
    path("metrics", metrics.metrics_view, name="metrics"),
    # nginx's auth_request (the proxy never routes /internal/ from clients)
    path("", include("inference.urls")),
    # Unknown API URLs answer in the API's error shape, DEBUG or not.
    re_path(f"^{settings.API_PREFIX.lstrip('/')}", csrf_exempt(errors.not_found)),
]

handler400 = errors.bad_request
handler404 = errors.not_found
handler500 = errors.server_error
