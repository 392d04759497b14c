"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API).

Being built (issue 37): the routes exist, the views answer 404 until then."""
from __future__ import annotations

from adrf.views import APIView
from rest_framework.request import Request

from inference.errors import ApiError


class MessagesView(APIView):
    async def post(self, request: Request) -> None:
        raise ApiError("not_found", "/v1/messages is not served yet")


class CountTokensView(APIView):
    async def post(self, request: Request) -> None:
        raise ApiError("not_found", "/v1/messages is not served yet")
