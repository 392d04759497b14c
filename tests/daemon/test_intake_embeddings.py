"""The intake's count of what it holds (#31): embeddings jobs are bounded apart, so a burst
of them leaves generation's room (N_PARALLEL + LOCAL_QUEUE) to other tenants' chats. A
real EventWriter and Redis, a fake core (pure policy; the live burst test is in
tests/test_embeddings_e2e.py)."""

from __future__ import annotations

import uuid

from scheduler_daemon.core.lifecycle import Lifecycle
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.event_writer import EventWriter
from scheduler_daemon.service.intake import Intake
from tests.live_service import redis_conn
from wire import protocol


class Core:
    def loop_state(self) -> dict:
        return {"stuck": False}


def job(kind: str, tenant: str = "a") -> protocol.Job:
    return protocol.Job(id=uuid.uuid4().hex, kind=kind, model="m", tenant_id=tenant,
                        cache_scope=tenant, prompt=[[1, 2]] if kind == "embedding" else "hi")


def test_embeddings_jobs_leave_generation_s_room_to_other_tenants():
    client = redis_conn()
    lifecycle = Lifecycle()
    ctx = DaemonContext(client, "m", "d", lifecycle)
    writer = EventWriter(ctx)
    intake = Intake(ctx, Core(), writer, capacity=4)
    burst = [job("embedding") for _ in range(10)]
    for j in burst[:6]:  # started: live in the writer, held by the core
        writer.track(j.id, j.tenant_id)
        intake._embeddings.add(j.id)
    for j in burst[6:]:  # read, not yet started
        intake.prepare.put(f"e-{j.id}", j)
    assert intake.held() == 0 and intake.room() == 4
    chat = job("chat", tenant="b")
    intake.prepare.put("c", chat)
    assert intake.held() == 1
    assert intake.prepare.get(0)[1].kind == "embedding"  # tenant a's turn first
    assert intake.prepare.get(0)[1] is chat  # then b's: taken out of the queue
    writer.track(chat.id, chat.tenant_id)  # ... and started
    assert intake.held() == 1 and intake.prepare.apart == 3
