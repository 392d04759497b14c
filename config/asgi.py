"""ASGI entry point for daphne: `daphne config.asgi:application`.

HTTP goes to Django (static files too, when SERVE_STATIC; the /v1/ API to a handler with
lean middleware, config/middleware.py); websockets to the Channels
consumers, authenticated by API key (no Origin check: keys, not cookies, carry identity).
"""

import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()  # sets Django up before anything imports models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402

from config.middleware import API_PREFIX, ApiHandler  # noqa: E402
from inference.auth import ApiKeyAuthMiddleware  # noqa: E402
from inference.routing import websocket_urlpatterns  # noqa: E402

site_app = ASGIStaticFilesHandler(django_asgi_app) if settings.SERVE_STATIC else django_asgi_app
api_app = ApiHandler()  # /v1/: keys, not sessions; lean middleware (config/middleware.py)


async def http_app(scope: dict, receive: Any, send: Any) -> None:
    """The API's URLs to the lean handler, the rest (admin, pages, static) to Django's."""
    app = api_app if scope["path"].startswith(API_PREFIX) else site_app
    await app(scope, receive, send)


application = ProtocolTypeRouter({
    "http": http_app,
    "websocket": ApiKeyAuthMiddleware(URLRouter(websocket_urlpatterns)),
})
