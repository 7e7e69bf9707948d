"""The operator's pages for OpenAI-surface batches: their id, endpoint, files, metadata, errors, custom ids."""

import io
import json

import pytest
from django.urls import reverse

from batches import ingest
from batches.models import Batch, File
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import finalize, validation
from core import auth

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, django_user_model):
    # No password: hashing one is the slowest thing these tests would do.
    client.force_login(django_user_model.objects.create_user("root", is_staff=True, is_superuser=True))
    return client


def create(catalog, records):
    body = {
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "metadata": {"team": "search", "run": "nightly-7"},
        "requests": records,
    }
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**7, 100) as submission:
        return openai_create.create(auth.principal_for_key(catalog.key), submission)


def rec(custom_id, **body):
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": custom_id}], **body},
    }


def test_batch_page_shows_the_openai_fields(staff_client, catalog):
    batch = create(catalog, [rec("invoice-17", stream=True), rec("invoice-18", stream=True)])
    validation.validate(batch.id)
    finalize.finalize(batch.id)
    b = Batch.objects.get(pk=batch.pk)
    page = staff_client.get(reverse("admin:batches_batch_change", args=[b.pk])).content.decode()
    assert b.public_id in page and "/v1/chat/completions" in page and "nightly-7" in page
    assert "invoice-17" in page and "invoice-18" in page and "streaming_unsupported" in page
    assert f"file-{b.input_file_id.hex}" in page and f"file-{b.error_file_id.hex}" in page
    assert reverse("admin:batches_file_change", args=[b.error_file_id]) in page
    listing = staff_client.get(reverse("admin:batches_batch_changelist"), {"q": b.public_id}).content.decode()
    assert b.public_id in listing and "openai" in listing
    items = staff_client.get(reverse("admin:batches_item_changelist"), {"q": "invoice-18"}).content.decode()
    assert "invoice-18" in items and "invoice-17" not in items


def test_failed_validation_shows_its_errors(staff_client, catalog):
    batch = create(catalog, [rec("dup"), rec("dup")])
    validation.validate(batch.id)
    page = staff_client.get(reverse("admin:batches_batch_change", args=[batch.pk])).content.decode()
    assert "duplicate_custom_id" in page and "already used on line 1" in page


def test_file_page_previews_content(staff_client, catalog):
    batch = create(catalog, [rec("preview-me")])
    file = File.objects.get(pk=batch.input_file_id)
    page = staff_client.get(reverse("admin:batches_file_change", args=[file.pk])).content.decode()
    assert file.public_id in page and "preview-me" in page
    listing = staff_client.get(reverse("admin:batches_file_changelist"), {"q": file.public_id}).content.decode()
    assert file.filename in listing
