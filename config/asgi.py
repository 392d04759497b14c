"""ASGI entry point for daphne: `daphne config.asgi:application`.

HTTP goes to Django (static files too, when SERVE_STATIC; the /v1/ API runs a lean share
of the middleware, config/middleware.py); websockets to the Channels consumers,
authenticated by API key (no Origin check: keys, not cookies, carry identity).

The root path (Django's script name) is ``settings.ROOT_PATH``, not what daphne puts in the
scope: daphne takes it from a client's ``Daphne-Root-Path`` header, which would let any
client move the line between the API and the site (``/v1/admin/`` with root path ``/v1``
reached the admin through the API's middleware). ``TRUST_ROOT_PATH_HEADER`` keeps daphne's
value, for a proxy that sets the header itself.
"""

import gc
import os
from typing import Any

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")
django_asgi_app = get_asgi_application()  # sets Django up before anything imports models

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402
from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler  # noqa: E402
from django.urls import get_resolver  # noqa: E402

from inference.auth import ApiKeyAuthMiddleware  # noqa: E402
from inference.routing import websocket_urlpatterns  # noqa: E402

http_app = ASGIStaticFilesHandler(django_asgi_app) if settings.SERVE_STATIC else django_asgi_app


class TrustedRootPath:
    """Sets each connection's ``root_path`` to ``settings.ROOT_PATH`` (the client cannot
    choose it), unless ``settings.TRUST_ROOT_PATH_HEADER`` says daphne's is a proxy's."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and not settings.TRUST_ROOT_PATH_HEADER:
            scope = {**scope, "root_path": settings.ROOT_PATH}
        await self.app(scope, receive, send)


application = TrustedRootPath(ProtocolTypeRouter({
    "http": http_app,
    "websocket": ApiKeyAuthMiddleware(URLRouter(websocket_urlpatterns)),
}))

# What is loaded by now (Django, the apps, the URL conf and the views it imports) lives as
# long as the process: out of the collector's reach (gc.freeze), a full collection no longer
# walks it. Unfrozen, each one took 60-65 ms and collected nothing, every ~3 s while 256
# streams ran: every stream's chunk waited (bench/web_capacity.py).
get_resolver().url_patterns  # noqa: B018 - loads the URL conf and the views now
gc.collect()  # start-up's garbage goes first: frozen, it would never be collected
gc.freeze()
