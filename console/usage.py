"""A tenant's usage over a range (the console's usage page and its CSV, docs/console.md).

The range comes from GET parameters (``Query``, checked: a bad value falls back to the
default with a message). The database groups the history rows by (time bucket, model, key)
in one query (``groups``): sums of tokens, counts by status, and a histogram of TTFT in fixed
edges from which percentiles are read (``percentile``: approximate to a histogram bucket's
width). The work in Python is bounded by the number of groups, never by the number of rows.
Times are UTC.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta

from django.db.models import Count, Q, QuerySet, Sum
from django.db.models.functions import TruncDay, TruncHour
from django.http import Http404
from django.utils import timezone

from accounts.models import ApiKey, Tenant
from inference.models import InferenceRequest

RANGES = {"24h": timedelta(hours=24), "7d": timedelta(days=7), "30d": timedelta(days=30)}
DEFAULT_RANGE = "7d"
GRANULARITIES = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
TRUNC = {"hour": TruncHour, "day": TruncDay}
MAX_DAYS = 93
MAX_HOURLY = timedelta(days=7)
MAX_MODEL_CHARS = 200
TOP_N = 5
# TTFT histogram edges (ms): a percentile is exact to the width of the bucket it falls in;
# the last bucket (60 s and more) reads as its lower edge.
TTFT_EDGES_MS = (0, 25, 50, 75, 100, 150, 200, 300, 400, 500, 750, 1000, 1500, 2000, 3000,
                 5000, 7500, 10000, 15000, 20000, 30000, 60000)
Status = InferenceRequest.Status


@dataclass
class Query:
    """A checked range: [start, end) in UTC, cut in buckets of ``granularity``; filters."""

    start: datetime
    end: datetime
    granularity: str
    range: str  # a key of RANGES, or "custom" (from/to dates)
    model: str = ""
    key: ApiKey | None = None
    messages: list[str] = field(default_factory=list)

    def buckets(self) -> list[datetime]:
        step = GRANULARITIES[self.granularity]
        count = int((self.end - self.start) / step)
        return [self.start + step * i for i in range(count)]

    def label(self, bucket: datetime) -> str:
        return f"{bucket:%Y-%m-%d}" if self.granularity == "day" else f"{bucket:%m-%d %H:00}"

    def params(self) -> dict[str, str]:
        """The GET parameters that give this query again (the CSV link, the form)."""
        params = {"granularity": self.granularity}
        if self.range == "custom":
            params["from"] = f"{self.start:%Y-%m-%d}"
            params["to"] = f"{self.end - timedelta(days=1):%Y-%m-%d}"
        else:
            params["range"] = self.range
        if self.model:
            params["model"] = self.model
        if self.key is not None:
            params["key"] = str(self.key.pk)
        return params


def _floor(moment: datetime, granularity: str) -> datetime:
    moment = moment.astimezone(UTC).replace(minute=0, second=0, microsecond=0)
    return moment.replace(hour=0) if granularity == "day" else moment


def _dates(params: Mapping[str, str], today: date) -> tuple[date, date] | str:
    """The from/to dates (both included), or why they are refused."""
    try:
        first = date.fromisoformat(params.get("from", ""))
        last = date.fromisoformat(params["to"]) if params.get("to") else today
        last + timedelta(days=1)  # noqa: B018 (raises OverflowError at date.max)
    except (ValueError, OverflowError):
        return "The dates are not YYYY-MM-DD"
    if last < first:
        return "The range ends before it starts"
    if (last - first).days + 1 > MAX_DAYS:
        return f"A range is at most {MAX_DAYS} days"
    return first, last


def parse(params: Mapping[str, str], tenant: Tenant, now: datetime | None = None) -> Query:
    """The query the GET parameters ask for. A bad range, granularity or model falls back to
    the default with a message; a key id that is not the tenant's is a 404."""
    now = now or timezone.now()
    messages = []
    granularity = params.get("granularity", "")
    if granularity and granularity not in GRANULARITIES:
        messages.append("Unknown granularity: by hour or by day")
        granularity = ""
    query: Query | None = None
    if params.get("from") or params.get("to"):
        dates = _dates(params, now.astimezone(UTC).date())
        if isinstance(dates, str):
            messages.append(f"{dates}: showing the last 7 days")
        else:
            start = datetime.combine(dates[0], time(), UTC)
            end = datetime.combine(dates[1] + timedelta(days=1), time(), UTC)
            query = Query(start, end, granularity or "day", "custom")
    if query is None:
        name = params.get("range", "") or DEFAULT_RANGE
        if name not in RANGES:
            messages.append("Unknown range: showing the last 7 days")
            name = DEFAULT_RANGE
        granularity = granularity or ("hour" if RANGES[name] <= timedelta(days=1) else "day")
        step = GRANULARITIES[granularity]
        end = _floor(now, granularity) + step
        start = end - max(step, step * int(RANGES[name] / step))
        query = Query(start, end, granularity, name)
    if query.granularity == "hour" and query.end - query.start > MAX_HOURLY:
        messages.append("By hour is for ranges of at most 7 days: showing by day")
        query.granularity = "day"
    query.model = _model(params.get("model", ""), messages)
    query.key = _key(params.get("key", ""), tenant, messages)
    query.messages = messages
    return query


def _model(value: str, messages: list[str]) -> str:
    if len(value) > MAX_MODEL_CHARS or not value.isprintable():
        messages.append("That model name is not one: showing every model")
        return ""
    return value


def _key(value: str, tenant: Tenant, messages: list[str]) -> ApiKey | None:
    if not value:
        return None
    if not value.isascii() or not value.isdigit() or len(value) > 18:
        messages.append("That key is not one: showing every key")
        return None
    key = ApiKey.objects.for_tenant(tenant).filter(pk=int(value)).first()
    if key is None:
        raise Http404("no such key")
    return key


def rows(tenant: Tenant, query: Query) -> QuerySet[InferenceRequest]:
    """The tenant's history rows the query covers (its range and filters)."""
    selected = InferenceRequest.objects.for_tenant(tenant).filter(
        created__gte=query.start, created__lt=query.end)
    if query.model:
        selected = selected.filter(model=query.model)
    if query.key is not None:
        selected = selected.filter(api_key=query.key)
    return selected


def _histogram_counts() -> dict[str, Count]:
    counts = {}
    for index, low in enumerate(TTFT_EDGES_MS):
        within = Q(ttft_ms__gte=low)
        if index + 1 < len(TTFT_EDGES_MS):
            within &= Q(ttft_ms__lt=TTFT_EDGES_MS[index + 1])
        counts[f"ttft_{index}"] = Count("id", filter=within)
    return counts


@dataclass
class Group:
    """One (bucket, model, key) of the range: what the CSV's row and the charts hold."""

    bucket: datetime
    model: str
    key_id: int | None
    requests: int = 0
    done: int = 0
    cancelled: int = 0
    error: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_histogram: list[int] = field(default_factory=lambda: [0] * len(TTFT_EDGES_MS))

    COUNTS = ("requests", "done", "cancelled", "error", "prompt_tokens", "cached_tokens",
              "completion_tokens")

    def add(self, other: Group) -> None:
        for name in self.COUNTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.ttft_histogram = [a + b for a, b in zip(self.ttft_histogram,
                                                     other.ttft_histogram, strict=True)]

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def ttft_p50_ms(self) -> float | None:
        return percentile(self.ttft_histogram, 0.50)

    @property
    def ttft_p95_ms(self) -> float | None:
        return percentile(self.ttft_histogram, 0.95)


def percentile(histogram: Sequence[int], share: float) -> float | None:
    """The ``share`` quantile (nearest rank) of values counted in TTFT_EDGES_MS's buckets,
    interpolated inside its bucket: off by less than that bucket's width. None when empty."""
    total = sum(histogram)
    if not total:
        return None
    rank = max(1, math.ceil(share * total - 1e-9))
    seen = 0
    for index, count in enumerate(histogram):
        if count and seen + count >= rank:
            low = TTFT_EDGES_MS[index]
            if index + 1 == len(TTFT_EDGES_MS):
                return float(low)
            width = TTFT_EDGES_MS[index + 1] - low
            return low + width * (rank - seen) / count
        seen += count
    return None  # unreachable: the ranks add up to the total


def groups(tenant: Tenant, query: Query) -> list[Group]:
    """The range's groups, one query: (bucket, model, key) with their sums and counts."""
    bucketed = rows(tenant, query).annotate(
        bucket=TRUNC[query.granularity]("created", tzinfo=UTC))
    aggregated = bucketed.values("bucket", "model", "api_key").annotate(
        requests=Count("id"),
        done=Count("id", filter=Q(status=Status.DONE)),
        cancelled=Count("id", filter=Q(status=Status.CANCELLED)),
        error=Count("id", filter=Q(status=Status.ERROR)),
        prompt_tokens=Sum("prompt_tokens"),
        cached_tokens=Sum("cached_tokens"),
        completion_tokens=Sum("completion_tokens"),
        **_histogram_counts(),
    ).order_by("bucket", "model", "api_key")
    found = []
    for row in aggregated:
        group = Group(_floor(row["bucket"], query.granularity), row["model"], row["api_key"])
        for name in Group.COUNTS:
            setattr(group, name, row[name] or 0)
        group.ttft_histogram = [row[f"ttft_{i}"] for i in range(len(TTFT_EDGES_MS))]
        found.append(group)
    return found


def errors_by_code(tenant: Tenant, query: Query) -> dict[tuple[datetime, str], int]:
    """Failed requests per (bucket, error code), one query."""
    bucketed = rows(tenant, query).filter(status=Status.ERROR).annotate(
        bucket=TRUNC[query.granularity]("created", tzinfo=UTC))
    counted = bucketed.values("bucket", "error_code").annotate(count=Count("id")).order_by()
    return {(_floor(r["bucket"], query.granularity), r["error_code"] or "unknown"): r["count"]
            for r in counted}


def key_label(key: ApiKey | None) -> str:
    return f"{key.name} ({key.prefix}…)" if key is not None else "(no key)"


@dataclass
class Report:
    """The range's numbers, shaped for the charts: each ``*_series`` gives a series dict over
    ``labels`` (one value per bucket)."""

    query: Query
    groups: list[Group]
    errors: dict[tuple[datetime, str], int]
    keys: dict[int, ApiKey]

    def __post_init__(self) -> None:
        self.buckets = self.query.buckets()
        self.labels = [self.query.label(b) for b in self.buckets]
        self.index = {bucket: i for i, bucket in enumerate(self.buckets)}
        self.per_bucket = [Group(b, "", None) for b in self.buckets]
        self.total = Group(self.query.start, "", None)
        for group in self.groups:
            self.per_bucket[self.index[group.bucket]].add(group)
            self.total.add(group)

    def key_name(self, key_id: int | None) -> str:
        return key_label(self.keys.get(key_id)) if key_id is not None else key_label(None)

    def tokens_series(self) -> dict[str, list[float | None]]:
        return {
            "prompt (not cached)": [max(g.prompt_tokens - g.cached_tokens, 0)
                                    for g in self.per_bucket],
            "prompt (cached)": [g.cached_tokens for g in self.per_bucket],
            "completion": [g.completion_tokens for g in self.per_bucket],
        }

    def _top(self, name_of, other: str) -> dict[str, list[float | None]]:
        totals: Counter[str] = Counter()
        for group in self.groups:
            totals[name_of(group)] += group.tokens
        top = [name for name, _ in totals.most_common(TOP_N)]
        series: dict[str, list[float | None]] = {name: [0] * len(self.buckets) for name in top}
        for group in self.groups:
            name = name_of(group)
            if name not in series:
                name = other
                series.setdefault(other, [0] * len(self.buckets))
            series[name][self.index[group.bucket]] += group.tokens
        return series

    def model_series(self) -> dict[str, list[float | None]]:
        return self._top(lambda g: g.model, "(other models)")

    def key_series(self) -> dict[str, list[float | None]]:
        return self._top(lambda g: self.key_name(g.key_id), "(other keys)")

    def outcome_series(self) -> dict[str, list[float | None]]:
        series: dict[str, list[float | None]] = {
            "done": [g.done for g in self.per_bucket],
            "cancelled": [g.cancelled for g in self.per_bucket]}
        codes: Counter[str] = Counter()
        for (_, code), count in self.errors.items():
            codes[code] += count
        top = {code for code, _ in codes.most_common(TOP_N)}
        for (bucket, code), count in sorted(self.errors.items()):
            name = f"error: {code}" if code in top else "error: other codes"
            series.setdefault(name, [0] * len(self.buckets))[self.index[bucket]] += count
        unfinished = [g.requests - g.done - g.cancelled - g.error for g in self.per_bucket]
        if any(unfinished):
            series["queued or running"] = unfinished
        return series

    def ttft_series(self) -> dict[str, list[float | None]]:
        return {"p50": [g.ttft_p50_ms for g in self.per_bucket],
                "p95": [g.ttft_p95_ms for g in self.per_bucket]}

    def cached_share_series(self) -> dict[str, list[float | None]]:
        return {"cached share": [cached_share(g) for g in self.per_bucket]}


def cached_share(group: Group) -> float | None:
    """Cached prompt tokens as a percentage of prompt tokens (None without prompt tokens)."""
    if not group.prompt_tokens:
        return None
    return round(100 * group.cached_tokens / group.prompt_tokens, 1)


def report(tenant: Tenant, query: Query) -> Report:
    """The range's report: two grouped queries and one for the keys' names."""
    found = groups(tenant, query)
    key_ids = {g.key_id for g in found if g.key_id is not None}
    keys = ApiKey.objects.for_tenant(tenant).in_bulk(key_ids) if key_ids else {}
    return Report(query, found, errors_by_code(tenant, query), keys)


def models_in_use(tenant: Tenant, query: Query) -> list[str]:
    """The models of the tenant's rows in the query's range (the filter's choices)."""
    selected = InferenceRequest.objects.for_tenant(tenant).filter(
        created__gte=query.start, created__lt=query.end)
    return list(selected.values_list("model", flat=True).distinct().order_by("model")[:100])
