"""Reads for the operator's console, the admin's landing page: what runs now, what it costs, what fails.

Reads only, and cheap at a million items and usage events: every figure comes from a small table (batches,
provider jobs, budgets, endpoints, the catalog), a partial index (running items), Redis (queues, breakers,
slots), the rollups /metrics' run keeps (relay/metrics_rollup.py: usage per label set, spend per day ×
project × model), or an index range over the last hour of usage events. Spend per day over 30 days is read
from the spend rollup (at most 31 days × projects × models rows), not grouped from a month of usage events,
so no load pays a scan that grows with traffic (bench/scale.py measures it). No read runs once per row shown.

Each panel is computed on its own: one that fails (Redis down) says so in its place and the others are
still shown, as /metrics does per source.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from types import SimpleNamespace

from django.db.models import Count, F, Q, Sum
from django.utils import timezone

from core.admin_base import SURFACE_NAMES, surface_name, usd
from relay import metrics, metrics_rollup

log = logging.getLogger(__name__)

SPEND_DAYS = 30
SPEND_SERIES = 6  # the biggest series of the chart; the rest are stacked as "other"
IN_FLIGHT_SHOWN = 10
BUDGET_WARN = 0.8
TROUBLE_WINDOW = timedelta(hours=1)
EXPIRY_SOON = timedelta(hours=2)
EXPIRED_RECENTLY = timedelta(days=1)
GROUPINGS = ("project", "model")


def _safe(fn, *args):
    try:
        return fn(*args), ""
    except Exception as exc:  # one panel's source is down: the page says so and shows the rest
        log.warning("console: %s failed", fn.__name__, exc_info=True)
        return None, f"{type(exc).__name__}: {exc}"[:200]


# --- now ---------------------------------------------------------------------------------------------


@dataclass
class InFlight:
    batch_id: object
    public_id: str
    surface: str
    status: str
    created_at: datetime
    counts: dict  # state → items
    total: int
    eta: datetime | None
    provider_done: int = 0

    @property
    def done(self) -> int:
        return sum(self.counts.get(s, 0) for s in ("completed", "discarded", "cancelled"))

    @property
    def percent(self) -> int:
        return self.done * 100 // self.total if self.total else 0


def in_flight(now: datetime) -> dict:
    """Open batches per surface, and the newest IN_FLIGHT_SHOWN with their items per state and an estimated
    finish: the items left at the batch's own drain rate so far (items done / time since it began), or,
    for records at the provider, its jobs' reported progress. Three queries."""
    from batches.lifecycle.states import OPEN
    from batches.models import Batch
    from batches.provider.models import OPEN_JOB_STATUSES, ProviderJob
    from batches.surfaces import common

    open_q = Q()
    for surface, statuses in OPEN.items():
        open_q |= Q(surface=surface, status__in=statuses)
    per_surface = dict(Batch.objects.filter(open_q).values_list("surface").annotate(n=Count("pk")).order_by())
    shown = list(
        Batch.objects.filter(open_q)
        .order_by("-created_at")
        .values("id", "surface", "status", "created_at", "in_progress_at", "total_items", "ended_counts")[
            :IN_FLIGHT_SHOWN
        ]
    )
    ids = [b["id"] for b in shown]
    counts = common.item_counts([SimpleNamespace(pk=b["id"], ended_counts=b["ended_counts"]) for b in shown])
    at_provider = dict(
        ProviderJob.objects.filter(batch_id__in=ids, status__in=OPEN_JOB_STATUSES)
        .values_list("batch_id")
        .annotate(n=Sum(F("completed") + F("failed")))
        .order_by()
    )
    rows = []
    for b in shown:
        by_state = counts.get(b["id"], {})
        total = max(b["total_items"] or 0, sum(by_state.values()))
        provider_done = at_provider.get(b["id"]) or 0
        done = sum(by_state.get(s, 0) for s in ("completed", "discarded", "cancelled")) + provider_done
        began = b["in_progress_at"] or b["created_at"]
        elapsed = (now - began).total_seconds()
        eta = None
        if 0 < done < total and elapsed > 0:
            eta = now + timedelta(seconds=(total - done) * elapsed / done)
        rows.append(
            InFlight(
                batch_id=b["id"],
                public_id=_public_id(b["surface"], b["id"]),
                surface=b["surface"],
                status=b["status"],
                created_at=b["created_at"],
                counts=by_state,
                total=total,
                eta=eta,
                provider_done=provider_done,
            )
        )
    return {
        "per_surface": [(s, surface_name(s), per_surface.get(s, 0)) for s in SURFACE_NAMES],
        "shown": rows,
        "more": sum(per_surface.values()) - len(rows),
    }


def _public_id(surface: str, batch_id) -> str:
    from batches.models import Batch

    return Batch(id=batch_id, surface=surface).public_id


def workers() -> dict:
    busy, capacity = metrics.slots_busy(), metrics.slots_capacity()
    return {"busy": sum(busy.values()), "total": sum(capacity.values()), "hosts": len(set(busy) | set(capacity))}


def provider_jobs() -> list[tuple[str, int]]:
    from batches.provider.models import JobStatus, ProviderJob

    counts = dict(ProviderJob.objects.values_list("status").annotate(n=Count("pk")).order_by())
    return [(s.value, counts.get(s.value, 0)) for s in JobStatus]


def open_breakers() -> list[dict]:
    return [
        {"host": host, "key": key, **snap, "open_until_dt": _epoch(snap["open_until"])}
        for host, key, snap in metrics.breaker_snapshots()
        if snap["state"] != "closed"
    ]


def _epoch(value) -> datetime | None:
    return datetime.fromtimestamp(value, tz=UTC) if value else None


def failing_endpoints() -> list:
    from batches.webhooks.models import WebhookEndpoint

    return list(
        WebhookEndpoint.objects.filter(Q(failing_since__isnull=False) | Q(paused_at__isnull=False))
        .order_by("failing_since")
        .only("id", "name", "url", "failing_since", "paused_at", "last_failure_at")[:20]
    )


# --- money -------------------------------------------------------------------------------------------


@dataclass
class Spend:
    by: str
    days: list[date]
    series: list[tuple[str, list[int]]]  # (name, nano-USD per day), biggest first, "other" last
    today_nanos: int
    month_nanos: int

    @property
    def month_start(self) -> date:
        return self.days[-1].replace(day=1)

    @property
    def totals(self) -> list[int]:
        return [sum(values[i] for _, values in self.series) for i in range(len(self.days))]


def spend(by: str, now: datetime) -> Spend:
    """Billed spend per UTC day for the last SPEND_DAYS days, stacked by project or by model, and today's
    and this month's totals (what callers are charged: the billed cost after batch discounts, else the
    cost). One read of the spend rollup, which the page's refresh_rollup() has just brought up to date."""
    by = by if by in GROUPINGS else GROUPINGS[0]
    today = now.astimezone(UTC).date()
    first = min(today - timedelta(days=SPEND_DAYS - 1), today.replace(day=1))
    rows = [(day, name, int(nanos or 0)) for day, name, nanos in metrics_rollup.spend_rows(by, first)]
    days = [today - timedelta(days=SPEND_DAYS - 1 - i) for i in range(SPEND_DAYS)]
    index = {d: i for i, d in enumerate(days)}
    per_name: dict[str, list[int]] = {}
    today_nanos = month_nanos = 0
    for day, name, nanos in rows:
        if day == today:
            today_nanos += nanos
        if day >= today.replace(day=1):
            month_nanos += nanos
        if day in index:
            per_name.setdefault(name or "(none)", [0] * SPEND_DAYS)[index[day]] += nanos
    ranked = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    series = ranked[:SPEND_SERIES]
    if len(ranked) > SPEND_SERIES:
        other = [sum(v[i] for _, v in ranked[SPEND_SERIES:]) for i in range(SPEND_DAYS)]
        series.append((f"other ({len(ranked) - SPEND_SERIES})", other))
    return Spend(by, days, series, today_nanos, month_nanos)


def provider_savings() -> dict:
    """What the provider batch mode saved, from the usage rollup: the records the provider ran priced at their
    model's live rates, less what the provider charged (their batch price). Since the rollup began."""
    from core.models import HostBinding
    from usage import pricing
    from usage.tokens import Tokens

    rows = [r for r in metrics_rollup.rows() if r.executed_by == "provider"]
    prices = {}
    for b in HostBinding.objects.filter(pricing__isnull=False).select_related("model", "pricing").order_by("-enabled"):
        prices.setdefault(b.model.name, b.pricing)
    live = paid = records = 0
    for r in rows:
        tokens = Tokens(
            input=r.input_tokens,
            output=r.output_tokens,
            cache_read=r.cache_read_tokens,
            cache_write=r.cache_write_tokens,
        )
        at_live = pricing.cost_nano_usd(prices.get(r.model), tokens)
        if at_live is None:
            continue  # unpriced: nothing to compare
        live += at_live
        paid += r.cost_nano_usd
        records += r.n
    return {"records": records, "live_nanos": live, "paid_nanos": paid, "saved_nanos": max(0, live - paid)}


def budgets(now: datetime) -> list[dict]:
    """Enabled budgets with spent and reserved in their current period, those at BUDGET_WARN or above first."""
    from usage import budgets as spend_budgets
    from usage.models import Budget

    rows = list(
        Budget.objects.filter(enabled=True).select_related("project", "team", "service_account__project", "policy")
    )
    out = []
    for s in spend_budgets.standings(rows, now):
        used = s.spent_nanos + s.reserved_nanos
        ratio = used / s.budget.usd_nanos if s.budget.usd_nanos else (1.0 if used else 0.0)
        kind, _ = s.budget.scope
        out.append(
            {
                "budget": s.budget,
                "scope": f"{kind.replace('_', ' ')} {spend_budgets.scope_name(s.budget)}",
                "spent": usd(s.spent_nanos),
                "reserved": usd(s.reserved_nanos),
                "limit": usd(s.budget.usd_nanos),
                "percent": round(ratio * 100),
                "bar": min(100, round(ratio * 100)),
                "warn": ratio >= BUDGET_WARN,
                "ends": s.period_ends_at,
            }
        )
    out.sort(key=lambda r: (not r["warn"], -r["percent"], r["budget"].name))
    return out


# --- trouble -----------------------------------------------------------------------------------------


def trouble(now: datetime) -> dict:
    """Failures of the last TROUBLE_WINDOW from the usage events (every request and batch record has one;
    one index range over `ts`): batch records failed by reason, and the top error codes per host."""
    from usage.models import UsageEvent

    since = now - TROUBLE_WINDOW
    failed = (
        UsageEvent.objects.filter(ts__gte=since)
        .filter(Q(status__lt=200) | Q(status__gte=300))
        .values_list("source", "host", "error_kind", "status")
        .annotate(n=Count("pk"))
        .order_by()
    )
    batch_reasons: dict[str, int] = {}
    per_host: dict[str, dict[str, int]] = {}
    for source, host, kind, status, n in failed:
        code = kind or (f"HTTP {status}" if status else "refused")
        if source == "batch":
            batch_reasons[code] = batch_reasons.get(code, 0) + n
        codes = per_host.setdefault(host or "(before any host)", {})
        codes[code] = codes.get(code, 0) + n
    hosts = sorted(
        (
            (host, sorted(codes.items(), key=lambda kv: -kv[1])[:3], sum(codes.values()))
            for host, codes in per_host.items()
        ),
        key=lambda h: -h[2],
    )
    return {
        "since": since,
        "batch_reasons": sorted(batch_reasons.items(), key=lambda kv: -kv[1]),
        "hosts": hosts,
    }


def expiries(now: datetime) -> dict:
    """Batches that expired in the last day, and open ones whose window closes within EXPIRY_SOON."""
    from batches.lifecycle.states import OPEN
    from batches.models import Batch

    expired = Batch.objects.filter(status="expired", expired_at__gte=now - EXPIRED_RECENTLY).count()
    open_q = Q()
    for surface, statuses in OPEN.items():
        if surface != "native":
            open_q |= Q(surface=surface, status__in=statuses)
    soon = list(
        Batch.objects.filter(open_q, expires_at__lt=now + EXPIRY_SOON)
        .order_by("expires_at")
        .values("id", "surface", "expires_at")[:10]
    )
    for b in soon:
        b["public_id"] = _public_id(b["surface"], b["id"])
    return {"expired": expired, "soon": soon, "since": now - EXPIRED_RECENTLY}


# --- the page ----------------------------------------------------------------------------------------


def refresh_rollup() -> None:
    """Count the usage events written since the rollup's last run, as a scrape does (relay/metrics.py); when
    the control worker's run holds the rollup the page shows it as it stands. A write, so not in `landing`."""
    _safe(metrics_rollup.advance, metrics.SCRAPE_MAX_ROWS)


def landing(by: str = "project", now: datetime | None = None) -> dict:
    """Every panel of the landing page; a panel whose source failed is None with its error beside it."""
    now = now or timezone.now()
    out: dict = {"now": now, "by": by if by in GROUPINGS else GROUPINGS[0], "errors": {}}
    panels = {
        "in_flight": (in_flight, now),
        "queues": (metrics.queue_depths,),
        "workers": (workers,),
        "provider_jobs": (provider_jobs,),
        "breakers": (open_breakers,),
        "endpoints": (failing_endpoints,),
        "spend": (spend, out["by"], now),
        "savings": (provider_savings,),
        "budgets": (budgets, now),
        "trouble": (trouble, now),
        "expiries": (expiries, now),
    }
    for name, (fn, *args) in panels.items():
        out[name], error = _safe(fn, *args)
        if error:
            out["errors"][name] = error
    return out
