"""What clients written elsewhere expect at a gateway's edges: the relay's request id on every answer,
every documented prefix, Anthropic's envelope on Anthropic routes (live included), count_tokens, the
native surface's 400 for an oversized body, a cursor that does not decode, every live worker's slots
in /metrics, and a Responses model in the demo catalog."""

import json
import logging
import socket
from pathlib import Path

import pytest
import requests
from django.conf import settings
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from batches.worker import warmup
from core.models import ServiceAccount
from core.services import create_relay_key
from relay.config_apply import apply_config, load_file
from tests.workers import wait_for
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def bearer(key):
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


def post(path, body, **headers):
    return Client().post(path, data=json.dumps(body), content_type="application/json", **headers)


# --- request ids ------------------------------------------------------------------------------------


def test_every_answer_carries_the_relays_request_id_and_the_live_one_is_the_usage_events(catalog, fake):
    ok = post("/v1/chat/completions", CHAT, **bearer(catalog.key))
    assert ok.status_code == 200, ok.content
    rid = ok["X-Request-ID"]
    assert rid == ok["X-Relay-Request-ID"] and "Request-ID" not in ok  # request-id: Anthropic routes only
    assert UsageEvent.objects.get(request_id=rid).model == "gpt-4o"
    answers = [
        Client().get("/v1/batches", **bearer(catalog.key)),
        Client().get("/v1/files", **bearer(catalog.key)),
        Client().get("/v1/batches/nope", **bearer(catalog.key)),
        post("/v1/chat/completions", {"model": "no-such-model", "messages": []}, **bearer(catalog.key)),
        Client().get("/healthz"),
        Client().get("/v1/no-such-route"),
        Client().get("/v1/models", **bearer(catalog.key)),
    ]
    ids = [resp["X-Request-ID"] for resp in answers]
    assert len(set(ids + [rid])) == len(answers) + 1  # one id per request, never reused


def test_anthropic_routes_also_answer_request_id_the_anthropic_sdk_reads(catalog, fake):
    for path in ("/v1/messages", "/anthropic/v1/messages"):
        resp = post(path, MESSAGES, HTTP_X_API_KEY=catalog.key)
        assert resp.status_code == 200, resp.content
        assert resp["Request-ID"] == resp["X-Request-ID"] == resp["X-Relay-Request-ID"]
    listed = Client().get("/v1/messages/batches", HTTP_X_API_KEY=catalog.key)
    assert listed.status_code == 200 and listed["Request-ID"] == listed["X-Request-ID"]


def test_a_client_sent_request_id_is_logged_not_taken(catalog, fake, caplog):
    caplog.set_level(logging.INFO, logger="gateway.edge")
    resp = post("/v1/chat/completions", CHAT, HTTP_X_REQUEST_ID="client-id-123", **bearer(catalog.key))
    assert resp.status_code == 200
    assert resp["X-Request-ID"] != "client-id-123"
    assert any("client-id-123" in r.getMessage() and resp["X-Request-ID"] in r.getMessage() for r in caplog.records)


def test_the_sdks_see_the_request_id(live_server, catalog, fake):
    import anthropic
    import openai

    oa = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=catalog.key, max_retries=0)
    completion = oa.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert completion._request_id
    wait_for(lambda: UsageEvent.objects.filter(request_id=completion._request_id).exists(), 10, what="the event")
    raw = oa.batches.with_raw_response.list()
    assert raw.headers["x-request-id"] and raw.request_id == raw.headers["x-request-id"]
    an = anthropic.Anthropic(base_url=live_server.url, api_key=catalog.key, max_retries=0)
    message = an.messages.create(**MESSAGES)
    # The usage event is written once the answer has gone (gateway/inference.py): waited for.
    wait_for(lambda: UsageEvent.objects.filter(request_id=message._request_id).exists(), 10, what="the event")


# --- prefixes ---------------------------------------------------------------------------------------


def test_files_and_batches_are_served_under_openai_v1_too(live_server, catalog, fake, tmp_path):
    import openai

    client = openai.OpenAI(base_url=f"{live_server.url}/openai/v1", api_key=catalog.key, max_retries=0)
    path = tmp_path / "in.jsonl"
    record = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    path.write_text(json.dumps(record) + "\n")
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.id.startswith("batch_") and client.batches.retrieve(batch.id).id == batch.id
    assert [b.id for b in client.batches.list()] == [batch.id]
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    assert client.models.list().data
    missing = requests.get(
        f"{live_server.url}/openai/v1/batches/batch_nope", headers={"Authorization": f"Bearer {catalog.key}"}
    )
    assert missing.status_code == 404 and "error" in missing.json() and missing.headers["x-request-id"]


# --- Anthropic's envelope on the live routes, count_tokens ------------------------------------------


@pytest.mark.parametrize("prefix", ["", "/anthropic"])
def test_live_anthropic_errors_are_in_anthropics_envelope(catalog, fake, prefix):
    path = f"{prefix}/v1/messages"
    missing_key = post(path, MESSAGES)
    assert missing_key.status_code == 401
    assert missing_key.json()["type"] == "error" and missing_key.json()["error"]["type"] == "authentication_error"
    unknown = post(path, dict(MESSAGES, model="no-such-model"), HTTP_X_API_KEY=catalog.key)
    assert unknown.status_code == 404, unknown.content
    assert unknown.json()["type"] == "error" and unknown.json()["error"]["type"] == "not_found_error"
    assert unknown.json()["error"]["code"] == "model_not_found"
    streamed = post(f"{path}/count_tokens", dict(MESSAGES, stream=True), HTTP_X_API_KEY=catalog.key)
    assert streamed.status_code == 400 and streamed.json()["type"] == "error"  # counting does not stream
    assert streamed.json()["error"]["type"] == "invalid_request_error"
    upstream = post(path, MESSAGES, HTTP_X_API_KEY=catalog.key)  # the provider's own answers pass as they are
    assert upstream.status_code == 200


@pytest.mark.parametrize("prefix", ["", "/anthropic"])
def test_count_tokens_is_forwarded_to_an_anthropic_binding(catalog, fake, prefix):
    body = {"model": "claude-sonnet", "messages": [{"role": "user", "content": "one two three"}]}
    resp = post(f"{prefix}/v1/messages/count_tokens", body, HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 200, resp.content
    assert resp.json() == {"input_tokens": 3}
    sent = fake.received[-1]
    assert sent["path"] == "/v1/messages/count_tokens" and sent["body"]["model"] == "claude-sonnet-4"
    event = UsageEvent.objects.get(request_id=resp["Request-ID"])
    assert event.cost_nano_usd in (0, None) and event.input_tokens == 0  # counting tokens costs nothing
    refused = post(f"{prefix}/v1/messages/count_tokens", dict(body, model="gpt-4o"), HTTP_X_API_KEY=catalog.key)
    assert refused.status_code == 400 and refused.json()["type"] == "error"


# --- native oversized body, usage cursor ----------------------------------------------------------


def test_an_oversized_native_batch_body_is_a_400_before_it_is_read(live_server, catalog, settings):
    settings.RELAY_MAX_REQUEST_BYTES = 1000
    host, port = live_server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/batches HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {catalog.key}\r\nContent-Length: 5000000\r\n\r\n".encode()
        )  # no body follows: the answer must not wait for it
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(
            next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        )
        while len(body) < length:
            body += sock.recv(65536)
        answer = (head + b"\r\n\r\n" + body).decode()
    assert answer.startswith("HTTP/1.1 400"), answer[:200]
    assert "request_too_large" in answer


def test_a_usage_cursor_that_does_not_decode_is_a_400(catalog):
    admin = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
    for cursor in ("MDoA", "%%%", "bm9wZQ"):
        resp = Client().get(f"/api/usage/events?cursor={cursor}", **admin)
        assert resp.status_code == 400, (cursor, resp.content)


# --- /metrics: every live worker's slots ----------------------------------------------------------


def test_metrics_show_every_live_workers_slots_idle_ones_at_zero(catalog):
    warmup.announce_once(8)
    resp = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {settings.RELAY_ADMIN_TOKEN}")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(resp.content.decode())
        for s in family.samples
    }
    host = socket.gethostname()
    assert samples[("relay_worker_slots", (("worker", host),))] == 8
    assert samples[("relay_worker_slots_busy", (("worker", host),))] == 0
    assert samples[("relay_queue_depth", (("queue", "control"),))] == 0


# --- the demo catalog serves the Responses API ------------------------------------------------------


def test_the_demo_catalog_serves_v1_responses(fake):
    doc = load_file(str(Path(settings.BASE_DIR) / "deploy" / "demo-catalog.yaml"))
    for host in doc["hosts"]:
        host["base_url"] = fake.url
    import os

    os.environ.setdefault("RELAY_HOSTKEY_DEMO", "demo-upstream-key")
    apply_config(doc)
    _, key = create_relay_key(service_account=ServiceAccount.objects.get(name="demo-client"), name="t")
    resp = post("/v1/responses", {"model": "gpt-4.1-mini", "input": "hello"}, **bearer(key))
    assert resp.status_code == 200, resp.content
    assert resp.json()["object"] == "response"


def test_a_method_a_live_anthropic_route_lacks_is_405_in_anthropics_envelope_with_allow(catalog):
    resp = Client().get("/v1/messages", HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 405 and resp.json()["type"] == "error"
    assert resp.json()["error"]["type"] == "invalid_request_error" and "POST" in resp["Allow"]


def test_the_envelope_follows_the_route_not_its_prefix(catalog):
    anthropic_shaped = post("/openai/v1/messages", MESSAGES)
    assert anthropic_shaped.status_code == 401 and anthropic_shaped.json()["type"] == "error"
    assert anthropic_shaped["Request-ID"] == anthropic_shaped["X-Request-ID"]
    openai_shaped = post("/anthropic/v1/chat/completions", CHAT)
    assert openai_shaped.status_code == 401 and "type" not in openai_shaped.json()
    assert openai_shaped.json()["error"]["code"] and "Request-ID" not in openai_shaped
