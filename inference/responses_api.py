"""POST /v1/responses, GET and DELETE /v1/responses/<id> (OpenAI's Responses API).

Being built (issue 37): the routes exist, the views answer 404 until then."""
from __future__ import annotations

from adrf.views import APIView
from rest_framework.request import Request

from inference.errors import ApiError


class ResponsesView(APIView):
    async def post(self, request: Request) -> None:
        raise ApiError("not_found", "/v1/responses is not served yet")


class ResponseDetailView(APIView):
    async def get(self, request: Request, response_id: str) -> None:
        raise ApiError("not_found", "/v1/responses is not served yet")
