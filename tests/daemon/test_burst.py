"""A burst through a real daemon (Gemma): jobs the intake takes in one pass are prefilled in
the daemon's first tick, all of them, as llama-server's first batch holds every slot its
requests reached (docs/scheduler.md, "A burst's first tick")."""

from __future__ import annotations

import pytest

from .test_daemon import send, wait_snapshot
from .test_telemetry import telemetry_lines

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 40


def test_a_burst_of_four_taken_in_one_pass_is_prefilled_in_the_first_tick(make_daemon):
    daemon = make_daemon(N_PARALLEL="4", TELEMETRY_TICK_S="0").start()
    send(daemon, "drain")  # the intake takes nothing until resumed: then all four at once
    try:
        wait_snapshot(daemon, lambda s: s["draining"])
        jobs = [daemon.enqueue(prompt=list(range(1000 + 100 * i, 1000 + 100 * i + PROMPT_TOKENS)),
                               params={"temperature": 0, "max_tokens": 4})
                for i in range(4)]
    finally:
        send(daemon, "resume")
    for job in jobs:
        assert daemon.events(job.id)[-1][1] == "done"
    ticks = [line for line in telemetry_lines(daemon) if line["event"] == "tick"]
    first = min(ticks, key=lambda line: line["tick"])
    assert (first["prefill_tokens"], first["decode_tokens"]) == (4 * PROMPT_TOKENS, 0), ticks[:3]
    assert first["active_slots"] == 4
