"""The console's usage page and its CSV (docs/console.md): charts of the tenant's history
over a chosen range, each with its table; the CSV holds the rows the charts are drawn from.
Every role sees usage."""

from __future__ import annotations

import csv
from urllib.parse import urlencode

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from accounts.models import ApiKey
from console import charts
from console import usage as stats
from console.access import context, member_view

CSV_COLUMNS = ("bucket_start_utc", "model", "key_id", "key_name", "key_prefix", "requests",
               "done", "cancelled", "error", "prompt_tokens", "cached_tokens",
               "completion_tokens", "ttft_p50_ms", "ttft_p95_ms")
# A cell a spreadsheet would read as a formula (OWASP's list); tenant-chosen text only.
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


def _charts(report: stats.Report) -> list[dict]:
    """Each chart of the page: its title, its SVG and its table."""
    labels = report.labels
    specs = [
        ("Tokens", report.tokens_series(), "", True),
        ("Tokens by model", report.model_series(), "", True),
        ("Tokens by key", report.key_series(), "", True),
        ("Requests by outcome", report.outcome_series(), "", True),
        ("Time to first token (approximate)", report.ttft_series(), " ms", False),
        ("Cached share of prompt tokens", report.cached_share_series(), "%", False),
    ]
    drawn = []
    for title, series, unit, bars in specs:
        if not report.groups:
            series = {}  # no rows: "No data", not lines of zeros
        svg = (charts.bar_chart(labels, series, title=title, unit=unit) if bars
               else charts.line_chart(labels, series, title=title, unit=unit))
        drawn.append({"title": title, "svg": svg,
                      "table": charts.table(labels, series, unit=unit, caption=title)})
    return drawn


@member_view("usage")
def usage(request: HttpRequest) -> HttpResponse:
    tenant = request.membership.tenant
    query = stats.parse(request.GET, tenant)
    for message in query.messages:
        messages.warning(request, message)
    report = stats.report(tenant, query)
    total = report.total
    summary = {
        "requests": total.requests, "done": total.done, "cancelled": total.cancelled,
        "error": total.error, "prompt_tokens": total.prompt_tokens,
        "cached_tokens": total.cached_tokens, "completion_tokens": total.completion_tokens,
        "cached_share": stats.cached_share(total),
        "ttft_p50_ms": total.ttft_p50_ms, "ttft_p95_ms": total.ttft_p95_ms,
    }
    models = stats.models_in_use(tenant, query)
    if query.model and query.model not in models:
        models.append(query.model)
    return render(request, "console/usage.html", context(
        request, query=query, report=report, summary=summary, charts=_charts(report),
        models=models, keys=ApiKey.objects.for_tenant(tenant).order_by("name", "pk"),
        ranges=list(stats.RANGES), params=query.params(), csv_query=urlencode(query.params()),
        top_n=stats.TOP_N,
        bucket_count=len(report.buckets)))


def neutralise(cell: object) -> object:
    """A text cell that a spreadsheet would run as a formula, made plain text."""
    if isinstance(cell, str) and cell.startswith(FORMULA_STARTS):
        return "'" + cell
    return cell


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.1f}"


@member_view("usage")
def usage_csv(request: HttpRequest) -> HttpResponse:
    tenant = request.membership.tenant
    query = stats.parse(request.GET, tenant)
    report = stats.report(tenant, query)
    name = f"usage-{tenant.slug}-{query.start:%Y%m%d%H}-{query.end:%Y%m%d%H}.csv"
    response = HttpResponse(content_type="text/csv; charset=utf-8", headers={
        "Content-Disposition": f'attachment; filename="{name}"',
        "X-Content-Type-Options": "nosniff"})
    writer = csv.writer(response)
    writer.writerow(CSV_COLUMNS)
    for group in report.groups:
        key = report.keys.get(group.key_id) if group.key_id is not None else None
        writer.writerow([neutralise(cell) for cell in (
            group.bucket.isoformat(), group.model, group.key_id or "",
            key.name if key else "", key.prefix if key else "", group.requests, group.done,
            group.cancelled, group.error, group.prompt_tokens, group.cached_tokens,
            group.completion_tokens, _ms(group.ttft_p50_ms), _ms(group.ttft_p95_ms))])
    return response

