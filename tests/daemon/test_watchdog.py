"""A hang is a crash: the supervisor kills a daemon whose loop stops turning, and restarts it.

The supervisor's watchdog reads the child's loop clock (scheduler_daemon/core/liveness.py) from
its own process. First with a stand-in child (a few lines of Python that mark the clock, then
stop marking), then with a real daemon (Gemma) whose loop is stopped for good by the
composition root's test hook (``run_scheduler.HANG_MARKER``, under ``FAULT_INJECTION``):
it holds the scheduler's lock and never returns, as a sampler stuck in native code would.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from scheduler_daemon.management.commands.run_scheduler import HANG_MARKER
from scheduler_daemon.service import supervisor
from scheduler_daemon.service.intake import job_fingerprint
from tests.live_service import wait_until
from wire import protocol

ROOT = Path(__file__).resolve().parents[2]
CHILD = textwrap.dedent("""
    import os, sys, time
    from scheduler_daemon.core.liveness import LoopClock
    runs = open(sys.argv[1], "a")
    runs.write(f"{os.environ['DAEMON_RESTARTS']}|{os.environ['DAEMON_LAST_EXIT']}\\n")
    runs.close()
    clock = LoopClock(os.environ["LOOP_CLOCK_FILE"])
    behaviour = sys.argv[2].split(",")[int(os.environ["DAEMON_RESTARTS"])]
    if behaviour == "unarmed":  # never marks (a model still loading): not a hang
        time.sleep(1.5)
        sys.exit(0)
    for _ in range(5):
        clock.mark()
        time.sleep(0.05)
    if behaviour == "hang":
        time.sleep(3600)
    if behaviour == "samplerhang":  # the loop enters a sampler call that never returns
        clock.sampling(True)
        time.sleep(3600)
    if behaviour == "samplers":  # many sampler calls, each short: no hang
        for _ in range(30):
            clock.sampling(True)
            time.sleep(0.02)
            clock.sampling(False)
            clock.mark()
            time.sleep(0.03)
    if behaviour == "callhang":  # the loop turns on, but a job's native call never returns
        import threading
        def call():
            with clock.calling():
                time.sleep(3600)
        threading.Thread(target=call, daemon=True).start()
        while True:
            clock.mark()
            time.sleep(0.05)
    if behaviour == "drain":  # stops its loop on purpose, then takes its time to exit
        clock.stop()
        time.sleep(1.5)
    clock.stop()  # as the core's loop does when it ends: the exit is no hang, however slow
    sys.exit(0)
""")


@pytest.fixture
def signals_restored():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def supervise_child(tmp_path, behaviours: str, deadline_s: float,
                    sampler_deadline_s: float = 0.0) -> tuple[int, list[str]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    runs = tmp_path / "runs.txt"
    status = supervisor.supervise(
        [sys.executable, str(script), str(runs), behaviours], sleep=lambda _s: None,
        tick_deadline_s=deadline_s, sampler_deadline_s=sampler_deadline_s,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    return status, runs.read_text().splitlines()


def test_a_child_whose_loop_stops_turning_is_killed_and_restarted(tmp_path, signals_restored):
    status, runs = supervise_child(tmp_path, "hang,hang,exit", deadline_s=0.5)
    assert status == 0
    assert [r.split("|")[0] for r in runs] == ["0", "1", "2"]
    assert runs[0] == "0|"
    assert runs[1].startswith("1|hung: no loop turn for ") and runs[1].endswith(" s, killed")


def test_a_native_call_off_the_loop_that_never_returns_is_a_hang_too(tmp_path,
                                                                     signals_restored):
    status, runs = supervise_child(tmp_path, "callhang,exit", deadline_s=0.5)
    assert status == 0 and [r.split("|")[0] for r in runs] == ["0", "1"]
    assert runs[1].startswith("1|hung: ")


def test_a_sampler_call_past_its_own_deadline_is_killed_before_the_turn_deadline(
        tmp_path, signals_restored):
    status, runs = supervise_child(tmp_path, "samplerhang,exit", deadline_s=3600,
                                   sampler_deadline_s=0.5)
    assert status == 0 and [r.split("|")[0] for r in runs] == ["0", "1"]
    assert runs[1].startswith("1|hung: ")


@pytest.mark.parametrize("behaviour", ["unarmed", "drain", "samplers"])
def test_a_loop_not_yet_started_or_stopped_on_purpose_is_no_hang(tmp_path, signals_restored,
                                                                  behaviour):
    status, runs = supervise_child(tmp_path, behaviour, deadline_s=0.5, sampler_deadline_s=0.5)
    assert status == 0 and runs == ["0|"]  # one run: never killed


# -- a real daemon ------------------------------------------------------------------------

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
# TICK_DEADLINE_S here: "stuck" is published after a quarter (5 s); a loaded 2-core machine
# can take a few seconds for a legitimate tick
DEADLINE_S = 20.0


def hang_job(daemon):
    return daemon.enqueue(prompt=f"Say {HANG_MARKER} now", params={"max_tokens": 8},
                          tenant_id="7", cache_scope="7")


def wait_for_restart(daemon, old_pid: int) -> dict:
    wait_until(lambda: daemon.snapshot().get("pid") not in (None, old_pid), timeout_s=120)
    return daemon.snapshot()


@pytest.mark.slow
def test_a_hung_loop_is_shown_stuck_then_killed_restarted_and_its_request_quarantined(
        make_daemon):
    """Another tenant's stream runs next to the hanging request at both hangs: it is
    continued each time and completes, its fingerprint has no death (the hang was the other
    request's sampler); the hanging request is quarantined at its second hang."""
    from inference.health import health_report

    daemon = make_daemon(FAULT_INJECTION="true", TICK_DEADLINE_S=str(DEADLINE_S),
                         N_PARALLEL="2").start(supervise=True)
    first = daemon.snapshot()
    assert first["loop"]["running"] and not first["loop"]["stuck"]
    assert first["restarts"] == 0 and first["last_exit"] is None
    other = daemon.enqueue(prompt="Tell me a long story.", params=LONG, tenant_id="8",
                           cache_scope="8")
    daemon.wait_for(other.id, "token")
    hang = hang_job(daemon)
    # stuck, not gone: the heartbeat goes on while the loop holds the scheduler's lock
    wait_until(lambda: daemon.snapshot().get("loop", {}).get("stuck_on") == hang.id,
               timeout_s=120)
    stuck = daemon.snapshot()
    assert stuck["pid"] == first["pid"] and stuck["stale"] is True and stuck["loop"]["stuck"]
    report = health_report()
    mine = [d for d in report["daemons"] if d["daemon_id"] == daemon.daemon_id]
    assert mine and mine[0]["stuck"] is True
    second = wait_for_restart(daemon, first["pid"])
    assert second["restarts"] >= 1 and second["last_exit"].startswith("hung: ")
    _, kind, data = daemon.events(hang.id, timeout_s=240)[-1]
    assert kind == "error" and data["code"] == "request_quarantined", data
    events = daemon.events(other.id, timeout_s=240)
    _, kind, data = events[-1]
    assert (kind, data.get("finish_reason")) == ("done", "length"), (events[-1],
                                                                      daemon.log_tail(80))
    assert data["resumed"] == 2  # continued after each hang
    tokens = [d for _, k, d in events if k == "token"]
    assert sum(d["n_tokens"] for d in tokens) == LONG["max_tokens"]
    assert not daemon.redis.exists(protocol.deaths_key(job_fingerprint(other)))
    assert len(daemon.redis.smembers(protocol.deaths_key(job_fingerprint(hang)))) == 2
    third = daemon.snapshot()
    assert third["restarts"] == 2 and third["loop"]["stuck"] is False
    log = daemon.log_path.read_text()
    assert log.count("has not completed a loop turn") == 2
    again = hang_job(daemon)  # refused before it reaches the loop: no third hang
    _, kind, data = daemon.events(again.id)[-1]
    assert kind == "error" and data["code"] == "request_quarantined"
    assert daemon.snapshot()["pid"] == third["pid"]
    daemon.redis.hdel(protocol.QUARANTINE_HASH, job_fingerprint(hang))
