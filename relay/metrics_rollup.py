"""Usage counters for /metrics, kept incrementally instead of aggregating the usage table at each scrape.

At a million usage events a grouped query over the whole table took seconds per scrape. Instead,
`advance()` reads only the events written since it last ran and adds them to `UsageRollup` (a few
hundred rows: one per model × source × status × host × executed_by), and a scrape reads those rows.

Every row is counted once, however it was written (a live request, a batch finish's CTE, a provider
job's bulk insert, the sweeper). Ids come from a sequence, so they are handed out in order but committed
in any order: when `advance()` passes id 1,000 the transaction holding id 998 may still be open. So
every id it passes without seeing is kept as a gap and looked for again at each later run, until
GAP_TTL_S after it was first missed: longer than any transaction that writes usage events stays open
(each statement ends within RELAY_DB_STATEMENT_TIMEOUT_MS, an idle transaction within
RELAY_DB_IDLE_IN_TRANSACTION_TIMEOUT_MS). A gap that never fills is an id a rolled-back transaction
took.

The same run adds the events' billed spend per UTC day, project and model to `SpendRollup`, which the
console's 30-day chart reads (relay/console.py): one reader of the usage table, so the two rollups count
the same events, gaps included.

The same run counts finished batch items' run time (claim to finish) per final state: every item that
ran has exactly one usage event, written by the transaction that finishes it, so when the event is
visible the item is final; its id is the event's request_id.

One runner at a time: the cursor row is locked for the run (`SELECT … FOR UPDATE NOWAIT`; a second
runner skips rather than waits, so a scrape never queues behind the control worker's run). Each run
reads at most MAX_ROWS_PER_RUN new ids, so the first run over a large existing table is done in
slices by the beat job (`relay.tasks.roll_up_metrics`) rather than inside one scrape.
"""

from __future__ import annotations

import logging
import time
import uuid
from datetime import UTC

from django.db import DatabaseError, transaction
from django.db.models import Case, CharField, Count, F, Max, Q, Sum, Value, When
from django.db.models.functions import Coalesce, TruncDate

from core.models import ItemRunRollup, LLMModel, SpendRollup, UsageRollup, UsageRollupCursor

log = logging.getLogger(__name__)

UNKNOWN_MODEL = "unknown"
UPSTREAM_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RUN_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Item ids looked up per query when counting batch items' run times.
ITEM_CHUNK = 5_000
GAP_TTL_S = 600
MAX_ROWS_PER_RUN = 200_000
# Gap ranges looked up per query: an OR of this many BETWEENs stays one cheap index scan.
GAP_CHUNK = 200
LABELS = ("label", "source", "status", "host", "executed_by")
SUMS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens", "cost_nano_usd", "duration_ms")


def _catalog_model():
    """The event's model as a label: its own name when the catalog has that model, else "unknown"
    (folded by the database, so rows of junk names never reach this process one by one)."""
    return Case(
        When(model__in=LLMModel.objects.values("name"), then=F("model")),
        default=Value(UNKNOWN_MODEL),
        output_field=CharField(),
    )


def _grouped(events):
    """Per label set: count, sums, billed cost and the upstream duration buckets of `events`."""
    buckets = {
        f"le_{i}": Count("pk", filter=Q(duration_ms__lte=b * 1000) & ~Q(host=""))
        for i, b in enumerate(UPSTREAM_BUCKETS_S)
    }
    return (
        events.annotate(label=_catalog_model())
        .values(*LABELS)
        .annotate(
            n=Count("pk"),
            **{f"sum_{k}": Sum(k) for k in SUMS},
            billed_discounted=Sum("billed_cost_nano_usd"),
            billed_rest=Sum("cost_nano_usd", filter=Q(billed_cost_nano_usd__isnull=True)),
            **buckets,
        )
        .order_by()
    )


def _add(totals: dict, rows) -> int:
    n = 0
    for r in rows:
        key = tuple(r[k] for k in LABELS)
        t = totals.setdefault(
            key, {"n": 0, **dict.fromkeys(SUMS, 0), "billed": 0, "buckets": [0] * len(UPSTREAM_BUCKETS_S)}
        )
        t["n"] += r["n"]
        n += r["n"]
        for k in SUMS:
            t[k] += r[f"sum_{k}"] or 0
        t["billed"] += (r["billed_discounted"] or 0) + (r["billed_rest"] or 0)
        for i in range(len(UPSTREAM_BUCKETS_S)):
            t["buckets"][i] += r[f"le_{i}"]
    return n


# What a caller is charged for an event: the billed cost after batch discounts, else the cost.
CHARGED = Coalesce("billed_cost_nano_usd", "cost_nano_usd")
PRICED = Q(billed_cost_nano_usd__isnull=False) | Q(cost_nano_usd__isnull=False)


def _add_spend(spend: dict, events) -> None:
    """Add the billed spend of `events` per (UTC day, project, model). Unpriced events (refused, failed, an
    unknown model) add nothing and make no row, so junk model names never reach the table."""
    rows = (
        events.filter(PRICED)
        .annotate(day=TruncDate("ts", tzinfo=UTC))
        .values_list("day", "project", "model")
        .annotate(n=Count("pk"), nanos=Sum(CHARGED))
        .order_by()
    )
    for day, project, model, n, nanos in rows:
        t = spend.setdefault((day, project, model), [0, 0])
        t[0] += n
        t[1] += nanos or 0


def _add_runs(runs: dict, events) -> None:
    """Run times of the batch items whose usage events are `events` (an item's event is written by the
    transaction that finishes it, so the item is final when its event is visible)."""
    from django.db.models import DurationField, ExpressionWrapper

    from batches.models import Item

    ids = []
    for request_id in events.filter(source="batch").values_list("request_id", flat=True):
        try:
            ids.append(uuid.UUID(request_id))
        except ValueError:
            continue  # not an item's event (an id written by hand, an import): no run time to count
    run = ExpressionWrapper(F("finished_at") - F("started_at"), output_field=DurationField())
    for start in range(0, len(ids), ITEM_CHUNK):
        rows = (
            Item.objects.filter(pk__in=ids[start : start + ITEM_CHUNK], started_at__isnull=False)
            .exclude(finished_at__isnull=True)
            .annotate(run=run)
            .values("state")
            .annotate(
                n=Count("pk"),
                total=Sum("run"),
                **{f"le_{i}": Count("pk", filter=Q(run__lte=_seconds(b))) for i, b in enumerate(RUN_BUCKETS_S)},
            )
            .order_by()
        )
        for r in rows:
            t = runs.setdefault(r["state"], {"n": 0, "total_ms": 0, "buckets": [0] * len(RUN_BUCKETS_S)})
            t["n"] += r["n"]
            t["total_ms"] += round(r["total"].total_seconds() * 1000) if r["total"] else 0
            for i in range(len(RUN_BUCKETS_S)):
                t["buckets"][i] += r[f"le_{i}"]


def _seconds(s: float):
    from datetime import timedelta

    return timedelta(seconds=s)


def _missing(ids: list[int], after: int, upto: int, now: float) -> list[list]:
    """Ranges of ids in (after, upto] absent from the sorted `ids`."""
    gaps, expected = [], after + 1
    for i in ids:
        if i > expected:
            gaps.append([expected, i - 1, now])
        expected = i + 1
    if expected <= upto:
        gaps.append([expected, upto, now])
    return gaps


def _fill_gaps(events, gaps: list[list], totals: dict, runs: dict, spend: dict, now: float) -> tuple[list[list], int]:
    """Count the events that appeared in earlier gaps; return the gaps still open (and unexpired)."""
    live = [g for g in gaps if now - g[2] < GAP_TTL_S]
    if len(live) < len(gaps):
        log.info(
            "usage rollup: %d id ranges never committed (rolled back); no longer looked for", len(gaps) - len(live)
        )
    found_ids: list[int] = []
    counted = 0
    for start in range(0, len(live), GAP_CHUNK):
        chunk = live[start : start + GAP_CHUNK]
        where = Q()
        for lo, hi, _ in chunk:
            where |= Q(pk__gte=lo, pk__lte=hi)
        ids = list(events.filter(where).values_list("pk", flat=True))
        if ids:
            found_ids += ids
            counted += _add(totals, _grouped(events.filter(where)))
            _add_runs(runs, events.filter(where))
            _add_spend(spend, events.filter(where))
    if not found_ids:
        return live, 0
    found = sorted(found_ids)
    still: list[list] = []
    for lo, hi, seen in live:
        inside = [i for i in found if lo <= i <= hi]
        still += _missing(inside, lo - 1, hi, seen)  # a split gap keeps the time it was first missed
    return still, counted


def advance(max_rows: int = MAX_ROWS_PER_RUN, *, wait: bool = False) -> int | None:
    """Add the usage events written since the last run to the rollup. Returns how many were counted, or
    None when another runner holds the cursor (`wait=False`)."""
    from usage.models import UsageEvent

    now = time.time()
    with transaction.atomic():
        UsageRollupCursor.objects.get_or_create(pk=1)
        try:
            cursor = UsageRollupCursor.objects.select_for_update(nowait=not wait).get(pk=1)
        except DatabaseError:
            return None
        events = UsageEvent.objects.all()
        totals: dict = {}
        runs: dict = {}
        spend: dict = {}
        gaps, counted = _fill_gaps(events, list(cursor.gaps), totals, runs, spend, now)
        newest = events.filter(pk__gt=cursor.last_id).aggregate(m=Max("pk"))["m"]
        last = cursor.last_id
        if newest is not None:
            upto = min(newest, last + max_rows)
            fresh = events.filter(pk__gt=last, pk__lte=upto)
            ids = list(fresh.order_by("pk").values_list("pk", flat=True))
            gaps += _missing(ids, last, upto, now)
            if ids:
                counted += _add(totals, _grouped(fresh))
                _add_runs(runs, fresh)
                _add_spend(spend, fresh)
            last = upto
        _store(totals)
        _store_runs(runs)
        _store_spend(spend)
        UsageRollupCursor.objects.filter(pk=1).update(last_id=last, gaps=gaps)
    return counted


def _store(totals: dict) -> None:
    if not totals:
        return
    # The cursor's lock makes this run the only writer: read the (few hundred) rows and write them back.
    existing = {(r.model, r.source, r.status, r.host, r.executed_by): r for r in UsageRollup.objects.all()}
    created, updated = [], []
    for key, t in totals.items():
        row = existing.get(key)
        if row is None:
            row = UsageRollup(model=key[0], source=key[1], status=key[2], host=key[3], executed_by=key[4])
            row.buckets = [0] * len(UPSTREAM_BUCKETS_S)
            created.append(row)
        else:
            updated.append(row)
        row.n += t["n"]
        for k in SUMS:
            setattr(row, k, getattr(row, k) + t[k])
        row.billed_nano_usd += t["billed"]
        row.buckets = [a + b for a, b in zip(row.buckets or [0] * len(UPSTREAM_BUCKETS_S), t["buckets"], strict=True)]
    UsageRollup.objects.bulk_create(created)
    if updated:
        UsageRollup.objects.bulk_update(updated, ["n", *SUMS, "billed_nano_usd", "buckets"])


def _store_runs(runs: dict) -> None:
    for state, t in runs.items():
        row, _ = ItemRunRollup.objects.get_or_create(state=state, defaults={"buckets": [0] * len(RUN_BUCKETS_S)})
        row.n += t["n"]
        row.total_ms += t["total_ms"]
        row.buckets = [a + b for a, b in zip(row.buckets or [0] * len(RUN_BUCKETS_S), t["buckets"], strict=True)]
        row.save(update_fields=["n", "total_ms", "buckets"])


def _store_spend(spend: dict) -> None:
    if not spend:
        return
    # The cursor's lock makes this run the only writer: read the rows of the days this run touched (one or two,
    # but for a catch-up over history) and write them back.
    days = {day for day, _, _ in spend}
    existing = {(r.day, r.project, r.model): r for r in SpendRollup.objects.filter(day__in=days)}
    created, updated = [], []
    for key, (n, nanos) in spend.items():
        row = existing.get(key)
        if row is None:
            created.append(SpendRollup(day=key[0], project=key[1], model=key[2], n=n, nanos=nanos))
        else:
            row.n += n
            row.nanos += nanos
            updated.append(row)
    SpendRollup.objects.bulk_create(created)
    if updated:
        SpendRollup.objects.bulk_update(updated, ["n", "nanos"])


def catch_up() -> int:
    """Run until the rollup has passed every id written so far (the beat job; also after a bulk import)."""
    from usage.models import UsageEvent

    total = 0
    while True:
        total += advance(wait=True) or 0
        newest = UsageEvent.objects.aggregate(m=Max("pk"))["m"] or 0
        if UsageRollupCursor.objects.get(pk=1).last_id >= newest:
            return total


def rows():
    """The usage rollup rows, for the scrape."""
    return UsageRollup.objects.all()


def spend_rows(by: str, first):
    """(day, project or model, nano-USD) from `first` (a date) on, for the console's chart."""
    return SpendRollup.objects.filter(day__gte=first).values_list("day", by).annotate(nanos=Sum("nanos")).order_by()


def run_rows():
    """The item run-time rollup rows, for the scrape."""
    return ItemRunRollup.objects.all()
