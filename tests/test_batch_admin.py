"""The operator's batch pages: list with progress, batch with items, item with payloads, cancel action."""

import io
import json

import pytest
from django.urls import reverse
from django.utils import timezone

from batches import storage
from batches.models import Batch, Item
from batches.surfaces.native import submit
from core import auth

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


def test_every_surfaces_batch_is_found_by_its_public_id_and_shown_as_its_api_shows_it(staff_client, batch, catalog):
    import html

    from batches import ingest
    from batches.surfaces.anthropic import create as anthropic_create
    from batches.surfaces.openai import create as openai_create

    principal = auth.principal_for_key(catalog.key)
    params = {"model": "claude-sonnet", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    body = {"requests": [{"custom_id": "a", "params": params}]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50) as sub:
        anthropic = anthropic_create.create(principal, sub)
    record = {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "gpt-4o"}}
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [record]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50) as sub:
        openai = openai_create.create(principal, sub)
    changelist = reverse("admin:batches_batch_changelist")
    for b, public, shown in (
        (batch, str(batch.id), '"Status": "queued"'),
        (openai, openai.public_id, '"object": "batch"'),
        (anthropic, anthropic.public_id, '"type": "message_batch"'),
    ):
        found = staff_client.get(changelist, {"q": public}).content.decode()
        assert str(b.id) in found and found.count("/change/") >= 1
        others = {batch.id, openai.id, anthropic.id} - {b.id}
        assert not any(str(other) in found for other in others)
        page = html.unescape(staff_client.get(reverse("admin:batches_batch_change", args=[b.pk])).content.decode())
        assert "As its API shows it" in page and shown in page and public in page
    assert str(batch.id) not in staff_client.get(changelist, {"q": "msgbatch_" + "0" * 32}).content.decode()
