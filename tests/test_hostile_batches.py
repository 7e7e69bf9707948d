"""Batches on hostile input: never stuck in validating, never a crashed item, no key echo
in results, `openrelay` never forwarded, honest cancel answers, no filesystem path in messages.

Items run in process through batches.draining.drain (the worker's own code path)."""

import json

import pytest
from django.conf import settings
from django.test import Client

from batches import storage
from batches.models import Batch, File
from batches.surfaces.openai import validation
from batches.worker import drain as draining
from devkit.upstream import Reply

pytestmark = pytest.mark.django_db(transaction=True)

KEYS = ["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"]


@pytest.fixture
def api(catalog, fake):
    client = Client(raise_request_exception=False)
    auth = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}

    class Api:
        def post(self, path, body: bytes | dict, **extra):
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            return client.post(path, data=data, content_type="application/json", **auth, **extra)

        def get(self, path):
            return client.get(path, **auth)

        def upload(self, content: bytes, filename="in.jsonl"):
            from django.core.files.uploadedfile import SimpleUploadedFile

            f = SimpleUploadedFile(filename, content, content_type="application/jsonl")
            resp = client.post("/v1/files", data={"purpose": "batch", "file": f}, **auth)
            assert resp.status_code == 200, resp.content
            return resp.json()["id"]

    return Api()


def _line(custom_id="r1", model="gpt-4o", raw_body=None) -> bytes:
    body = raw_body or json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    cid = custom_id[4:] if custom_id.startswith("RAW:") else json.dumps(custom_id)
    return (
        '{"custom_id": ' + cid + ', "method": "POST", "url": "/v1/chat/completions", "body": ' + body + "}"
    ).encode()


GOOD = _line("ok-1")
DEEP = "[" * 10_000 + "]" * 10_000
FROM_FILE = {"endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.mark.parametrize(
    "bad_line,code",
    [
        (_line("RAW:" + '"a\\u0000b"'), "invalid_characters"),
        (_line("RAW:" + '"a\\ud800b"'), "invalid_characters"),
        (_line("x", raw_body='{"model": "gpt\\u0000", "messages": []}'), "invalid_characters"),
        (_line("x", raw_body='{"model": "gpt\\udfff", "messages": []}'), "invalid_characters"),
        (
            _line("x", raw_body='{"model": "gpt-4o", "messages": ' + "[" * 10_000 + "]" * 10_000 + "}"),
            "nesting_too_deep",
        ),
        (_line("x", raw_body='{"model": "gpt-4o", "temperature": NaN}'), "non_finite_number"),
        (b'{"custom_id": "\xff\xfe", "method": "POST"}', "invalid_json_line"),
    ],
)
def test_a_hostile_line_fails_the_batch_with_errors_data_never_stuck(api, bad_line, code):
    file_id = api.upload(b"\xef\xbb\xbf" + GOOD + b"\n" + bad_line + b"\n")
    resp = api.post(
        "/v1/batches", {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    assert resp.status_code == 200, resp.content
    batch_id = resp.json()["id"]
    validation.validate(Batch.objects.get(surface="openai").pk)  # what the validate task runs
    batch = api.get(f"/v1/batches/{batch_id}").json()
    assert batch["status"] == "failed", batch
    errors = batch["errors"]["data"]
    assert errors and errors[0]["code"] == code and errors[0]["line"] == 2, errors


def test_native_item_with_nul_model_is_refused_at_submit_naming_the_field(api):
    # (A lone surrogate in a POST /v1/batches body is replaced by U+003F by the streaming parser, yajl.)
    for model in ('"gpt\\u0000"', '{"a": "\\u0000"}', DEEP):
        raw = b'{"shape": "openai", "requests": [{"model": "gpt-4o"}, {"model": %s}]}' % model.encode()
        resp = api.post("/v1/batches", raw)
        assert resp.status_code == 400, resp.content
        assert resp.json()["error"]["param"].startswith("requests[1]"), resp.json()
    assert Batch.objects.count() == 0


def test_host_key_echoed_by_the_provider_never_reaches_batch_results(api, fake):
    for key in KEYS:
        body = {"error": {"message": f"Incorrect API key provided: {key}", "type": "invalid_request_error"}}
        fake.script(key, [Reply(status=401, body=body)])
    resp = api.post("/v1/batches", {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}]})
    assert resp.status_code == 202, resp.content
    draining.drain(max_items=5, max_seconds=60)
    results = b"".join(api.get(f"/v1/batches/{resp.json()['id']}/results").streaming_content).decode()
    assert "401" in results
    assert not any(k in results for k in KEYS), results
    from batches.models import Item

    assert not any(k in (i.error_body + i.error) for i in Item.objects.all() for k in KEYS)


def test_openrelay_of_a_native_item_never_reaches_the_provider(api, fake):
    item = {
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}],
        "openrelay": {"tool_config": {"tools": [{"authorization": "Bearer tool-secret"}]}},
    }
    resp = api.post("/v1/batches", {"shape": "openai", "requests": [item]})
    assert resp.status_code == 202, resp.content
    draining.drain(max_items=5, max_seconds=60)
    assert fake.received, "the item ran"
    assert all("openrelay" not in r["body"] for r in fake.received)


def test_native_cancel_of_a_finished_batch_answers_its_real_status(api, fake):
    resp = api.post("/v1/batches", {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}]})
    batch_id = resp.json()["id"]
    draining.drain(max_items=5, max_seconds=60)
    assert Batch.objects.get(pk=batch_id).status == "completed"
    resp = api.post(f"/v1/batches/{batch_id}/cancel", b"")
    assert resp.status_code == 200 and resp.json() == {"status": "completed"}
    assert Batch.objects.get(pk=batch_id).status == "completed"


def test_empty_input_file_id_is_400_with_param_and_creates_nothing(api):
    resp = api.post(
        "/v1/batches", {"input_file_id": "", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "input_file_id"
    assert File.objects.count() == 0 and Batch.objects.count() == 0


def test_file_content_gone_while_read_is_404_without_a_path(api):
    file_id = api.upload(GOOD + b"\n")
    storage.delete_file(File.objects.get().ref)  # the bytes go, as in a delete racing this read
    resp = api.get(f"/v1/files/{file_id}/content")
    assert resp.status_code == 404, resp.content
    message = resp.json()["error"]["message"]
    assert str(settings.RELAY_BATCH_PAYLOAD_DIR) not in message and "/" not in message.replace(file_id, "")
