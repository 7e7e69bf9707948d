"""The operator's batch pages: list with progress, batch with items, item with payloads, cancel action."""

import io
import json

import pytest
from django.urls import reverse
from django.utils import timezone

from batches import storage
from batches.models import Batch, Item
from batches.surfaces.native import submit
from relay import auth

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    return client


@pytest.fixture
def batch(catalog):
    principal = auth.principal_for_key(catalog.key)
    body = {
        "shape": "openai",
        "requests": [{"model": "gpt-4o", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)],
    }
    b = submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))
    first = Item.objects.get(batch=b, idx=0)
    ref = storage.write_result(str(b.id), str(first.id), b'{"id": "chatcmpl-x", "answer": "forty-two"}')
    Item.objects.filter(pk=first.pk).update(state="completed", result_ref=ref, finished_at=timezone.now())
    return b


def test_batch_list_shows_progress(staff_client, batch):
    page = staff_client.get(reverse("admin:batches_batch_changelist")).content.decode()
    assert str(batch.id) in page and "1 / 0 / 0 / 0 / 2" in page


def test_batch_page_lists_items_and_links_to_all(staff_client, batch):
    page = staff_client.get(reverse("admin:batches_batch_change", args=[batch.pk])).content.decode()
    assert "browse all 3 items" in page and "available" in page and "completed" in page


def test_item_page_shows_request_and_response(staff_client, batch):
    item = Item.objects.get(batch=batch, idx=0)
    page = staff_client.get(reverse("admin:batches_item_change", args=[item.pk])).content.decode()
    assert "q0" in page and "forty-two" in page


def test_cancel_action(staff_client, batch):
    resp = staff_client.post(
        reverse("admin:batches_batch_changelist"), {"action": "cancel_batches", "_selected_action": [batch.pk]}
    )
    assert resp.status_code == 302
    batch.refresh_from_db()
    assert batch.status == "cancelled" and batch.completed_at is not None
    assert set(Item.objects.filter(batch=batch).values_list("state", flat=True)) == {"completed", "cancelled"}
    assert Batch.objects.get(pk=batch.pk).cancel_requested_at is not None
