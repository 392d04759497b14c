"""Where the daemon reports a request's history: a sink it is given.

The daemon closes every row it touches, so history is right even when no client is
listening any more; the writer behind the sink (``inference.history.DatabaseHistory``, given
by ``run_scheduler``) owns the rows. A sink never raises: history must not stop token
delivery. Tests and benchmarks that run a daemon without a database use ``NoHistory``.
"""

from __future__ import annotations

from typing import Any, Protocol


class HistorySink(Protocol):
    def mark_running(self, request_id: str, prompt_tokens: int) -> None: ...

    def mark_finished(self, request_id: str, finish_reason: str, usage: dict[str, Any] | None,
                      timings: dict[str, Any] | None, error_code: str = "") -> None: ...


class NoHistory:
    """A sink that keeps nothing."""

    def mark_running(self, request_id: str, prompt_tokens: int) -> None:
        pass

    def mark_finished(self, request_id: str, finish_reason: str, usage: dict[str, Any] | None,
                      timings: dict[str, Any] | None, error_code: str = "") -> None:
        pass
