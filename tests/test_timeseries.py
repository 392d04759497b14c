"""The service's own time series (wire/timeseries.py) on a real Redis: samples written by
two daemons and read back as series, the rollup tiers, each tier's TTL, the web's cumulative
refusal counts (resets included), the cap on tenants per sample, and the daemon's sampler
(scheduler_daemon/service/timeseries.py) through a Redis outage."""

from __future__ import annotations

import logging
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from scheduler_daemon.service.context import DaemonContext
from scheduler_daemon.service.telemetry import Telemetry
from scheduler_daemon.service.timeseries import Sampler
from tests.live_service import free_port
from wire import limits, timeseries
from wire.timeseries import Sample

HOUR = 3600
# A past hour of our own (aligned to every tier): no live daemon writes there.
BASE = timeseries.bucket_start(1_700_000_000, 1800) + 7200


@pytest.fixture
def r(redis_client):
    def clean():
        keys = [k for k in redis_client.scan_iter(f"{timeseries._KEY}:*", count=1000)
                if int(k.removesuffix(b":tenants").rsplit(b":", 1)[1]) < time.time() - 86400]
        # (never a live daemon's)
        if keys:
            redis_client.delete(*keys)
    clean()
    yield redis_client
    clean()


def put(r, sample: Sample, now: float, retention_s: int = timeseries.DEFAULT_RETENTION_S):
    pipe = r.pipeline(transaction=False)
    timeseries.write(pipe, sample, now, retention_s)
    pipe.execute()


def test_two_daemons_samples_read_back_as_series(r):
    now = BASE + 5
    put(r, Sample("d1", "m", running=2, waiting=1, queued=4, prompt_tokens=100,
                  completion_tokens=30, cached_tokens=40, requests=2, ttft={2: 1, 3: 1},
                  tenant_tokens={"7": 120, "8": 10}, refused={"context_length_exceeded": 1}),
        now)
    put(r, Sample("d2", "m", running=1, waiting=0, queued=4, prompt_tokens=60,
                  completion_tokens=10, cached_tokens=20, requests=1, ttft={5: 1},
                  tenant_tokens={"8": 70}), now + 1)
    put(r, Sample("d3", "other", running=1, queued=0), now + 2)
    view = timeseries.read(r, HOUR, now=BASE + 9)
    assert view.step == 10 and view.starts[-1] == BASE and len(view.starts) == 360
    assert view.tokens_per_s["prompt"][-1] == pytest.approx(160 / 9)
    assert view.tokens_per_s["completion"][-1] == pytest.approx(40 / 9)
    assert view.tokens_per_s["prompt"][0] is None  # nothing was written there
    assert view.requests[-1] == 3
    assert view.running == {"m": [None] * 359 + [3.0], "other": [None] * 359 + [1.0]}
    assert view.waiting["m"][-1] == 1.0
    assert view.queued["m"][-1] == 4.0  # the model's queue, seen by both: not added up
    assert view.cache_hit_ratio[-1] == pytest.approx(60 / 160, abs=1e-4)
    # TTFTs in (50,100], (100,250], (500,1000]: the median in the second bucket
    assert 100 < view.ttft_ms["p50"][-1] <= 250 and 500 < view.ttft_ms["p99"][-1] <= 1000
    assert view.ttft_range_ms["p50"] == view.ttft_ms["p50"][-1]
    assert view.refusals == {"context_length_exceeded": [0] * 359 + [1]}
    assert view.top_tenants == [("7", 120), ("8", 80)]
    assert view.daemons[-1] == 3


def test_a_gauge_is_the_mean_of_a_daemons_samples_and_coarse_tiers_roll_up(r):
    for i, running in enumerate((1, 3, 2, 2, 2, 2)):  # a minute of 10 s samples
        put(r, Sample("d1", "m", running=running, completion_tokens=10), BASE + 10 * i)
    six_hours = timeseries.read(r, 6 * HOUR, now=BASE + 60)
    assert six_hours.step == 60 and len(six_hours.starts) == 360
    at = six_hours.starts.index(BASE)
    assert six_hours.running["m"][at] == 2.0
    assert six_hours.tokens_per_s["completion"][at] == 1.0  # 60 tokens in 60 s
    assert timeseries.read(r, 86400, now=BASE + 60).step == 300
    week = timeseries.read(r, 7 * 86400, now=BASE + 60)
    assert week.step == 1800 and len(week.starts) == 336
    assert week.running["m"][-1] == 2.0 and week.requests[-1] == 0


def test_every_range_is_read_in_bounded_buckets():
    for range_s in timeseries.RANGES_S.values():
        step = timeseries.tier_for(range_s, timeseries.DEFAULT_RETENTION_S)
        assert range_s / step <= timeseries.MAX_POINTS
        assert timeseries.keep_s(step, timeseries.DEFAULT_RETENTION_S) >= range_s
    # a short retention: a range is read from the tier that still keeps it
    assert timeseries.tier_for(HOUR, 1800) == 10


def test_each_tier_expires_with_its_keep_within_the_retention(r):
    put(r, Sample("d1", "m", running=1), BASE, retention_s=3 * HOUR)
    ttl = {step: r.ttl(timeseries.bucket_key(step, BASE)) for step, _ in timeseries.TIERS}
    assert 7200 - 5 <= ttl[10] <= 7200  # 720 buckets of 10 s
    assert 3 * HOUR - 5 <= ttl[60] <= 3 * HOUR  # 12 h of buckets, cut to the retention
    assert 3 * HOUR - 5 <= ttl[1800] <= 3 * HOUR
    put(r, Sample("d1", "m"), BASE)
    assert timeseries.keep_s(1800, timeseries.DEFAULT_RETENTION_S) == 7 * 86400
    assert r.ttl(timeseries.bucket_key(1800, BASE)) > 7 * 86400 - 5


def limit_counts(**counts: int) -> dict[str, int]:
    return {code: counts.get(code, 0) for code in timeseries.LIMIT_CODES}


def test_cumulative_refusals_are_charted_as_differences_resets_included(r):
    writes = [  # (seconds after BASE, rpm_exceeded since the counters began)
        (0, 5),    # the range's first bucket: from its own first count (nothing before)
        (1, 7),    # +2 in the same bucket
        (10, 9),   # +2 from the bucket before's last
        (30, 1),   # a reset (Redis lost the hash): 1 counted from zero, bucket 20 missing
        (40, 4),   # +3
    ]
    for offset, count in writes:
        put(r, Sample("d1", "m", limit_refusals=limit_counts(rpm_exceeded=count)),
            BASE + offset)
    view = timeseries.read(r, HOUR, now=BASE + 45)
    at = view.starts.index(BASE)
    assert view.refusals == {"rpm_exceeded": [0] * at + [2, 2, 0, 1, 3]}
    # a sample without the claim writes no counts (another daemon samples them)
    put(r, Sample("d2", "m"), BASE + 41)
    assert timeseries.read(r, HOUR, now=BASE + 45).refusals == view.refusals


def test_the_bucket_before_the_range_is_the_baseline(r):
    put(r, Sample("d1", "m", limit_refusals=limit_counts(tpm_exceeded=3)), BASE - 3597)
    put(r, Sample("d1", "m", limit_refusals=limit_counts(tpm_exceeded=8)), BASE + 5)
    view = timeseries.read(r, HOUR, now=BASE + 5)
    assert view.starts[0] == BASE - 3590  # the bucket before it is read, not shown
    assert view.refusals["tpm_exceeded"] == [0] * 359 + [5]


def test_one_daemon_claims_the_shared_counts_per_bucket(r):
    assert timeseries.claim(r, "d1", BASE + 1)
    assert not timeseries.claim(r, "d2", BASE + 2)
    assert timeseries.claim(r, "d2", BASE + 11)  # the next bucket
    r.delete(timeseries.claim_key(BASE), timeseries.claim_key(BASE + 10))


def test_a_bucket_names_at_most_its_cap_of_tenants_the_rest_are_others(r):
    for first in range(0, 100, 25):  # four samples of 25 tenants each: 100 in the bucket
        tokens = {str(t): 1000 - t for t in range(first, first + 25)}
        put(r, Sample("d1", "m", completion_tokens=sum(tokens.values()), tenant_tokens=tokens),
            BASE)
    everything = sum(1000 - t for t in range(100))
    for step, _ in timeseries.TIERS:
        ranked = r.zrange(timeseries.tenants_key(step, BASE), 0, -1, withscores=True)
        assert len(ranked) == timeseries.MAX_TENANTS_PER_BUCKET
    top = timeseries.read(r, HOUR, now=BASE + 1, top=3).top_tenants
    assert top == [("0", 1000), ("1", 999), ("2", 998),
                   (timeseries.OTHER_TENANTS, everything - 1000 - 999 - 998)]
    assert timeseries.top_of({"a": 1, "b": 3, "c": 2, "d": 0}, most=2) == {"b": 3, "c": 2}


def test_percentiles_from_the_histogram():
    counts = [0] * (len(timeseries.TTFT_BOUNDS_MS) + 1)
    assert timeseries.percentile(counts, 50) is None
    counts[0] = 100  # all under 25 ms
    assert timeseries.percentile(counts, 50) == 12.5
    counts[-1] = 100  # half above the last bound
    assert timeseries.percentile(counts, 99) == timeseries.TTFT_BOUNDS_MS[-1]
    assert timeseries.ttft_index(25) == 0 and timeseries.ttft_index(26) == 1
    assert timeseries.ttft_index(10**6) == len(timeseries.TTFT_BOUNDS_MS)


# -- the daemon's sampler ----------------------------------------------------------------------


def end(tenant: str, prompt: int, completion: int, ttft_ms: float, cached: int = 0) -> dict:
    return {"finish_reason": "stop",
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                      "prompt_tokens_details": {"cached_tokens": cached}},
            "timings": {"ttft_ms": ttft_ms}}


def sampler_on(client, snap: dict, clock: list[float]) -> Sampler:
    ctx = DaemonContext(client, "ts-model", "ts-daemon")
    return Sampler(ctx, lambda: snap, interval_s=10, clock=lambda: clock[0])


def test_the_sampler_writes_what_ended_and_the_snapshots_gauges(r):
    clock = [float(BASE + 1)]
    snap = {"slots": [{"state": "generating"}, {"state": "idle"}],
            "queue": [{}, {}], "preempted": [{}], "rejected": {"malformed": 2}}
    sampler = sampler_on(r, snap, clock)
    telemetry = Telemetry("ts-daemon", "ts-model")
    telemetry.end_listeners.append(sampler.request_end)  # as the daemon hooks it
    telemetry.request_end("r1", "done", end("7", 10, 5, 80, cached=4), "7")
    telemetry.request_end("r2", "error", {"code": "context_full"}, "8")
    r.delete(timeseries.claim_key(BASE))
    assert sampler.sample()
    snap["rejected"] = {"malformed": 3, "context_length_exceeded": 1}
    clock[0] = BASE + 11
    r.delete(timeseries.claim_key(BASE + 10))
    assert sampler.sample()
    view = timeseries.read(r, HOUR, now=BASE + 15)
    at = view.starts.index(BASE)
    assert view.requests[at] == 2 and view.requests[at + 1] == 0
    assert view.tokens_per_s["prompt"][at] == 1.0 and view.cache_hit_ratio[at] == 0.4
    assert view.running["ts-model"][at:at + 2] == [1.0, 1.0]
    assert view.waiting["ts-model"][at] == 3.0 and view.queued["ts-model"][at] == 0.0
    assert 50 < view.ttft_ms["p50"][at] <= 100
    assert view.top_tenants == [("7", 15)]
    # the snapshot's refusals since the sample before (the first: since the daemon started)
    assert view.refusals["malformed"][at:at + 2] == [2, 1]
    assert view.refusals["context_length_exceeded"][at:at + 2] == [0, 1]


def test_an_outage_drops_the_sample_logs_once_and_the_daemon_carries_on(r, caplog):
    # nobody listens there: every command is refused at once (no retries)
    dead = redis.Redis(port=free_port(), socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    clock = [float(BASE + 1)]
    sampler = sampler_on(dead, {}, clock)
    sampler.request_end("r1", "done", end("7", 10, 5, 80), "7")
    with caplog.at_level(logging.ERROR, "scheduler_daemon.service.timeseries"):
        assert not sampler.sample() and not sampler.sample() and not sampler.sample()
    failures = [rec for rec in caplog.records if "time series" in rec.getMessage()]
    assert len(failures) == 1 and sampler.dropped == 3
    sampler.redis = r  # Redis is back
    sampler.request_end("r2", "done", end("7", 20, 5, 80), "7")
    clock[0] = BASE + 11
    assert sampler.sample()
    view = timeseries.read(r, HOUR, now=BASE + 15)
    at = view.starts.index(BASE)
    assert view.requests[at:at + 2] == [0, 1]  # the dropped sample's end is gone, not late
    assert view.top_tenants == [("7", 25)]


def test_a_failing_end_listener_never_breaks_the_writer(caplog):
    telemetry = Telemetry("d", "m")
    seen = []
    telemetry.end_listeners.append(lambda *args: 1 / 0)
    telemetry.end_listeners.append(lambda *args: seen.append(args[0]))
    telemetry.request_end("r1", "done", end("7", 1, 1, 1), "7")
    assert seen == ["r1"]


def test_the_retention_and_codes_come_from_the_wire():
    assert set(limits.REFUSAL_CODES) <= set(timeseries.LIMIT_CODES)
    assert timeseries.DEFAULT_RETENTION_S == 7 * 86400
