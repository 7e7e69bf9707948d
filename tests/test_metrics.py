"""GET /metrics: protected by the admin token, and after a batch has run it shows every series the
operator needs — computed from PostgreSQL and Redis, so it answers for every process."""

import io
import json

import pytest
from django.conf import settings
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from batches import dispatch, ingest
from batches.lifecycle import claim as claims
from batches.surfaces.native import submit
from batches.worker import execute
from core import auth
from core.crypto import sha256_hex
from policies import breaker
from policies.models import Policy
from tests import factories

pytestmark = pytest.mark.django_db(transaction=True)  # items run with their heartbeat on its own connection

ADMIN = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}


def scrape() -> tuple[str, dict]:
    resp = Client().get("/metrics", **ADMIN)
    assert resp.status_code == 200 and resp["Content-Type"].startswith("text/plain")
    text = resp.content.decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return text, samples


def value(samples, metric, /, **labels):
    return samples.get((metric, tuple(sorted(labels.items()))))


def test_metrics_need_the_admin_token(db):
    assert Client().get("/metrics").status_code == 401
    assert Client().get("/metrics", HTTP_AUTHORIZATION="Bearer nope").status_code == 401


def test_metrics_after_a_batch_runs(catalog, fake):
    principal = auth._principal_from_key(catalog.key)
    body = {
        "shape": "openai",
        "requests": [{"model": "gpt-4o", "messages": [{"role": "user", "content": f"q{i}"}]} for i in range(3)],
    }
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        batch = submit.store_native(principal, submission)
    while (item := claims.claim("metrics-test:1:1")) is not None:
        execute.run_item(item)
    batch.refresh_from_db()
    assert batch.status == "completed"

    # A live call, then one refused by the policy's inbound limit.
    Policy.objects.filter(pk=catalog.policy.pk).update(
        rate_limit=factories.rate_limit("one-a-minute", ("requests", 1, 60, "sliding-window"))
    )
    c = Client()
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    h = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    assert c.post("/v1/chat/completions", json.dumps(chat), content_type="application/json", **h).status_code == 200
    assert c.post("/v1/chat/completions", json.dumps(chat), content_type="application/json", **h).status_code == 429

    # One host key's breaker open.
    breaker.record_failure(sha256_hex("upstream-openai-0")[:12], breaker.Failure.SERVER)

    text, samples = scrape()
    assert value(samples, "relay_batch_items", state="completed") == 3
    assert value(samples, "relay_batch_items", state="running") == 0
    # The next scrape reads the terminal states' counts from their 60 s cache: the same figures.
    assert value(scrape()[1], "relay_batch_items", state="completed") == 3
    assert value(samples, "relay_batches", surface="native", status="completed") == 1
    depth = dispatch.queue_length(dispatch.ITEM_QUEUE)  # wake-ups no worker took (none runs here)
    assert value(samples, "relay_queue_depth", queue="batch") == depth
    assert value(samples, "relay_queue_depth", queue="default") == 0
    assert value(samples, "relay_queue_depth", queue="control") == dispatch.queue_length(dispatch.CONTROL_QUEUE)

    assert value(samples, "relay_item_run_seconds_count", state="completed") == 3
    assert value(samples, "relay_item_run_seconds_bucket", state="completed", le="+Inf") == 3
    assert value(samples, "relay_upstream_request_seconds_count", host="openai", status="200", source="batch") == 3
    assert value(samples, "relay_upstream_request_seconds_count", host="openai", status="200", source="live") == 1

    assert value(samples, "relay_breaker_state", host="openai", key="openai-0", state="open") == 1
    assert value(samples, "relay_breaker_state", host="openai", key="openai-1", state="closed") == 1
    assert "upstream-openai-0" not in text and sha256_hex("upstream-openai-0")[:12] not in text  # never the key

    assert value(samples, "relay_ratelimit_denials_total", scope="policy", name="pol-a", meter="requests") == 1

    assert value(samples, "relay_usage_requests_total", model="gpt-4o", source="batch", status="200") == 3
    assert value(samples, "relay_usage_tokens_total", model="gpt-4o", source="batch", kind="input") > 0
    assert value(samples, "relay_usage_tokens_total", model="gpt-4o", source="live", kind="output") > 0
    assert value(samples, "relay_usage_cost_usd_total", model="gpt-4o", source="batch") > 0
    assert value(samples, "relay_usage_billed_cost_usd_total", model="gpt-4o", source="batch") == value(
        samples, "relay_usage_cost_usd_total", model="gpt-4o", source="batch"
    )  # native batches carry no discount
    assert ("relay_worker_slots_busy", ()) not in samples  # nothing running now: no series
    assert all(v == 0 for (name, _), v in samples.items() if name == "relay_scrape_error")


def test_worker_slots_busy_counts_running_items_per_host(catalog):
    from django.utils import timezone

    from batches.models import Item

    principal = auth._principal_from_key(catalog.key)
    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * 3}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        batch = submit.store_native(principal, submission)
    lease = timezone.now() + timezone.timedelta(minutes=1)
    for i, item in enumerate(Item.objects.filter(batch=batch).order_by("idx")[:2]):
        Item.objects.filter(pk=item.pk).update(state="running", lease_owner=f"node-a:{i}:1", lease_expires_at=lease)
    _, samples = scrape()
    assert value(samples, "relay_worker_slots_busy", worker="node-a") == 2


def test_a_failing_source_is_reported_and_the_rest_served(catalog, settings):
    settings.CELERY_BROKER_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    _, samples = scrape()
    assert value(samples, "relay_scrape_error", source="queue_depth") == 1
    assert value(samples, "relay_scrape_error", source="batch_items") == 0
    assert value(samples, "relay_batch_items", state="completed") == 0
