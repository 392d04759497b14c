"""ASGI entry point for daphne: `daphne config.asgi:application`.

HTTP goes to Django (static files too, when SERVE_STATIC); websockets to the Channels
consumers, authenticated by API key (no Origin check: keys, not cookies, carry identity).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()  # sets Django up before anything imports models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from inference.auth import ApiKeyAuthMiddleware  # noqa: E402
from inference.routing import websocket_urlpatterns  # noqa: E402

http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.SERVE_STATIC else django_asgi_app

application = ProtocolTypeRouter({
    "http": http_app,
    "websocket": ApiKeyAuthMiddleware(URLRouter(websocket_urlpatterns)),
})
