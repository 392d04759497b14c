"""A burst through a real daemon (Gemma), taken by the intake in one pass: by default its
prompts finish one a tick, oldest first, beside the earlier ones' decodes; with
PREFILL_PROMPTS_PER_TICK=0 all of them are prefilled in the first tick, as llama-server's
first batch holds every slot its requests reached (docs/scheduler.md, "A burst")."""

from __future__ import annotations

import pytest

from .test_daemon import send, wait_snapshot
from .test_telemetry import telemetry_lines

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 40


def burst_ticks(daemon) -> list[dict]:
    """Four jobs taken in one pass (enqueued while the daemon is drained), run to their
    ends; the daemon's tick lines, first tick first."""
    send(daemon, "drain")  # the intake takes nothing until resumed: then all four at once
    try:
        wait_snapshot(daemon, lambda s: s["draining"])
        jobs = [daemon.enqueue(prompt=list(range(1000 + 100 * i, 1000 + 100 * i + PROMPT_TOKENS)),
                               params={"temperature": 0, "max_tokens": 8})
                for i in range(4)]
    finally:
        send(daemon, "resume")
    for job in jobs:
        assert daemon.events(job.id)[-1][1] == "done"
    return sorted((line for line in telemetry_lines(daemon) if line["event"] == "tick"),
                  key=lambda line: line["tick"])


def test_a_burst_of_four_finishes_one_prompt_a_tick(make_daemon):
    daemon = make_daemon(N_PARALLEL="4", TELEMETRY_TICK_S="0").start()
    ticks = burst_ticks(daemon)
    shapes = [(t["prefill_tokens"], t["decode_tokens"]) for t in ticks[:5]]
    assert shapes == [(PROMPT_TOKENS, 0), (PROMPT_TOKENS, 1), (PROMPT_TOKENS, 2),
                      (PROMPT_TOKENS, 3), (0, 4)], ticks[:5]


def test_unlimited_a_burst_taken_in_one_pass_is_prefilled_in_the_first_tick(make_daemon):
    daemon = make_daemon(N_PARALLEL="4", TELEMETRY_TICK_S="0",
                         PREFILL_PROMPTS_PER_TICK="0").start()
    ticks = burst_ticks(daemon)
    first = ticks[0]
    assert (first["prefill_tokens"], first["decode_tokens"]) == (4 * PROMPT_TOKENS, 0), ticks[:3]
    assert first["active_slots"] == 4
