"""The telemetry module without a model: fixed fields, the tick's sampling, the handler's
JSON lines, and /metrics' family of every daemon counter. A real daemon's lines:
tests/daemon/test_telemetry.py."""

from __future__ import annotations

import io
import json
import logging
import time
import uuid

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from scheduler_daemon.core.state import CacheEvent, TickStats
from scheduler_daemon.service import telemetry
from scheduler_daemon.service.telemetry import COMMON, FIELDS, Telemetry
from wire import protocol


def lines_of(caplog) -> list[dict]:
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == telemetry.LOGGER]


def stats(tick: int, tokens: int = 4) -> TickStats:
    return TickStats(tick, tokens, tokens, 0, 1, 0, 12.5, 0)


def test_a_tick_line_at_most_once_per_interval_carries_the_ticks_it_stands_for(caplog):
    now = [100.0]
    t = Telemetry("d1", "m", tick_every_s=1.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, telemetry.LOGGER):
        for tick in range(1, 6):  # 0.4 s apart: lines at ticks 1, 4
            t.on_tick(stats(tick), None)
            now[0] += 0.4
    got = lines_of(caplog)
    assert [(line["tick"], line["ticks"], line["tokens"]) for line in got] == [(1, 1, 4),
                                                                             (4, 3, 12)]
    assert all(list(line) == [*COMMON, *FIELDS["tick"]] for line in got)


def test_fields_are_fixed_missing_ones_null_and_no_other_accepted(caplog):
    t = Telemetry("d1", "m", cache_entries=lambda tier: {"ram": 3}.get(tier))
    with caplog.at_level(logging.INFO, telemetry.LOGGER):
        t.on_cache_event(CacheEvent("evict", "scope-1", 40, 4096))
        t.on_cache_event(CacheEvent("prefix_instability", "scope-1", 30, request_id="r1",
                                    history_tokens=121))
    cache, unstable = lines_of(caplog)
    assert {k: cache[k] for k in FIELDS["cache"]} == {
        "tier": "ram", "op": "evict", "bytes": 4096, "tokens": 40, "entries": 3, "reason": None}
    assert "scope-1" not in json.dumps([cache, unstable])
    assert (unstable["request_id"], unstable["matched_tokens"],
            unstable["cached_tokens"]) == ("r1", 30, 121)
    with pytest.raises(ValueError):
        t.emit("tick", prompt="text")


def test_the_handler_writes_json_alone_and_drops_rather_than_blocks(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr(telemetry, "QUEUE_LINES", 1)
    logger = logging.getLogger(telemetry.LOGGER)
    saved = logger.handlers[:], logger.propagate, logger.level
    listener = telemetry.install_handler(stream)
    try:
        handler = logger.handlers[-1]
        listener.stop()  # nothing drains the queue now: the second line must not wait
        t = Telemetry("d1", "m")
        t0 = time.monotonic()
        t.on_kv_pressure(7, 1, "purge_idle", 64, 64)
        t.on_kv_pressure(7, 2, "halve_batch", 64, 32)
        assert time.monotonic() - t0 < 1 and handler.dropped == 1
        listener.start()
    finally:
        telemetry.stop_listener(listener)
        logger.handlers[:], logger.propagate = saved[0], saved[1]
        logger.setLevel(saved[2])
    [line] = stream.getvalue().splitlines()
    assert json.loads(line)["event"] == "kv_pressure" and json.loads(line)["retry"] == 1


def test_metrics_export_every_daemon_counter_by_name(redis_client):
    daemon_id = f"telemetry-{uuid.uuid4().hex[:6]}"
    counters = {"ticks": 9, "disk_saves_finish": 2, "preempt_unsaved": 1, "Not A Name!": 5}
    snap = {"daemon_id": daemon_id, "model": "m", "heartbeat_at": time.time(),
            "counters": counters}
    redis_client.set(protocol.daemon_key(daemon_id), json.dumps(snap), ex=30)
    redis_client.zadd(protocol.DAEMONS_ZSET, {daemon_id: time.time()})
    try:
        reply = Client().get("/metrics")
    finally:
        redis_client.delete(protocol.daemon_key(daemon_id))
        redis_client.zrem(protocol.DAEMONS_ZSET, daemon_id)
    families = {f.name: f for f in text_string_to_metric_families(reply.content.decode())}
    exported = {s.labels["name"]: s.value for s in families["llm_daemon_counter"].samples
                if s.labels["daemon"] == daemon_id}
    assert exported == {"ticks": 9, "disk_saves_finish": 2, "preempt_unsaved": 1}

