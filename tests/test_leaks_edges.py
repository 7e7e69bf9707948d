"""The smaller leak-review edges, in process against the real PostgreSQL and Redis: ids matched in full,
last-one-wins duplicate keys, short error messages, ASCII-only integers, Anthropic `params` checked at
create, the schema's x-api-key, parse errors that say where, bodies too large to build, the 408 that
names its limit, and a routing cache that junk model names cannot grow."""

import json
import socket
import time

import pytest
from django.test import Client, override_settings

from batches import storage
from batches.models import Batch, Item
from batches.surfaces.openai import read as openai_read
from batches.surfaces.openai import validation
from core import catalog as relay_catalog
from core import jsonguard
from gateway import edge

pytestmark = pytest.mark.django_db

MIB_KEY = "k" * (1024 * 1024)


def anthropic_req(custom_id, **params):
    body = {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **params}
    return {"custom_id": custom_id, "params": body}


def chat(content="hi"):
    return {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}


def auth(catalog):
    return {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}


def post(path, body, catalog, **extra):
    data = body if isinstance(body, str | bytes) else json.dumps(body)
    return Client().post(path, data=data, content_type="application/json", **auth(catalog), **extra)


def message_of(resp) -> str:
    err = resp.json()["error"]
    return err["message"]


# --- ids and custom_ids matched in full ---------------------------------------------------------


def test_an_anthropic_batch_id_with_a_trailing_newline_is_not_found_and_nothing_is_deleted(catalog):
    resp = post("/v1/messages/batches", {"requests": [anthropic_req("a")]}, catalog)
    assert resp.status_code == 200, resp.content
    public = resp.json()["id"]
    assert Client().post(f"/v1/messages/batches/{public}/cancel", **auth(catalog)).status_code == 200
    assert Batch.objects.get().status == "cancelled"  # ended: a DELETE of its id would remove it
    for suffix in ("%0A", "%0D%0A", "%20", "%00"):
        gone = Client().delete(f"/v1/messages/batches/{public}{suffix}", **auth(catalog))
        assert gone.status_code in (400, 404), (suffix, gone.content)
        assert Batch.objects.count() == 1, suffix
        got = Client().get(f"/anthropic/v1/messages/batches/{public}{suffix}", **auth(catalog))
        assert got.status_code in (400, 404), (suffix, got.content)
    assert Client().delete(f"/v1/messages/batches/{public}", **auth(catalog)).status_code == 200
    assert Batch.objects.count() == 0


def test_openai_and_native_ids_are_matched_in_full(catalog):
    hexid = "0" * 32
    assert openai_read.parse_public_id(f"batch_{hexid}\n", "batch_") is None
    assert openai_read.parse_public_id(f"file-{hexid}\n", "file-") is None
    assert openai_read.parse_public_id(f"batch_{hexid}", "batch_") is not None
    assert Client().get(f"/v1/batches/batch_{hexid}%0A", **auth(catalog)).status_code == 404
    assert Client().get(f"/v1/files/file-{hexid}%0A", **auth(catalog)).status_code == 404

    resp = post("/v1/batches", {"shape": "openai", "requests": [chat()]}, catalog)
    assert resp.status_code == 202, resp.content
    native = resp.json()["id"]
    assert Client().get(f"/v1/batches/{native}", **auth(catalog)).status_code == 200
    for other in (f"{native}%0A", f"%7B{native}%7D", f"urn:uuid:{native}", native.replace("-", "")):
        assert Client().get(f"/v1/batches/{other}", **auth(catalog)).status_code == 404, other
        assert Client().post(f"/v1/batches/{other}/cancel", **auth(catalog)).status_code == 404, other
    assert Batch.objects.get().status == "queued"  # nothing was cancelled through a near-miss id


def test_anthropic_custom_id_with_a_trailing_newline_is_refused_while_openai_takes_any_string(catalog):
    resp = post("/v1/messages/batches", {"requests": [anthropic_req("abc\n")]}, catalog)
    assert resp.status_code == 400, resp.content
    assert "requests.0.custom_id" in message_of(resp)
    assert Batch.objects.count() == 0
    line = json.dumps({"custom_id": "abc\n", "method": "POST", "url": "/v1/chat/completions", "body": chat()})
    record, error = validation._check(line.encode(), 1, "/v1/chat/completions", {})
    assert error is None and record["custom_id"] == "abc\n"


# --- duplicate keys: the last one wins ----------------------------------------------------------


def test_duplicate_requests_keys_in_an_anthropic_create_keep_the_last_array(catalog):
    body = (
        '{"requests": [' + json.dumps(anthropic_req("first")) + "," + json.dumps(anthropic_req("second")) + "],"
        ' "requests": [' + json.dumps(anthropic_req("third")) + "]}"
    )
    resp = post("/v1/messages/batches", body, catalog)
    assert resp.status_code == 200, resp.content
    assert resp.json()["request_counts"]["processing"] == 1
    assert list(Item.objects.values_list("idx", "custom_id")) == [(0, "third")]


def test_duplicate_requests_keys_in_a_native_batch_keep_the_last_array(catalog):
    # `shape` first: the native body is stored while it is read (surfaces.native.submit.store_native_streaming).
    body = (
        '{"shape": "openai", "requests": [' + json.dumps(chat("one")) + "," + json.dumps(chat("two")) + "],"
        ' "requests": [' + json.dumps(chat("three")) + "]}"
    )
    resp = post("/v1/batches", body, catalog)
    assert resp.status_code == 202, resp.content
    assert resp.json()["total_items"] == 1
    item = Item.objects.get()
    assert item.idx == 0 and json.loads(storage.read_input(item.input_ref))["messages"][0]["content"] == "three"


def test_duplicate_requests_keys_in_an_openai_create_keep_the_last_array(catalog):
    record = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": chat()}
    body = (
        '{"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": ['
        + json.dumps(dict(record, custom_id="a"))
        + ","
        + json.dumps(dict(record, custom_id="b"))
        + '], "requests": ['
        + json.dumps(record)
        + "]}"
    )
    resp = post("/v1/batches", body, catalog)
    assert resp.status_code == 200, resp.content
    download = Client().get(f"/v1/files/{resp.json()['input_file_id']}/content", **auth(catalog))
    content = b"".join(download.streaming_content)
    assert [json.loads(line)["custom_id"] for line in content.splitlines()] == ["c"]


# --- error messages quote at most 100 characters of a client value -----------------------------


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/messages/batches", {"requests": [anthropic_req("a")], MIB_KEY: 1}),
        ("/v1/messages/batches", {"requests": [dict(anthropic_req("a"), **{MIB_KEY: 1})]}),
        ("/v1/batches", {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [], MIB_KEY: 1}),
        ("/v1/batches", {"endpoint": "x" * 100_000, "completion_window": "24h", "requests": [chat()]}),
        ("/v1/chat/completions", {"model": "m" * 100_000, "messages": []}),
        ("/v1/chat/completions", {"model": "gpt-4o", "messages": [{MIB_KEY: "a\u0000b"}]}),
    ],
)
def test_a_400_about_a_huge_client_value_stays_short(catalog, path, body):
    resp = post(path, body, catalog)
    assert 400 <= resp.status_code < 500, resp.content[:300]
    assert len(resp.content) < 1000, resp.content[:300]
    err = resp.json()["error"]
    assert "k" * 101 not in json.dumps(err) and "x" * 101 not in json.dumps(err) and "m" * 101 not in json.dumps(err)


def test_a_huge_query_parameter_name_is_quoted_short(catalog):
    resp = Client().get("/v1/messages/batches", {"q" * 3000 + "\u0000": "1"}, **auth(catalog))
    assert resp.status_code == 400 and len(resp.content) < 600, resp.content[:300]


# --- integer query parameters: ASCII digits only -----------------------------------------------

BAD_INTEGERS = [" 5", "+5", "5_0", "\uff15", "\u0665", "", "5\n", "0x5", "5.0", "-1"]


@pytest.mark.parametrize("value", BAD_INTEGERS)
def test_limit_takes_ascii_digits_only_on_every_surface(catalog, value):
    anthropic = Client().get("/v1/messages/batches", {"limit": value}, **auth(catalog))
    assert anthropic.status_code == 400, anthropic.content
    assert anthropic.json()["type"] == "error" and "limit" in anthropic.json()["error"]["message"]
    for path in ("/v1/batches", "/v1/files"):
        openai = Client().get(path, {"limit": value}, **auth(catalog))
        assert openai.status_code == 400, (path, openai.content)
        assert openai.json()["error"]["param"] == "limit"
    usage = Client().get("/api/usage/events", {"limit": value}, **auth(catalog))
    assert usage.status_code == 400, usage.content


def test_limit_in_ascii_digits_still_works(catalog):
    assert Client().get("/v1/messages/batches", {"limit": "5"}, **auth(catalog)).status_code == 200
    assert Client().get("/v1/batches", {"limit": "5"}, **auth(catalog)).status_code == 200
    assert Client().get("/v1/files", {"limit": "005"}, **auth(catalog)).status_code == 200


def test_a_content_length_in_other_digits_is_a_400_not_a_500(catalog):
    resp = Client().post("/v1/chat/completions", b"{}", content_type="application/json", CONTENT_LENGTH="\u00b2")
    assert resp.status_code == 400, resp.content


# --- Anthropic params checked at create ---------------------------------------------------------


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({}, "params.model: Field required"),
        ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}, "params.model: Field required"),
        ({"model": 5, "max_tokens": 5, "messages": [1]}, "params.model: Input should be"),
        ({"model": "claude-sonnet", "messages": [{"role": "user", "content": "x"}]}, "max_tokens: Field required"),
        ({"model": "claude-sonnet", "max_tokens": 0, "messages": [1]}, "max_tokens: Input should be greater"),
        ({"model": "claude-sonnet", "max_tokens": "5", "messages": [1]}, "max_tokens: Input should be a valid integer"),
        ({"model": "claude-sonnet", "max_tokens": True, "messages": [1]}, "max_tokens: Input should be a valid"),
        ({"model": "claude-sonnet", "max_tokens": 1.5, "messages": [1]}, "max_tokens: Input should be a valid"),
        ({"model": "claude-sonnet", "max_tokens": 5}, "messages: Field required"),
        ({"model": "claude-sonnet", "max_tokens": 5, "messages": []}, "messages: List should have at least 1"),
        ({"model": "claude-sonnet", "max_tokens": 5, "messages": {}}, "messages: Input should be a valid list"),
    ],
)
def test_anthropic_params_are_checked_at_create_naming_the_request(catalog, params, fragment):
    body = {"requests": [anthropic_req("ok"), {"custom_id": "bad-one", "params": params}]}
    resp = post("/v1/messages/batches", body, catalog)
    assert resp.status_code == 400, resp.content
    message = message_of(resp)
    assert message.startswith("requests.1.params.") and fragment in message and "bad-one" in message, message
    assert resp.json()["error"]["type"] == "invalid_request_error"
    assert Batch.objects.count() == 0 and Item.objects.count() == 0


# --- the schema describes x-api-key -------------------------------------------------------------


def test_the_schema_describes_x_api_key_where_a_relay_credential_is_accepted(db):
    schema = Client().get("/api/schema/?format=json").json()
    schemes = schema["components"]["securitySchemes"]
    header_names = {s.get("name", "").lower() for s in schemes.values() if s["type"] == "apiKey"}
    assert "x-api-key" in header_names
    api_key_scheme = next(n for n, s in schemes.items() if s.get("name", "").lower() == "x-api-key")
    for path, method in (
        ("/v1/messages/batches", "post"),
        ("/anthropic/v1/messages", "post"),
        ("/v1/chat/completions", "post"),
        ("/v1/batches", "post"),
        ("/v1/files", "post"),
        ("/v1/models", "get"),
        ("/api/usage/events", "get"),
    ):
        security = schema["paths"][path][method]["security"]
        assert {api_key_scheme: []} in security and {"RelayKey": []} in security, (path, security)
    assert schema["paths"]["/healthz"]["get"]["security"] == []


def test_a_relay_key_in_x_api_key_is_accepted_where_the_schema_says(catalog):
    resp = Client().get("/v1/batches", HTTP_X_API_KEY=catalog.key)
    assert resp.status_code == 200, resp.content


# --- parse errors say where, in one sentence ----------------------------------------------------

BROKEN = '{"model": "gpt-4o",\n "messages": [}'


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/chat/completions", BROKEN),
        ("/v1/batches", '{"shape": "openai",\n "requests": [{"a": 1} {"b": 2}]}'),
        ("/v1/messages/batches", '{"requests":\n\n [ {"custom_id": "a",, }]}'),
        ("/v1/batches", '{"shape": "openai", "requests": ['),
    ],
)
def test_a_malformed_body_gets_one_plain_sentence_with_line_and_column(catalog, path, body):
    resp = post(path, body, catalog)
    assert resp.status_code == 400, resp.content
    message = message_of(resp)
    assert "line " in message and "column " in message, message
    assert "\n" not in message and "right here" not in message and "^" not in message, message
    assert message.count(".") <= 2, message  # one sentence (a trailing period, maybe one in the reason)


def test_where_names_the_line_and_column_of_the_mistake(catalog):
    live = message_of(post("/v1/chat/completions", BROKEN, catalog))
    assert "line 2, column 15" in live, live
    batch = message_of(post("/v1/batches", '{"shape": "openai",\n "requests": [{"a": 1} {"b": 2}]}', catalog))
    assert "line 2, column" in batch, batch


# --- what one request may make a web worker build ----------------------------------------------


def test_a_body_of_a_million_values_is_refused_before_it_is_built(catalog):
    many = "[" + ",".join(["[]"] * (jsonguard.MAX_VALUES + 1)) + "]"
    started = time.monotonic()
    live = post("/v1/chat/completions", '{"model": "gpt-4o", "messages": ' + many + "}", catalog)
    assert live.status_code == 400 and live.json()["error"]["code"] == "too_many_values", live.content[:300]
    batch = post("/v1/batches", '{"shape": "openai", "requests": [{"x": ' + many + "}]}", catalog)
    assert batch.status_code == 400 and "more than" in message_of(batch), batch.content[:300]
    top = post("/v1/messages/batches", '{"requests": [], "extra": ' + many + "}", catalog)
    assert top.status_code == 400, top.content[:300]
    assert time.monotonic() - started < 20
    assert Batch.objects.count() == 0
    # Commas inside strings are text, not values: a long CSV in a prompt is fine.
    csv = post("/v1/chat/completions", json.dumps(chat("," * (jsonguard.MAX_VALUES + 10))), catalog)
    assert csv.status_code == 200, csv.content[:300]


def test_junk_model_names_do_not_grow_the_routing_cache(catalog, monkeypatch):
    monkeypatch.setattr(relay_catalog, "MAX_CACHED_ROUTE_ERRORS", 40)
    client = Client()
    for i in range(120):
        model = f"junk-{i}" if i % 2 else f"junk-{i}-" + "y" * 500
        resp = client.post(
            "/v1/chat/completions", json.dumps(dict(chat(), model=model)), "application/json", **auth(catalog)
        )
        assert resp.status_code == 404, resp.content
    snap = relay_catalog.current()
    assert len(snap.routes) <= 40 + 10
    assert all(len(name) <= relay_catalog.ROUTE_NAME_MAX for _, name in snap.routes)


# --- the 408 names the limit that fired ---------------------------------------------------------


def _timeout_of(budget: float, idle: float) -> str:
    server, client = socket.socketpair()
    try:
        client.sendall(b"ab")  # a few bytes, then nothing
        raw = server.makefile("rb", buffering=0)
        with override_settings(RELAY_BODY_IDLE_SECONDS=idle):
            reader = edge._DeadlineInput(raw, server, budget)
            assert reader.read(2) == b"ab"
            with pytest.raises(edge.BodyTimeout) as caught:
                reader.read(10)
        return caught.value.message
    finally:
        server.close()
        client.close()


def test_the_408_names_the_idle_limit_when_it_fired():
    message = _timeout_of(budget=30.03, idle=0.3)
    assert "RELAY_BODY_IDLE_SECONDS" in message and "0.3 seconds" in message and "30.03" not in message, message


def test_the_408_names_the_deadline_when_it_fired():
    message = _timeout_of(budget=0.3, idle=15)
    assert "RELAY_BODY_READ_SECONDS" in message and "0.3 seconds" in message and "IDLE" not in message, message
