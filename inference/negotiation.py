"""The API's content negotiation (REST_FRAMEWORK's DEFAULT_CONTENT_NEGOTIATION_CLASS)."""
from __future__ import annotations

from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.renderers import BaseRenderer
from rest_framework.request import Request


class JsonAlways(DefaultContentNegotiation):
    """The API answers JSON (or SSE, when the body asks for a stream) whatever ``Accept``
    says: an SSE client's ``text/event-stream`` is no reason for a 406 (DRF's documented
    custom negotiation: the view's first renderer). Parsers are chosen as DRF does."""

    def select_renderer(self, request: Request, renderers: list[BaseRenderer],
                        format_suffix: str | None = None) -> tuple[BaseRenderer, str]:
        return renderers[0], renderers[0].media_type
