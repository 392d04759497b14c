"""The console's usage page and CSV (console/usage.py, console/usage_views.py): history rows
made directly for two tenants over fixed days (no wall time decides a result)."""

import csv
import io
import math
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
from django.urls import reverse

from accounts.models import ApiKey, Membership, Tenant
from console import usage
from inference.models import InferenceRequest

PAGE = reverse("console:usage")
CSV = reverse("console:usage_csv")
DAYS = "from=2025-03-01&to=2025-03-05"


def at(day: int, hour: int = 12, minute: int = 0) -> datetime:
    return datetime(2025, 3, day, hour, minute, tzinfo=UTC)


def make(tenant, key, created, *, model="smollm2", status="done", prompt=10, cached=0,
         completion=5, ttft=None, error_code=""):
    return InferenceRequest.objects.create(
        tenant=tenant, api_key=key, kind="chat", model=model, status=status,
        prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion,
        ttft_ms=ttft, error_code=error_code, created=created)


def member(django_user_model, tenant, name, role=Membership.Role.MEMBER):
    user = django_user_model.objects.create_user(name, password="pw-unused-0")
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


@pytest.fixture
def world(db, django_user_model):
    """Tenant A: two keys, rows over days 1-4 (hours 0-23) in two models, statuses mixed;
    tenant B: rows of its own on the same days, a model and key name only B has."""
    a = Tenant.objects.create(slug="alpha", name="Alpha")
    b = Tenant.objects.create(slug="beta", name="Beta")
    key1, _ = ApiKey.issue(a, "first")
    key2, _ = ApiKey.issue(a, "second")
    key_b, _ = ApiKey.issue(b, "beta-only-key")
    rows = []
    for day in (1, 2, 4):
        for hour in (0, 5, 23):
            rows.append(make(a, key1, at(day, hour, 10), prompt=100 + day, cached=40,
                             completion=7 * hour, ttft=120.0 + hour))
            rows.append(make(a, key2, at(day, hour, 50), model="gemma", prompt=30,
                             completion=3, ttft=800.0))
        rows.append(make(a, key2, at(day, 9), status="cancelled", prompt=8, completion=1))
        rows.append(make(a, key1, at(day, 10), status="error", prompt=None, completion=None,
                         error_code="queue_full"))
        rows.append(make(a, None, at(day, 11), status="error", prompt=None,
                         completion=None, error_code="model_not_found"))
        make(b, key_b, at(day, 5), model="beta-secret-model", prompt=999_999,
             completion=777_777)
    rows.append(make(a, key1, at(6), prompt=5000))  # outside the range
    make(b, key_b, at(3), model="beta-secret-model", prompt=999_999)
    return {"a": a, "b": b, "key1": key1, "key2": key2, "key_b": key_b, "rows": rows,
            "user_a": member(django_user_model, a, "ann"),
            "user_b": member(django_user_model, b, "bob")}


def expected_per_bucket(rows, start, end, step):
    buckets = defaultdict(lambda: defaultdict(int))
    for row in rows:
        if not start <= row.created < end:
            continue
        bucket = start + step * int((row.created - start) / step)
        totals = buckets[bucket]
        totals["requests"] += 1
        totals[row.status] += 1
        totals["prompt_tokens"] += row.prompt_tokens or 0
        totals["cached_tokens"] += row.cached_tokens or 0
        totals["completion_tokens"] += row.completion_tokens or 0
    return buckets


def bucket_totals(report):
    return {g.bucket: {"requests": g.requests, "done": g.done, "cancelled": g.cancelled,
                       "error": g.error, "prompt_tokens": g.prompt_tokens,
                       "cached_tokens": g.cached_tokens,
                       "completion_tokens": g.completion_tokens}
            for g in report.per_bucket if g.requests}


def as_dicts(expected):
    keys = ("requests", "done", "cancelled", "error", "prompt_tokens", "cached_tokens",
            "completion_tokens")
    return {bucket: {k: totals[k] for k in keys} for bucket, totals in expected.items()}


def test_daily_sums_equal_the_rows(client, world):
    client.force_login(world["user_a"])
    response = client.get(f"{PAGE}?{DAYS}")
    assert response.status_code == 200
    report = response.context["report"]
    assert report.labels == [f"2025-03-0{d}" for d in range(1, 6)]
    expected = expected_per_bucket(world["rows"], at(1, 0), at(6, 0), timedelta(days=1))
    assert bucket_totals(report) == as_dicts(expected)
    tokens = report.tokens_series()
    assert tokens["prompt (cached)"][0] == 3 * 40
    assert tokens["prompt (not cached)"][0] == 3 * (101 - 40) + 3 * 30 + 8
    assert tokens["completion"][2] == 0  # day 3: no rows of A
    outcome = report.outcome_series()
    assert outcome["error: queue_full"] == [1, 1, 0, 1, 0]
    assert outcome["error: model_not_found"] == [1, 1, 0, 1, 0]
    assert outcome["cancelled"] == [1, 1, 0, 1, 0]
    by_key = report.key_series()
    assert set(by_key) == {f"first ({world['key1'].prefix}…)",
                           f"second ({world['key2'].prefix}…)", "(no key)"}
    per_bucket_tokens = [sum(values) for values in zip(*tokens.values(), strict=True)]
    assert [sum(v) for v in zip(*by_key.values(), strict=True)] == per_bucket_tokens
    assert [sum(v) for v in zip(*report.model_series().values(), strict=True)] == \
        per_bucket_tokens
    html = response.content.decode()
    assert "UTC" in html and "<svg" in html and "<details>" in html


def test_hourly_sums_equal_the_rows(client, world):
    client.force_login(world["user_a"])
    response = client.get(f"{PAGE}?from=2025-03-01&to=2025-03-02&granularity=hour")
    report = response.context["report"]
    assert len(report.labels) == 48 and report.labels[5] == "03-01 05:00"
    expected = expected_per_bucket(world["rows"], at(1, 0), at(3, 0), timedelta(hours=1))
    assert bucket_totals(report) == as_dicts(expected)


def read_csv(response):
    assert response.status_code == 200
    assert response["Content-Disposition"].startswith("attachment;")
    assert response["Content-Type"].startswith("text/csv")
    return list(csv.DictReader(io.StringIO(response.content.decode())))


def test_csv_holds_the_rows_the_charts_are_drawn_from(client, world):
    client.force_login(world["user_a"])
    report = client.get(f"{PAGE}?{DAYS}").context["report"]
    lines = read_csv(client.get(f"{CSV}?{DAYS}"))
    assert len(lines) == len(report.groups)
    assert len({(line["bucket_start_utc"], line["model"], line["key_id"]) for line in lines}) \
        == len(lines)  # one row per (bucket, model, key)
    per_bucket = defaultdict(lambda: defaultdict(int))
    for line in lines:
        bucket = datetime.fromisoformat(line["bucket_start_utc"])
        for name in ("requests", "done", "cancelled", "error", "prompt_tokens",
                     "cached_tokens", "completion_tokens"):
            per_bucket[bucket][name] += int(line[name])
    assert {b: dict(t) for b, t in per_bucket.items()} == bucket_totals(report)
    for line, group in zip(lines, report.groups, strict=True):
        assert (line["model"], line["key_id"]) == (group.model, str(group.key_id or ""))
        p95 = group.ttft_p95_ms
        assert line["ttft_p95_ms"] == ("" if p95 is None else f"{p95:.1f}")
    first = next(line for line in lines if line["key_id"] == str(world["key1"].pk))
    assert (first["key_name"], first["key_prefix"]) == ("first", world["key1"].prefix)


def test_filters_apply_to_charts_and_csv(client, world):
    client.force_login(world["user_a"])
    key2 = world["key2"]
    params = f"{DAYS}&model=gemma&key={key2.pk}"
    report = client.get(f"{PAGE}?{params}").context["report"]
    chosen = [r for r in world["rows"] if r.model == "gemma" and r.api_key_id == key2.pk]
    expected = expected_per_bucket(chosen, at(1, 0), at(6, 0), timedelta(days=1))
    assert bucket_totals(report) == as_dicts(expected)
    lines = read_csv(client.get(f"{CSV}?{params}"))
    assert {(line["model"], line["key_id"]) for line in lines} == {("gemma", str(key2.pk))}
    only_key1 = read_csv(client.get(f"{CSV}?{DAYS}&key={world['key1'].pk}"))
    assert {line["key_id"] for line in only_key1} == {str(world["key1"].pk)}


def nearest_rank(values, share):
    ordered = sorted(values)
    return ordered[max(1, math.ceil(share * len(ordered))) - 1]


def bucket_edges(value):
    edges = usage.TTFT_EDGES_MS
    index = max(i for i, edge in enumerate(edges) if edge <= value)
    return edges[index], edges[index + 1]


@pytest.mark.parametrize("values", [
    [120.0, 125.0, 143.0, 800.0, 810.0, 2500.0],
    [float(v) for v in range(5, 4000, 37)],
    [42.0],
    [70000.0, 90000.0, 10.0],
])
def test_percentiles_within_a_bucket_width(db, values):
    tenant = Tenant.objects.create(slug="p", name="P")
    for value in values:
        make(tenant, None, at(2, 8), ttft=value)
    make(tenant, None, at(2, 9), ttft=None)  # no first token: not counted
    query = usage.parse({"from": "2025-03-02", "to": "2025-03-02"}, tenant)
    total = usage.report(tenant, query).total
    for share, estimate in ((0.5, total.ttft_p50_ms), (0.95, total.ttft_p95_ms)):
        true = nearest_rank(values, share)
        if true >= usage.TTFT_EDGES_MS[-1]:  # the open bucket reads as its lower edge
            assert estimate == usage.TTFT_EDGES_MS[-1]
        else:  # in the bucket that holds the true value: off by less than its width
            low, high = bucket_edges(true)
            assert low < estimate <= high, (share, estimate, true)


def test_percentile_of_an_empty_histogram():
    assert usage.percentile([0] * len(usage.TTFT_EDGES_MS), 0.5) is None


def test_tenants_see_only_their_own_rows(client, world):
    client.force_login(world["user_a"])
    page = client.get(f"{PAGE}?{DAYS}").content.decode()
    lines = client.get(f"{CSV}?{DAYS}").content.decode()
    for text in (page, lines):
        assert "beta-secret-model" not in text and "beta-only-key" not in text
        assert "999999" not in text and "999,999" not in text
    client.force_login(world["user_b"])
    report = client.get(f"{PAGE}?{DAYS}").context["report"]
    assert {g.model for g in report.groups} == {"beta-secret-model"}
    assert report.total.requests == 4
    assert "first" not in client.get(f"{CSV}?{DAYS}").content.decode()


def test_another_tenants_key_is_a_404(client, world):
    client.force_login(world["user_a"])
    for url in (PAGE, CSV):
        assert client.get(f"{url}?key={world['key_b'].pk}").status_code == 404
        assert client.get(f"{url}?key=99999999").status_code == 404


@pytest.mark.parametrize("params, message", [
    ("range=1y", "Unknown range"),
    ("granularity=minute", "Unknown granularity"),
    ("from=yesterday", "not YYYY-MM-DD"),
    ("from=2025-03-05&to=2025-03-01", "ends before it starts"),
    ("from=2025-01-01&to=2025-06-01", "at most 93 days"),
    ("from=9999-12-31&to=9999-12-31", "not YYYY-MM-DD"),
    ("from=2025-03-01&to=2025-03-20&granularity=hour", "By hour is for ranges"),
    ("range=30d&granularity=hour", "By hour is for ranges"),
    ("key=abc", "That key is not one"),
    ("key=%EF%BC%91", "That key is not one"),  # a fullwidth digit
    ("model=" + "m" * 201, "That model name is not one"),
    ("model=a%00b", "That model name is not one"),
])
def test_bad_params_fall_back_with_a_message(client, world, params, message):
    client.force_login(world["user_a"])
    response = client.get(f"{PAGE}?{params}")
    assert response.status_code == 200
    assert message in response.content.decode()
    assert client.get(f"{CSV}?{params}").status_code == 200


def test_the_default_range_and_presets():
    tenant = Tenant(slug="t")
    now = datetime(2025, 3, 10, 14, 30, tzinfo=UTC)
    week = usage.parse({}, tenant, now)
    assert (week.range, week.granularity, week.messages) == ("7d", "day", [])
    assert (week.start, week.end) == (datetime(2025, 3, 4, tzinfo=UTC), at(11, 0))
    day = usage.parse({"range": "24h"}, tenant, now)
    assert (day.granularity, len(day.buckets())) == ("hour", 24)
    assert day.end == datetime(2025, 3, 10, 15, tzinfo=UTC)
    custom = usage.parse({"from": "2025-03-01", "to": "2025-03-03"}, tenant, now)
    assert custom.params() == {"granularity": "day", "from": "2025-03-01", "to": "2025-03-03"}
    assert len(usage.parse({"from": "2024-12-01", "to": "2025-03-03"}, tenant, now)
               .buckets()) == 93


def test_hostile_model_names_are_escaped(client, world):
    hostile = '<script>alert("m")</script>'
    make(world["a"], world["key1"], at(2), model=hostile)
    world["key2"].name = '"><img src=x onerror=alert(1)>'
    world["key2"].save()
    client.force_login(world["user_a"])
    html = client.get(f"{PAGE}?{DAYS}&model=%3Cscript%3E").content.decode()
    assert "<script" not in html and "<img" not in html
    assert "&lt;script&gt;" in html


def test_csv_cells_cannot_be_formulas(client, world):
    world["key1"].name = "=HYPERLINK(\"http://evil\",\"x\")"
    world["key1"].save()
    world["key2"].name = "@SUM(A1)"
    world["key2"].save()
    make(world["a"], world["key2"], at(2), model="-2+3")
    make(world["a"], world["key2"], at(2), model="+cmd")
    client.force_login(world["user_a"])
    lines = read_csv(client.get(f"{CSV}?{DAYS}"))
    cells = [line[name] for line in lines for name in ("model", "key_name")]
    assert "'=HYPERLINK(\"http://evil\",\"x\")" in cells
    assert {"'@SUM(A1)", "'-2+3", "'+cmd"} <= set(cells)
    assert not [cell for cell in cells if cell.startswith(tuple("=+-@"))]


def test_a_tenant_with_no_rows_sees_empty_charts(client, db, django_user_model):
    empty = Tenant.objects.create(slug="empty", name="Empty")
    client.force_login(member(django_user_model, empty, "eve"))
    response = client.get(PAGE)
    assert response.status_code == 200
    assert response.content.decode().count("No data") >= 6
    lines = read_csv(client.get(CSV))
    assert lines == []


def test_every_role_sees_usage_and_strangers_do_not(client, world, django_user_model):
    viewer = member(django_user_model, world["a"], "vic", Membership.Role.VIEWER)
    client.force_login(viewer)
    assert client.get(PAGE).status_code == 200
    assert client.get(CSV).status_code == 200
    client.logout()
    assert client.get(PAGE).status_code == 302
    assert client.get(CSV).status_code == 302
    stranger = django_user_model.objects.create_user("sam", password="pw-unused-0")
    client.force_login(stranger)
    assert client.get(PAGE).status_code == 403
    assert client.get(CSV).status_code == 403


def test_the_work_is_a_few_queries(client, world, django_assert_max_num_queries):
    client.force_login(world["user_a"])
    for day in range(1, 6):
        for hour in range(24):
            make(world["a"], world["key1"], at(day, hour))
    with django_assert_max_num_queries(10):
        assert client.get(f"{PAGE}?{DAYS}&granularity=hour").status_code == 200
