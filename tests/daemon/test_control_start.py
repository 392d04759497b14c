"""Operator commands from the daemon's start on: one sent after the daemon was put together
but before its control thread's first read is carried out (with "$" taken at that read it
was lost: a drain sent right after a daemon came up did nothing, tests/daemon/test_burst.py
saw it); a former run's commands left in the stream are not replayed."""

from __future__ import annotations

import threading
import time
import uuid

from scheduler_daemon.core.lifecycle import Lifecycle, State
from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.control import Control
from tests.live_service import redis_conn
from wire import protocol


def paused_daemon() -> tuple[DaemonContext, Lifecycle]:
    client, lifecycle = redis_conn(), Lifecycle()
    ctx = DaemonContext(client, f"m-{uuid.uuid4().hex[:6]}", f"d-{uuid.uuid4().hex[:8]}",
                        lifecycle)
    assert lifecycle.move(State.SERVING) and lifecycle.move(State.PAUSING)
    assert lifecycle.move(State.PAUSED)
    return ctx, lifecycle


def command(ctx: DaemonContext, action: str) -> None:
    ctx.redis.xadd(protocol.control_stream(ctx.daemon_id), protocol.encode_command(action))


def run_loop(control: Control) -> threading.Thread:
    loop = threading.Thread(target=control.command_loop)
    loop.start()
    return loop


def test_a_command_sent_before_the_loops_first_read_is_carried_out():
    ctx, lifecycle = paused_daemon()
    control = Control(ctx, None, lambda: None)
    command(ctx, "resume")  # the daemon is up; its control thread has not read yet
    loop = run_loop(control)
    try:
        assert lifecycle.wait_for({State.SERVING}, timeout=10)
    finally:
        lifecycle.move(State.DRAINING) and lifecycle.move(State.STOPPING)
        loop.join(10)
        assert not loop.is_alive()
        ctx.redis.delete(protocol.control_stream(ctx.daemon_id))


def test_a_former_runs_commands_are_not_replayed():
    ctx, lifecycle = paused_daemon()
    command(ctx, "resume")  # left by a run before this one
    control = Control(ctx, None, lambda: None)
    loop = run_loop(control)
    try:
        time.sleep(1.2)  # two of the loop's blocking reads
        assert lifecycle.state is State.PAUSED
    finally:
        lifecycle.move(State.DRAINING) and lifecycle.move(State.STOPPING)
        loop.join(10)
        assert not loop.is_alive()
        ctx.redis.delete(protocol.control_stream(ctx.daemon_id))
