"""The landing page's panels and its charts, drawn here as inline SVG (no front-end build step, no script):
`{% relay_console %}` on the admin's index renders admin/relay_console.html from relay.console's reads."""

import logging
from datetime import UTC, date, datetime, time, timedelta
from urllib.parse import quote

from django import template
from django.utils.html import format_html, format_html_join

from relay import console

log = logging.getLogger(__name__)
register = template.Library()

# Colour-blind-safe (Okabe-Ito), one per series; "other" is grey.
PALETTE = ("#0072b2", "#e69f00", "#009e73", "#cc79a7", "#56b4e9", "#d55e00", "#999999")
CHART_W, CHART_H, AXIS_W, LABEL_H = 600, 180, 56, 18


@register.inclusion_tag("admin/relay_console.html", takes_context=True)
def relay_console(context):
    request = context.get("request")
    by = request.GET.get("by", "project") if request is not None else "project"
    console.refresh_rollup()
    data = console.landing(by)
    if data.get("spend") is not None:
        data["spend_svg"] = spend_chart(data["spend"])
        data["spend_table"] = _spend_table(data["spend"])
    data["usd"] = console.usd
    return {"c": data, "groupings": console.GROUPINGS}


def _nice_max(value: int) -> int:
    """The axis' top: 1, 2 or 5 times a power of ten, at or above value (nano-USD; at least a cent)."""
    power = 10_000_000
    while True:
        for factor in (1, 2, 5):
            if power * factor >= value:
                return power * factor
        power *= 10


def spend_chart(spend: console.Spend) -> str:
    """Stacked bars of spend per day, one colour per series, with the axis' top and the first and last day;
    the figure's text equivalent is its <title>/<desc> and the table beside it."""
    totals = spend.totals
    top = _nice_max(max(totals) if totals else 0)
    n = len(spend.days)
    slot = (CHART_W - AXIS_W) / n
    bar_w = max(1.0, slot * 0.8)
    rects = []
    for s_idx, (name, values) in enumerate(spend.series):
        colour = PALETTE[min(s_idx, len(PALETTE) - 1)]
        if name.startswith("other ("):
            colour = PALETTE[-1]
        for d_idx, value in enumerate(values):
            if not value:
                continue
            below = sum(spend.series[k][1][d_idx] for k in range(s_idx))
            h = value * CHART_H / top
            y = CHART_H - (below * CHART_H / top) - h
            rects.append(
                (
                    f"{AXIS_W + d_idx * slot:.1f}",
                    f"{y:.1f}",
                    f"{bar_w:.1f}",
                    f"{max(h, 0.5):.1f}",
                    colour,
                    f"{spend.days[d_idx].isoformat()} {name}: {console.usd(value)}",
                )
            )
    bars = format_html_join(
        "",
        '<rect x="{}" y="{}" width="{}" height="{}" fill="{}"><title>{}</title></rect>',
        rects,
    )
    total = sum(totals)
    busiest = max(range(n), key=lambda i: totals[i]) if total else None
    desc = (
        f"Spend per day by {spend.by}, {spend.days[0].isoformat()} to {spend.days[-1].isoformat()}: "
        f"{console.usd(total)} in all"
        + (f", most on {spend.days[busiest].isoformat()} ({console.usd(totals[busiest])})." if total else ".")
    )
    return format_html(
        '<svg class="relay-chart" role="img" aria-labelledby="spend-title spend-desc" viewBox="0 0 {w} {h}" '
        'width="100%" preserveAspectRatio="xMinYMin meet" xmlns="http://www.w3.org/2000/svg">'
        '<title id="spend-title">Spend per day, last {n} days</title><desc id="spend-desc">{desc}</desc>'
        '<line x1="{ax}" y1="0" x2="{ax}" y2="{ch}" stroke="#888"/>'
        '<line x1="{ax}" y1="{ch}" x2="{w}" y2="{ch}" stroke="#888"/>'
        '<text x="{tx}" y="10" text-anchor="end" font-size="10" fill="currentColor">{top}</text>'
        '<text x="{tx}" y="{ch}" text-anchor="end" font-size="10" fill="currentColor">$0</text>'
        '<text x="{ax}" y="{ly}" font-size="10" fill="currentColor">{first}</text>'
        '<text x="{w}" y="{ly}" text-anchor="end" font-size="10" fill="currentColor">{last} (today)</text>'
        "{bars}</svg>",
        w=CHART_W,
        h=CHART_H + LABEL_H,
        n=n,
        desc=desc,
        ax=AXIS_W,
        ch=CHART_H,
        tx=AXIS_W - 4,
        top=console.usd(top),
        ly=CHART_H + 13,
        first=spend.days[0].strftime("%b %d"),
        last=spend.days[-1].strftime("%b %d"),
        bars=bars,
    )


def _spend_table(spend: console.Spend) -> dict:
    """The chart as a table: a row per day that had spend (newest first), a column per series."""
    rows = []
    for i in reversed(range(len(spend.days))):
        values = [v[i] for _, v in spend.series]
        if any(values):
            rows.append((spend.days[i], [console.usd(v) for v in values], console.usd(sum(values))))
    legend = [
        (name, PALETTE[-1] if name.startswith("other (") else PALETTE[min(i, len(PALETTE) - 1)])
        for i, (name, _) in enumerate(spend.series)
    ]
    return {"legend": legend, "rows": rows}


@register.simple_tag
def progress_svg(counts: dict, total: int) -> str:
    """A batch's items per state as one horizontal bar (completed, failed, cancelled, running, at the provider,
    waiting), with its text equivalent in the title."""
    states = (
        ("completed", "#2e7d32"),
        ("discarded", "#c62828"),
        ("cancelled", "#9e9e9e"),
        ("running", "#1565c0"),
        ("delegated", "#6a1b9a"),
        ("available", "#e0e0e0"),
    )
    total = max(total, sum(counts.values()), 1)
    x = 0.0
    parts = []
    for state, colour in states:
        n = counts.get(state, 0)
        if not n:
            continue
        w = n * 200 / total
        parts.append((f"{x:.1f}", f"{w:.1f}", colour, f"{state}: {n}"))
        x += w
    text = ", ".join(f"{counts.get(s, 0)} {s}" for s, _ in states if counts.get(s))
    return format_html(
        '<svg class="relay-bar" role="img" aria-label="{}" viewBox="0 0 200 10" width="200" height="10" '
        'xmlns="http://www.w3.org/2000/svg"><rect width="200" height="10" fill="#f5f5f5"/>{}</svg>',
        text or "no items yet",
        format_html_join("", '<rect x="{}" width="{}" height="10" fill="{}"><title>{}</title></rect>', parts),
    )


@register.filter
def qdt(value) -> str:
    """A time as a list filter's query value: ISO 8601 in UTC with its offset, URL-encoded."""
    if isinstance(value, date) and not isinstance(value, datetime):
        value = datetime.combine(value, time.min, tzinfo=UTC)
    return quote(value.astimezone(UTC).isoformat(sep=" ", timespec="seconds"))


@register.filter
def day_end(value: date) -> datetime:
    return datetime.combine(value + timedelta(days=1), time.min, tzinfo=UTC)


@register.filter
def utc(value):
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC") if value else "—"


@register.simple_tag
def surface_name(surface):
    return console.surface_name(surface)


@register.filter
def usd(nanos):
    return console.usd(nanos)
