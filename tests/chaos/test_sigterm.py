"""SIGTERM with requests queued inside the daemon and one streaming past the grace: nothing
is cancelled, everything is handed back and served after the restart (the streaming one
continued where it was)."""
from __future__ import annotations

import signal

import pytest

from wire import protocol

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 400, "ignore_eos": True, "temperature": 0}
SHORT = {"max_tokens": 6, "temperature": 0}


@pytest.mark.parametrize("same_id", [True, False], ids=["restarted-same-id", "another-daemon"])
def test_sigterm_hands_back_what_it_did_not_finish(make_daemon, same_id):
    first = make_daemon(N_PARALLEL="1", LOCAL_QUEUE="3").start(grace_s=1)
    running = first.enqueue(prompt="Tell me a long story.", params=LONG)
    first.wait_for(running.id, "token")
    queued = [first.enqueue(prompt=f"The capital of France is ({i})", params=SHORT)
              for i in range(3)]
    for job in queued:
        first.wait_for(job.id, "accepted")
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(120) == 0
    r = first.redis
    for job in [running, *queued]:  # no end written: nothing was cancelled
        kinds = [protocol.decode_event(f)[0] for _, f in r.xrange(protocol.events_stream(job.id))]
        assert not set(kinds) & protocol.TERMINAL, (job.id, kinds)
    # a hand-back is no crash: no death is counted toward the quarantine
    assert not r.exists(protocol.running_key(first.daemon_id))
    assert r.exists(protocol.gone_key(first.daemon_id))  # its jobs are free to take at once
    pending = r.xpending(protocol.jobs_stream(first.model), protocol.JOBS_GROUP)
    assert pending["pending"] == 4
    second = make_daemon(model=first.model)
    second.start(daemon_id=first.daemon_id if same_id else None)
    for job in queued:
        _, kind, done = second.events(job.id)[-1]
        assert (kind, done["resumed"]) == ("done", 1)
    events = second.events(running.id)
    _, kind, done = events[-1]
    assert (kind, done["finish_reason"], done["resumed"]) == ("done", "length", 1)
    assert sum(d["n_tokens"] for _, k, d in events if k == "token") == 400
    # every entry ended is deleted: the stream keeps no job (nor its prompt)
    assert r.xlen(protocol.jobs_stream(first.model)) == 0
