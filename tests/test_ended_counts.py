"""An ended batch's counts live on its row (Batch.ended_counts): written once when its last item became final,
read by the API, the admin's batches list and the console instead of the items."""

import io
import json

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from batches.lifecycle import stop
from batches.models import Batch, Item, ItemState
from batches.surfaces import common
from batches.surfaces.native import submit
from core import auth

pytestmark = pytest.mark.django_db


def _batch(catalog, n: int) -> Batch:
    principal = auth.principal_for_key(catalog.key)
    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * n}
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def _end(batch: Batch, completed: int) -> None:
    ids = list(Item.objects.filter(batch=batch).order_by("idx").values_list("pk", flat=True))
    now = timezone.now()
    Item.objects.filter(pk__in=ids[:completed]).update(state=ItemState.COMPLETED, finished_at=now)
    Item.objects.filter(pk__in=ids[completed:]).update(state=ItemState.DISCARDED, finished_at=now)


def test_the_last_final_item_writes_the_counts_once(catalog):
    batch = _batch(catalog, 5)
    assert stop.complete_if_done(batch.pk) is False
    assert Batch.objects.get(pk=batch.pk).ended_counts is None  # items pending: nothing kept
    _end(batch, completed=3)
    assert stop.complete_if_done(batch.pk) is True
    batch.refresh_from_db()
    assert batch.status == "completed" and batch.ended_counts == {"completed": 3, "discarded": 2}
    # Called again (the sweeper does), it keeps what the batch ended with: an item changed behind the relay's back
    # (which the relay never does to an ended batch) is not counted again.
    Item.objects.filter(batch=batch, state=ItemState.DISCARDED).delete()
    stop.complete_if_done(batch.pk)
    batch.refresh_from_db()
    assert batch.ended_counts == {"completed": 3, "discarded": 2}


def test_readers_take_an_ended_batchs_counts_from_its_row_and_a_running_ones_from_its_items(catalog, client):
    ended, running = _batch(catalog, 4), _batch(catalog, 2)
    _end(ended, completed=4)
    stop.complete_if_done(ended.pk)
    # The row, not the items, is what is read: items gone behind the relay's back leave the counts as they were.
    Item.objects.filter(batch=ended).delete()
    ended.refresh_from_db()
    assert common.counts(ended) == {"completed": 4}
    assert common.item_counts([ended, running]) == {ended.pk: {"completed": 4}, running.pk: {"available": 2}}
    with CaptureQueriesContext(connection) as queries:
        common.item_counts([ended])
    assert queries.captured_queries == []
    resp = client.get(f"/v1/batches/{ended.id}", headers={"Authorization": f"Bearer {catalog.key}"})
    assert json.loads(b"".join(resp.streaming_content))["counts"] == {"completed": 4}


def test_the_admin_batches_list_reads_items_only_for_running_batches(catalog, admin_client):
    ended, running = _batch(catalog, 3), _batch(catalog, 2)
    _end(ended, completed=1)
    stop.complete_if_done(ended.pk)
    with CaptureQueriesContext(connection) as queries:
        resp = admin_client.get("/admin/batches/batch/")
    assert resp.status_code == 200
    page = resp.content.decode()
    assert "1 / 2 / 0 / 0 / 0" in page and "0 / 0 / 0 / 0 / 2" in page
    item_reads = [q["sql"] for q in queries.captured_queries if 'FROM "batches_item"' in q["sql"]]
    assert len(item_reads) == 1 and str(running.pk).replace("-", "") in item_reads[0].replace("-", "")
    assert str(ended.pk).replace("-", "") not in item_reads[0].replace("-", "")
