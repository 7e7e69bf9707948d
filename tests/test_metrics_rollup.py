"""The usage rollup behind /metrics (relay/metrics_rollup.py) counts every usage event exactly once,
however late its transaction commits, and its counters never step down when retention deletes rows."""

import importlib
import time
import uuid
from datetime import UTC, datetime, timedelta

import psycopg2
import pytest
from django.db import connection

from core.models import SpendRollup, UsageRollup, UsageRollupCursor
from relay import metrics_rollup
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)  # a second connection commits on its own


def _connect():
    s = connection.settings_dict
    return psycopg2.connect(
        dbname=s["NAME"], user=s["USER"], password=s["PASSWORD"], host=s["HOST"], port=s["PORT"] or 5432
    )


def _event(**fields) -> UsageEvent:
    values = {"request_id": uuid.uuid4().hex, "source": "live", "status": 200, "model": "gpt-4o", "host": "openai"}
    values.update(fields)
    return UsageEvent.objects.create(**values)


def _spend() -> dict:
    return {(r.day, r.project, r.model): (r.n, r.nanos) for r in SpendRollup.objects.all()}


def _totals() -> dict:
    out: dict = {}
    for r in UsageRollup.objects.all():
        key = (r.source, r.status)
        out[key] = out.get(key, 0) + r.n
    return out


def test_every_event_is_counted_once_and_sums_are_exact():
    for i in range(5):
        _event(input_tokens=10, output_tokens=i, cost_nano_usd=1_000, duration_ms=40)
    _event(source="batch", status=500, cost_nano_usd=2_000, billed_cost_nano_usd=1_000, executed_by="provider")
    assert metrics_rollup.advance() == 6
    assert metrics_rollup.advance() == 0  # nothing new: nothing counted twice
    assert _totals() == {("live", 200): 5, ("batch", 500): 1}
    live = UsageRollup.objects.get(source="live")
    assert (live.input_tokens, live.output_tokens, live.cost_nano_usd, live.billed_nano_usd) == (50, 10, 5_000, 5_000)
    assert live.duration_ms == 200 and live.buckets[0] == 5  # 40 ms ≤ 0.05 s
    batch = UsageRollup.objects.get(source="batch")
    assert batch.billed_nano_usd == 1_000 and batch.executed_by == "provider"


def test_an_event_committed_after_a_later_id_was_counted_is_still_counted():
    other = _connect()
    try:
        # The slow transaction takes its id first and commits last.
        with other.cursor() as cur:
            cur.execute(
                "INSERT INTO usage_usageevent (request_id, source, ts, status, duration_ms, attempts, error_kind,"
                " error_message, credential_kind, credential_id, principal_kind, project, team, policy, model,"
                " provider, host, batch_id, input_tokens, output_tokens, cache_read_tokens, cache_write_tokens,"
                " executed_by, usage_estimated, cost_nano_usd) VALUES (%s, 'live', now(), 200, 5, 1, '', '', '', '',"
                " '', '', '', '', 'gpt-4o', '', 'openai', '', 0, 0, 0, 0, 'relay', false, 7) RETURNING id",
                ["slow-" + uuid.uuid4().hex],
            )
            slow_id = cur.fetchone()[0]
        fast = _event(cost_nano_usd=5)
        assert fast.pk > slow_id
        assert metrics_rollup.advance() == 1  # the fast one; the slow id is a gap now
        cursor = UsageRollupCursor.objects.get(pk=1)
        assert cursor.last_id == fast.pk and any(lo <= slow_id <= hi for lo, hi, _ in cursor.gaps)
        other.commit()
        assert metrics_rollup.advance() == 1  # found in its gap
        assert _totals() == {("live", 200): 2}
        # The spend rollup is kept by the same run: the late event is in it too, once.
        assert [(r.n, r.nanos) for r in SpendRollup.objects.all()] == [(2, 12)]
        assert not any(lo <= slow_id <= hi for lo, hi, _ in UsageRollupCursor.objects.get(pk=1).gaps)
    finally:
        other.close()


def test_a_gap_that_never_fills_is_dropped_after_its_ttl(monkeypatch):
    first = _event()
    UsageEvent.objects.filter(pk=first.pk).delete()  # as if its transaction rolled back
    _event()
    assert metrics_rollup.advance() == 1
    assert any(lo <= first.pk <= hi for lo, hi, _ in UsageRollupCursor.objects.get(pk=1).gaps)
    monkeypatch.setattr(metrics_rollup, "GAP_TTL_S", 0)
    metrics_rollup.advance()
    assert UsageRollupCursor.objects.get(pk=1).gaps == []


def test_retention_deleting_events_does_not_step_counters_down():
    for _ in range(3):
        _event()
    metrics_rollup.advance()
    UsageEvent.objects.all().delete()
    _event()
    metrics_rollup.advance()
    assert _totals() == {("live", 200): 4}


def test_catch_up_reads_a_large_backlog_in_slices(monkeypatch):
    UsageEvent.objects.bulk_create(
        UsageEvent(request_id=uuid.uuid4().hex, source="live", status=200, model="gpt-4o") for _ in range(250)
    )
    monkeypatch.setattr(metrics_rollup, "MAX_ROWS_PER_RUN", 100)
    oldest = UsageEvent.objects.order_by("pk").values_list("pk", flat=True).first()
    UsageRollupCursor.objects.update_or_create(pk=1, defaults={"last_id": oldest - 1})  # caught up until now
    assert metrics_rollup.advance(max_rows=100) == 100
    assert metrics_rollup.catch_up() == 150
    assert _totals() == {("live", 200): 250}


def test_a_runner_that_finds_the_cursor_held_skips_instead_of_waiting():
    _event()
    UsageRollupCursor.objects.get_or_create(pk=1)
    other = _connect()
    try:
        with other.cursor() as cur:
            cur.execute("SELECT 1 FROM relay_usagerollupcursor WHERE id = 1 FOR UPDATE")
        assert metrics_rollup.advance() is None
    finally:
        # Rolled back, then closed: close() alone returns before the server's backend has exited and let go
        # of the row, and the next advance() found it still held now and then under load.
        other.rollback()
        other.close()
    assert metrics_rollup.advance() == 1


def test_spend_is_rolled_up_per_utc_day_project_and_model_at_the_billed_cost():
    day1 = datetime(2026, 3, 1, 23, 59, tzinfo=UTC)
    day2 = day1 + timedelta(minutes=2)  # the next UTC day
    _event(ts=day1, project="a", cost_nano_usd=100)
    _event(ts=day1, project="a", cost_nano_usd=200, billed_cost_nano_usd=50)  # a batch discount: billed wins
    _event(ts=day2, project="a", cost_nano_usd=10)
    _event(ts=day2, project="b", model="claude-sonnet", cost_nano_usd=1)
    _event(ts=day2, project="b", model="junk-model-name", status=404)  # unpriced: no cost, no row
    assert metrics_rollup.advance() == 5
    _event(ts=day2, project="a", cost_nano_usd=5)
    metrics_rollup.advance()  # a later run adds to the day's row
    assert _spend() == {
        (day1.date(), "a", "gpt-4o"): (2, 150),
        (day2.date(), "a", "gpt-4o"): (2, 15),
        (day2.date(), "b", "claude-sonnet"): (1, 1),
    }
    rows = sorted(metrics_rollup.spend_rows("project", day2.date()))
    assert rows == [(day2.date(), "a", 15), (day2.date(), "b", 1)]


def test_the_upgrade_counts_what_the_usage_rollup_had_already_passed_into_the_spend_rollup():
    """The migration that adds the spend rollup copies the events up to the usage rollup's cursor, less its gaps
    (which the next run counts into both), so the two rollups agree from then on."""
    from django.apps import apps

    for _ in range(3):
        _event(project="old", cost_nano_usd=100)
    in_gap = _event(project="old", cost_nano_usd=1_000)  # passed while its transaction was open
    _event(project="new", cost_nano_usd=7)  # not passed yet
    UsageRollupCursor.objects.update_or_create(
        pk=1, defaults={"last_id": in_gap.pk, "gaps": [[in_gap.pk, in_gap.pk, time.time()]]}
    )
    migration = importlib.import_module("core.migrations.0005_spend_rollup")
    with connection.schema_editor() as editor:
        migration.backfill(apps, editor)
    today = datetime.now(UTC).date()
    assert _spend() == {(today, "old", "gpt-4o"): (3, 300)}
    metrics_rollup.advance()
    assert _spend() == {(today, "old", "gpt-4o"): (4, 1_300), (today, "new", "gpt-4o"): (1, 7)}
