"""Requests of several choices (n > 1, or a list of prompts): each choice is a request of
the scheduler's (``<id>#<i>``), and their events are merged into the request's.

``InferenceCore`` owns one ``ChoiceGroups``; its state is guarded by the scheduler's lock
(``merge`` runs in the scheduler's event callback, which holds it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from wire import errors
from wire.errors import Refusal
from wire.sampling import SamplingParams

from .scheduler import Scheduler
from .state import Choice, Event, FinishedEvent, Request, RequestStats, TokenEvent


@dataclass(slots=True)
class ChoiceGroup:
    """The n choices of one request and how far they are."""

    id: str
    n: int
    prompt_tokens: int
    finished: dict[int, FinishedEvent] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)  # choices whose end has not come
    abandoned: bool = False  # handed back or refused: its choices' ends go nowhere

    def __post_init__(self) -> None:
        self.pending = set(range(self.n))

    def merged(self) -> FinishedEvent:
        """The request's end: the prompt counted once, the completions summed; an error of
        any choice is the request's."""
        ends = [self.finished[i] for i in range(self.n)]
        failed = next((e for e in ends if e.error is not None), None)
        stats = [e.stats for e in ends]
        present = lambda values: [v for v in values if v is not None]  # noqa: E731
        merged = RequestStats(
            prompt_tokens=self.prompt_tokens,
            cached_tokens=stats[0].cached_tokens,
            completion_tokens=sum(s.completion_tokens for s in stats),
            queue_ms=min(present(s.queue_ms for s in stats), default=None),
            ttft_ms=min(present(s.ttft_ms for s in stats), default=None),
            duration_ms=max(s.duration_ms for s in stats),
            prompt_eval_rate=stats[0].prompt_eval_rate,
            generation_rate=sum(present(s.generation_rate for s in stats)) or None,
            prompt_evaluated=sum(s.prompt_tokens - s.cached_tokens for s in stats),
            cache_tier=stats[0].cache_tier,
            cache_created_tokens=sum(s.cache_created_tokens for s in stats),
            cache_hit=stats[0].cache_hit,
        )
        head = failed or ends[0]
        return FinishedEvent(self.id, head.finish_reason, merged, stop=ends[0].stop,
                             error=failed.error if failed else None,
                             choices=tuple(Choice(i, e.finish_reason, e.stop)
                                           for i, e in enumerate(ends)))


class ChoiceGroups:
    """The requests of several choices in flight. ``handles``: the core's request handles
    (by request id), shared: a group's handle goes in and out with it."""

    def __init__(self, scheduler: Scheduler, handles: dict[str, Any]) -> None:
        self.scheduler = scheduler
        self.handles = handles
        self.groups: dict[str, ChoiceGroup] = {}  # by request id
        self.siblings: dict[str, tuple[ChoiceGroup, int]] = {}  # by choice id: group, index

    def enqueue(self, prompts: list[list[int]], prompt_tokens: int, request_id: str,
                handle: Any, params: SamplingParams, common: dict[str, Any]) -> int:
        """Queue the choices of one request, one per prompt in ``prompts`` (see
        ``InferenceCore.enqueue``); ``prompt_tokens``: what the request's usage counts (each
        distinct prompt once). ``common``: the ``Request`` fields every choice shares."""
        n = len(prompts)
        group = ChoiceGroup(request_id, n, prompt_tokens)
        with self.scheduler.lock:
            if request_id in self.handles or request_id in self.groups or any(
                    f"{request_id}#{i}" in self.scheduler.request_ids() for i in range(n)):
                raise Refusal(errors.DUPLICATE_ID, f"request id {request_id} is already in use")
            self.groups[request_id] = group
            for i in range(n):
                self.siblings[f"{request_id}#{i}"] = (group, i)
            if handle is not None:
                self.handles[request_id] = handle
        submitted: list[str] = []
        try:
            for i in range(n):
                seed = None if params.seed is None else (params.seed + i) % (2**32 - 1)
                self.scheduler.submit(Request(id=f"{request_id}#{i}", prompt_tokens=prompts[i],
                                              params=dataclasses.replace(params, seed=seed),
                                              **common))
                submitted.append(f"{request_id}#{i}")
        except BaseException:
            with self.scheduler.lock:
                group.abandoned = True  # its choices' ends are not the request's
                self.handles.pop(request_id, None)
                for i in range(len(submitted), n):  # never queued: no end will come
                    self.siblings.pop(f"{request_id}#{i}", None)
                    group.pending.discard(i)
                if not group.pending:
                    self.groups.pop(request_id, None)
            for sibling in submitted:
                self.scheduler.cancel(sibling)  # their ends come later and go nowhere
            raise
        return prompt_tokens

    def parents_handed_back(self, ids: list[str]) -> list[str]:
        """Handed-back ids as the daemon's requests: a choice hands its whole request back
        (its other choices' ends are then not sent: the next daemon decides)."""
        out: list[str] = []
        with self.scheduler.lock:
            for request_id in ids:
                sibling = self.siblings.get(request_id)
                if sibling is None:
                    out.append(request_id)
                    continue
                group = sibling[0]
                if not group.abandoned:
                    group.abandoned = True
                    out.append(group.id)
        return out

    def merge(self, event: Event) -> Event | None:
        """A choice's event as its request's (None: nothing to send yet). The scheduler's
        lock is held."""
        group, index = self.siblings[event.request_id]
        if isinstance(event, TokenEvent):
            if group.abandoned:
                return None
            return TokenEvent(group.id, event.text, event.n_tokens, event.tokens,
                              event.logprobs, index)
        assert isinstance(event, FinishedEvent)
        del self.siblings[event.request_id]
        group.finished[index] = event
        group.pending.discard(index)
        if group.pending:
            return None
        self.groups.pop(group.id, None)
        if group.abandoned:
            return None
        return group.merged()

    def cancel(self, request_id: str) -> bool | None:
        """Cancel every choice of the request ``request_id`` without waiting for the
        scheduler's lock; None: no such request of several choices."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        results = [self.scheduler.cancel(f"{request_id}#{i}", block=False)
                   for i in range(group.n)]
        return any(r is not False for r in results)
