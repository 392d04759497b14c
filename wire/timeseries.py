"""The service's own time series in Redis: what the operator's overview charts
(docs/observability.md, "The operator's overview"), kept without Prometheus.

Each daemon samples every ``TIMESERIES_INTERVAL_S`` (scheduler_daemon/service/timeseries.py)
and writes one pipeline into a bucket of each tier; the admin's overview reads a range from
the one tier that answers it in at most ``MAX_POINTS`` buckets. Nothing here imports Django.

Keys (``<step>`` a tier's seconds, ``<start>`` a bucket's first Unix second, a multiple of
``<step>``):
Bucket   ``llm:ts:<step>:<start>``          hash: the fields below
Tenants  ``llm:ts:<step>:<start>:tenants``  sorted set: tenant -> tokens (prompt + completion)
                                            of its ended requests; trimmed to the
                                            ``MAX_TENANTS_PER_BUCKET`` with the most after
                                            each write (what the others had counts as
                                            "others": the bucket's tokens less the named)
Claim    ``llm:ts:claim:<start>``           the daemon that samples the web's refusal counts
                                            in the finest tier's bucket ``<start>`` (SET NX,
                                            a few seconds): one writer a bucket keeps the
                                            cumulative values in order
A bucket's keys expire ``keep_s(step)`` after its last write (the coarsest tier keeps the
retention, ``TIMESERIES_RETENTION_S``).

Fields of a bucket (``<model>``, ``<daemon>``, ``<code>`` as the code names them; ``|`` in a
name is written ``_``):
``n|<daemon>``                    samples the daemon wrote into the bucket
``running|<model>|<daemon>``      sums of the daemon's gauges over those samples: requests in
``waiting|<model>|<daemon>``      its slots, waiting inside it (its local queue and the
``queued|<model>|<daemon>``       preempted), waiting in Redis for the model (shared by the
                                  model's daemons: the reader takes their largest)
``prompt|<model>``, ``completion|<model>``, ``cached|<model>``, ``requests|<model>``
                                  tokens and requests of requests that ended (HINCRBY)
``ttft|<i>``                      requests whose TTFT fell in ``TTFT_BOUNDS_MS[i]`` (the last
                                  index: above them all), every model and daemon together
``refused|<code>``                jobs a daemon answered with an error before starting them
``limit_first|<code>``, ``limit_last|<code>``  the web's cumulative refusal counts
                                  (wire/limits.py ``REFUSALS_HASH``) at the bucket's first and
                                  last sample; the reader charts their differences (a drop
                                  is a reset: counted from zero)
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .limits import QUEUE_REFUSAL_CODES, REFUSAL_CODES, REFUSALS_HASH
from .protocol import PREFIX

DEFAULT_RETENTION_S = 7 * 86400
DEFAULT_INTERVAL_S = 10.0
# (step, buckets kept): a tier keeps min(retention, step * buckets); the last one keeps the
# retention. Each range the overview offers is read from one tier in <= MAX_POINTS buckets.
TIERS: tuple[tuple[int, int | None], ...] = ((10, 720), (60, 720), (300, 720), (1800, None))
MAX_POINTS = 400
RANGES_S = {"1h": 3600, "6h": 6 * 3600, "24h": 86400, "7d": 7 * 86400}
MAX_TENANTS_PER_SAMPLE = 20  # a sample's tenants with the most tokens (the rest: others)
MAX_TENANTS_PER_BUCKET = 50
OTHER_TENANTS = "_other"  # the top list's entry for every tenant not named
TOP_TENANTS = 10
TTFT_BOUNDS_MS = (25, 50, 100, 250, 500, 1000, 2500, 5000, 10_000, 30_000, 60_000)
PERCENTILES = (50, 95, 99)
LIMIT_CODES = (*REFUSAL_CODES, *QUEUE_REFUSAL_CODES)
CLAIM_TTL_S = 2 * TIERS[0][0]
_KEY = f"{PREFIX}:ts"


def bucket_key(step: int, start: int) -> str:
    return f"{_KEY}:{step}:{start}"


def tenants_key(step: int, start: int) -> str:
    return f"{_KEY}:{step}:{start}:tenants"


def claim_key(start: int) -> str:
    return f"{_KEY}:claim:{start}"


def bucket_start(now: float, step: int) -> int:
    return int(now // step) * step


def keep_s(step: int, retention_s: int) -> int:
    """How long a bucket of the tier ``step`` lives after its last write."""
    kept = dict(TIERS)[step]
    return retention_s if kept is None else min(retention_s, step * kept)


def name(text: object) -> str:
    """A model, daemon, code or tenant as a field's part (``|`` separates the parts)."""
    return str(text).replace("|", "_")[:128]


def ttft_index(ttft_ms: float) -> int:
    """The histogram bucket of one TTFT: the first bound it is at most, else the last."""
    for index, bound in enumerate(TTFT_BOUNDS_MS):
        if ttft_ms <= bound:
            return index
    return len(TTFT_BOUNDS_MS)


def top_of(tokens: Mapping[str, int], most: int = MAX_TENANTS_PER_SAMPLE) -> dict[str, int]:
    """The ``most`` tenants with the most tokens."""
    ranked = sorted(tokens.items(), key=lambda item: (-item[1], item[0]))
    return {tenant: n for tenant, n in ranked[:most] if n > 0}


# -- writing (the daemon) -----------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """One daemon's interval: its gauges now, what ended since its last sample, and (when
    it holds the claim) the web's cumulative refusal counts."""

    daemon_id: str
    model: str
    running: int = 0
    waiting: int = 0
    queued: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    requests: int = 0
    ttft: dict[int, int] = field(default_factory=dict)  # TTFT bucket index -> requests
    tenant_tokens: dict[str, int] = field(default_factory=dict)
    refused: dict[str, int] = field(default_factory=dict)  # code -> jobs since the last
    limit_refusals: dict[str, int] | None = None  # code -> count since the counters began


def write(pipe: Any, sample: Sample, now: float, retention_s: int) -> None:
    """Queue ``sample``'s commands on ``pipe`` (one bucket of each tier); the caller
    executes it."""
    daemon, model = name(sample.daemon_id), name(sample.model)
    counts: dict[str, int] = {
        f"n|{daemon}": 1,
        f"running|{model}|{daemon}": sample.running,
        f"waiting|{model}|{daemon}": sample.waiting,
        f"queued|{model}|{daemon}": sample.queued,
        f"prompt|{model}": sample.prompt_tokens,
        f"completion|{model}": sample.completion_tokens,
        f"cached|{model}": sample.cached_tokens,
        f"requests|{model}": sample.requests,
    }
    counts.update({f"ttft|{int(i)}": n for i, n in sample.ttft.items()})
    tenants = {name(t): n for t, n in top_of(sample.tenant_tokens).items()}
    counts.update({f"refused|{name(code)}": n for code, n in sample.refused.items()})
    for step, _kept in TIERS:
        key = bucket_key(step, bucket_start(now, step))
        for field_name, n in counts.items():
            if n or field_name.startswith(("n|", "running|", "waiting|", "queued|")):
                pipe.hincrby(key, field_name, int(n))
        if sample.limit_refusals is not None:
            for code in LIMIT_CODES:
                value = int(sample.limit_refusals.get(code, 0))
                pipe.hsetnx(key, f"limit_first|{code}", value)
                pipe.hset(key, f"limit_last|{code}", value)
        keep = keep_s(step, retention_s)
        pipe.expire(key, keep)
        if tenants:
            ranked = tenants_key(step, bucket_start(now, step))
            for tenant, n in tenants.items():
                pipe.zincrby(ranked, n, tenant)
            pipe.zremrangebyrank(ranked, 0, -MAX_TENANTS_PER_BUCKET - 1)
            pipe.expire(ranked, keep)


def claim(client: Any, daemon_id: str, now: float) -> bool:
    """Whether this daemon samples the web's refusal counts for the finest bucket of
    ``now`` (the first to ask does)."""
    start = bucket_start(now, TIERS[0][0])
    return bool(client.set(claim_key(start), name(daemon_id), nx=True, ex=CLAIM_TTL_S))


def limit_refusals(client: Any) -> dict[str, int]:
    """The web's refusal counts by code since the counters began (the known codes)."""
    raw = client.hgetall(REFUSALS_HASH)
    found = {_text(k): int(v) for k, v in raw.items()}
    return {code: found.get(code, 0) for code in LIMIT_CODES}


# -- reading (the admin) ------------------------------------------------------------------------


def tier_for(range_s: int, retention_s: int) -> int:
    """The finest tier that answers ``range_s`` in at most ``MAX_POINTS`` buckets and
    still keeps them (else the coarsest); a range past the retention is the retention."""
    range_s = min(range_s, retention_s)
    for step, _kept in TIERS:
        if range_s / step <= MAX_POINTS and keep_s(step, retention_s) >= range_s:
            return step
    return TIERS[-1][0]


@dataclass(slots=True)
class Overview:
    """A range as series, one value per bucket (None: no daemon wrote there)."""

    step: int
    starts: list[int]
    tokens: dict[str, list[int]]  # "prompt", "completion": tokens of requests that ended
    tokens_per_s: dict[str, list[float | None]]  # the same per second (None: no daemon wrote)
    requests: list[int]
    running: dict[str, list[float | None]]  # model -> mean requests in slots
    waiting: dict[str, list[float | None]]  # model -> mean waiting inside daemons
    queued: dict[str, list[float | None]]  # model -> mean waiting in Redis
    ttft_ms: dict[str, list[float | None]]  # "p50", "p95", "p99"
    ttft_range_ms: dict[str, float | None]  # the same over the whole range
    cache_hit_ratio: list[float | None]  # cached / prompt tokens
    refusals: dict[str, list[int]]  # code -> refusals in the bucket (web and daemons)
    top_tenants: list[tuple[str, int]]  # (tenant, tokens), most first; "_other" included
    daemons: list[int]  # daemons that wrote into the bucket


def read(client: Any, range_s: int, now: float, retention_s: int = DEFAULT_RETENTION_S,
         top: int = TOP_TENANTS) -> Overview:
    """The last ``range_s`` seconds as series, from one tier: at most ``MAX_POINTS`` + 1
    buckets read in one pipeline (one before the range: the refusal counts' baseline)."""
    range_s = min(int(range_s), retention_s)
    step = tier_for(range_s, retention_s)
    last = bucket_start(now, step)
    count = max(1, min(MAX_POINTS, math.ceil(range_s / step)))
    starts = [last - step * i for i in range(count, -1, -1)]  # baseline first
    pipe = client.pipeline(transaction=False)
    for start in starts:
        pipe.hgetall(bucket_key(step, start))
    for start in starts[1:]:
        pipe.zrange(tenants_key(step, start), 0, -1, withscores=True)
    replies = pipe.execute()
    buckets = [{_text(k): int(v) for k, v in raw.items()} for raw in replies[:len(starts)]]
    ranked = [{_text(k): int(v) for k, v in raw} for raw in replies[len(starts):]]
    baseline, buckets, starts = buckets[0], buckets[1:], starts[1:]
    seconds = [min(step, max(1.0, now - start)) for start in starts]  # the last one: so far
    return Overview(
        step=step, starts=starts,
        tokens={kind: [_sum(b, kind) for b in buckets] for kind in ("prompt", "completion")},
        tokens_per_s={kind: [_sum(b, kind) / s if b else None
                             for b, s in zip(buckets, seconds, strict=True)]
                      for kind in ("prompt", "completion")},
        requests=[_sum(b, "requests") for b in buckets],
        running=_gauges(buckets, "running", sum),
        waiting=_gauges(buckets, "waiting", sum),
        queued=_gauges(buckets, "queued", max),
        ttft_ms={f"p{p}": [percentile(_histogram([b]), p) for b in buckets]
                 for p in PERCENTILES},
        ttft_range_ms={f"p{p}": percentile(_histogram(buckets), p) for p in PERCENTILES},
        cache_hit_ratio=[_ratio(_sum(b, "cached"), _sum(b, "prompt")) for b in buckets],
        refusals=refusal_series(baseline, buckets),
        top_tenants=_top_tenants(buckets, ranked, top),
        daemons=[sum(1 for f in b if f.startswith("n|")) for b in buckets],
    )


def percentile(histogram: list[int], p: float) -> float | None:
    """The ``p``th percentile of a TTFT histogram (``TTFT_BOUNDS_MS``' buckets), linear
    within its bucket, as Prometheus' ``histogram_quantile``; above the last bound: it."""
    total = sum(histogram)
    if total == 0:
        return None
    rank = total * p / 100
    seen, lower = 0, 0.0
    for index, n in enumerate(histogram):
        if index == len(TTFT_BOUNDS_MS):
            return float(TTFT_BOUNDS_MS[-1])
        upper = float(TTFT_BOUNDS_MS[index])
        if n and seen + n >= rank:
            return round(lower + (upper - lower) * (rank - seen) / n, 1)
        seen, lower = seen + n, upper
    return float(TTFT_BOUNDS_MS[-1])


def refusal_series(baseline: Mapping[str, int], buckets: list[dict[str, int]]
                   ) -> dict[str, list[int]]:
    """Refusals per bucket by code: the daemons' (``refused|``) as written, the web's from
    the cumulative counts' differences: from the previous bucket's last count (or, with
    none, the bucket's own first) to its last; a count lower than the one before is a reset
    (counted from zero)."""
    codes = {f.split("|", 1)[1] for b in buckets for f in b if f.startswith("refused|")}
    series = {code: [b.get(f"refused|{code}", 0) for b in buckets] for code in sorted(codes)}
    for code in LIMIT_CODES:
        before = baseline.get(f"limit_last|{code}")
        deltas = []
        for bucket in buckets:
            first, last = bucket.get(f"limit_first|{code}"), bucket.get(f"limit_last|{code}")
            if first is None or last is None:
                deltas.append(0)
                continue
            gap = 0 if before is None else (first - before if first >= before else first)
            deltas.append(gap + (last - first if last >= first else last))
            before = last
        if any(deltas):
            own = series.get(code, [0] * len(buckets))
            series[code] = [a + b for a, b in zip(own, deltas, strict=True)]
    return {code: values for code, values in sorted(series.items()) if any(values)}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _sum(bucket: Mapping[str, int], kind: str) -> int:
    prefix = f"{kind}|"
    return sum(n for f, n in bucket.items() if f.startswith(prefix))


def _ratio(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _histogram(buckets: Iterable[Mapping[str, int]]) -> list[int]:
    counts = [0] * (len(TTFT_BOUNDS_MS) + 1)
    for bucket in buckets:
        for index in range(len(counts)):
            counts[index] += bucket.get(f"ttft|{index}", 0)
    return counts


def _gauges(buckets: list[dict[str, int]], kind: str, combine: Any
            ) -> dict[str, list[float | None]]:
    """model -> per bucket: each daemon's mean over its samples, combined (sum or max)."""
    per_bucket: list[dict[str, list[float]]] = []
    models: set[str] = set()
    prefix = f"{kind}|"
    for bucket in buckets:
        means: dict[str, list[float]] = {}
        for f, total in bucket.items():
            if f.startswith(prefix):
                model, daemon = f[len(prefix):].rsplit("|", 1)
                samples = bucket.get(f"n|{daemon}") or 1
                means.setdefault(model, []).append(total / samples)
                models.add(model)
        per_bucket.append(means)
    return {model: [round(combine(m[model]), 3) if model in m else None for m in per_bucket]
            for model in sorted(models)}


def _top_tenants(buckets: list[dict[str, int]], ranked: list[dict[str, int]], top: int
                 ) -> list[tuple[str, int]]:
    """The ``top`` tenants by tokens over the buckets, then ``OTHER_TENANTS``: every token
    of the range not named (other tenants', trimmed ones', those of no tenant)."""
    totals: dict[str, int] = {}
    for tenants in ranked:
        for tenant, n in tenants.items():
            totals[tenant] = totals.get(tenant, 0) + n
    named = sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:top]
    everything = sum(_sum(b, "prompt") + _sum(b, "completion") for b in buckets)
    others = everything - sum(n for _tenant, n in named)
    return named + ([(OTHER_TENANTS, others)] if others > 0 else [])
