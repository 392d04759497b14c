"""What /v1/health reports. Grows to read the daemons' snapshots from Redis."""

from typing import Any

from django.conf import settings


def health_report() -> dict[str, Any]:
    """A JSON-ready summary; answering at all means the web process is up."""
    return {"status": "ok", "scheduler": "unavailable", "model": settings.MODEL_NAME}
