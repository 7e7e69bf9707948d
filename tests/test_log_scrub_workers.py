"""The secret-scrubbing log filter is on every background process's handlers, not only the web's: Celery
replaces the root logger's handlers in its worker and beat processes (relay/celery.py puts the filter back).

Real processes (tests/workers.py), each made to log a secret it knows: Celery logs the whole body of a
message whose task it does not know, arguments included, at ERROR."""

import json
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from batches import queues
from batches.models import Batch
from core.scrub import REDACTED
from relay.celery import app
from tests.workers import wait_for

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def log_text(worker, role: str) -> str:
    log = worker.logs[role]
    log.flush()
    return Path(log.name).read_text(errors="replace")


def test_item_and_control_workers_scrub_the_secrets_they_log(catalog, fake, workers):
    fleet = workers("scrub")
    # The item worker runs a record, so it knows the pool's host-key values (as it does in production).
    resp = Client().post(
        "/v1/batches",
        data=json.dumps({"shape": "openai", "requests": [CHAT]}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {catalog.key}",
    )
    assert resp.status_code == 202, resp.content
    batch_id = resp.json()["id"]
    wait_for(lambda: Batch.objects.get(pk=batch_id).completed_at, 60, what="the batch to run")
    host_key = "upstream-openai-0"
    assert fake.received[-1]["key"] == host_key

    app.send_task("relay.tests.no_such_task", args=[host_key], queue=queues.ITEM_QUEUE)
    app.send_task("relay.tests.no_such_task", args=[settings.RELAY_ADMIN_TOKEN], queue=queues.CONTROL_QUEUE)
    for role in ("worker", "control"):
        wait_for(lambda r=role: "no_such_task" in log_text(fleet, r), 60, what=f"the {role} to log the message")
        text = log_text(fleet, role)
        assert REDACTED in text, text[-2000:]
    assert host_key not in log_text(fleet, "worker")
    assert settings.RELAY_ADMIN_TOKEN not in log_text(fleet, "control")
