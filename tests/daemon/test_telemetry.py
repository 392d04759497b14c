"""Telemetry as an interface (docs/observability.md): a real daemon (Gemma) logs each event
as one JSON line with its fixed fields and no prompt text, and /metrics exports every
counter the daemon publishes."""

from __future__ import annotations

import json
import time

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from scheduler_daemon.service.telemetry import COMMON, FIELDS
from tests.live_service import wait_until

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0}
# prompts as token ids, so that the shares of a cached history are exact
HISTORY = list(range(1000, 1120))  # 120 tokens
REWRITTEN = HISTORY[:30] + list(range(3000, 3040))  # keeps 30 of ~124 cached: 10-50%
LONG = list(range(5000, 5380))  # with 480 tokens of KV reserved it fills what idle slots hold


def telemetry_lines(daemon) -> list[dict]:
    out = []
    for line in daemon.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))  # a line that starts a JSON object is one, whole
    return out


def test_each_event_is_logged_with_its_fields_and_every_counter_is_exported(make_daemon,
                                                                            tmp_path):
    daemon = make_daemon(
        N_CTX="512", N_PARALLEL="2", KV_TENANT_SHARE="1.0", IDLE_SLOTS_TO_RAM="false",
        PROMPT_CACHE_DIR=str(tmp_path / "cache"), PROMPT_CACHE_DISK_MIN_TOKENS="16",
        TELEMETRY_TICK_S="0",
    ).start()
    first = daemon.enqueue(prompt=HISTORY, params={**GREEDY, "max_tokens": 4})
    assert daemon.events(first.id)[-1][1] == "done"
    rewritten = daemon.enqueue(prompt=REWRITTEN, params={**GREEDY, "max_tokens": 4})
    assert daemon.events(rewritten.id)[-1][1] == "done"
    # another tenant's long request: the idle slots' cached prefixes no longer fit beside it
    pressing = daemon.enqueue(prompt=LONG, cache_scope="2", tenant_id="2",
                              params={**GREEDY, "max_tokens": 100, "ignore_eos": True})
    assert daemon.events(pressing.id)[-1][1] == "done"
    refused = daemon.enqueue(prompt="The river " * 10, params={"max_tokens": 1000})
    assert daemon.events(refused.id)[-1][2]["code"] == "context_length_exceeded"

    deadline = time.monotonic() + 30  # the ends are logged after their events are written
    while True:
        by_event: dict[str, list[dict]] = {}
        for line in telemetry_lines(daemon):
            by_event.setdefault(line["event"], []).append(line)
        missing = set(FIELDS) - set(by_event)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing, f"never logged: {sorted(missing)}"
    for event, lines in by_event.items():
        for line in lines:
            assert list(line) == [*COMMON, *FIELDS[event]], line  # fixed fields, in order
            assert line["daemon_id"] == daemon.daemon_id and line["model"] == daemon.model
    assert not [line for lines in by_event.values() for line in lines
                if "river" in json.dumps(line).lower()]  # no prompt text

    starts = {line["request_id"]: line for line in by_event["request.start"]}
    assert starts[first.id]["prompt_tokens"] == len(HISTORY)
    assert starts[rewritten.id]["cached_tokens"] == 30
    assert refused.id not in starts  # refused before it reached a slot
    ends = {line["request_id"]: line for line in by_event["request.done"]}
    assert ends[pressing.id]["completion_tokens"] == 100 and ends[first.id]["tenant_id"] == "1"
    [exception] = [line for line in by_event["request.exception"]
                   if line["request_id"] == refused.id]
    assert exception["error_code"] == "context_length_exceeded"
    assert any(line["tick"] and line["batch_tokens"] for line in by_event["tick"])
    assert {line["remedy"] for line in by_event["kv_pressure"]} & {"purge_idle", "halve_batch"}
    [unstable] = by_event["prefix_instability"]
    assert (unstable["request_id"], unstable["matched_tokens"]) == (rewritten.id, 30)
    ops = {(line["tier"], line["op"], line["reason"]) for line in by_event["cache"]}
    assert ("ram", "save", None) in ops and ("disk", "save", "finish") in ops
    assert all(line["entries"] >= 1 and line["bytes"] > 0 for line in by_event["cache"])

    # every counter of the published snapshot, exported with its value
    def settled() -> dict:
        counters = daemon.snapshot().get("counters") or {}
        return counters if counters.get("kv_pressure") and counters.get("disk_saves") else {}

    counters = wait_until(settled, timeout_s=30)
    time.sleep(1.5)  # a heartbeat later: the daemon is idle, its counters hold still
    counters = daemon.snapshot()["counters"]
    reply = Client().get("/metrics")
    assert reply.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(reply.content.decode())}
    exported = {s.labels["name"]: s.value for s in families["llm_daemon_counter"].samples
                if s.labels["daemon"] == daemon.daemon_id}
    assert exported == {name: float(value) for name, value in counters.items()}
    assert {"kv_pressure", "prefix_instability", "ram_save", "disk_saves"} <= set(exported)
