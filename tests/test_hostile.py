"""Hostile input over every route: no 5xx, every error JSON in its envelope, nothing left behind.

Hundreds of generated requests go through Django's full stack in process (middleware,
handlers, views, the real PostgreSQL and Redis; the fake upstream answers what gets
through). For every answer ≥ 400 the database and the payload store are unchanged.
"""

import io
import json
from pathlib import Path

import pytest
from django.conf import settings
from django.test import Client

from batches.models import Batch, File, Item, Payload
from gateway.inference import inference_urls

pytestmark = pytest.mark.django_db(transaction=True)

ADMIN = {"HTTP_AUTHORIZATION": "Bearer test-admin-token"}
# Answered only in OpenAI's envelope (POST /v1/batches answers a native body in the relay's).
OPENAI_SURFACE = ("/v1/files", "/v1/batches/batch_")

NUL = '"a\\u0000b"'
SURROGATE = '"a\\ud800b"'
DEEP = "[" * 10_000 + "]" * 10_000
DEEP_OBJ = '{"a":' * 10_000 + "1" + "}" * 10_000
# JSON text fragments put in place of one value: the hostile-input forms plus wrong types.
HOSTILE_VALUES = [
    NUL,
    SURROGATE,
    DEEP,
    DEEP_OBJ,
    "NaN",
    "Infinity",
    "-Infinity",
    "1e400",
    "-1e400",
    "123",
    "true",
    "null",
    "[]",
    "{}",
    '[{"a": [null, {"b": "\\u0000"}]}]',
    '"' + "x" * 200_000 + '"',
    '{"\\u0000": 1}',
    '{"k\\udc00": "v"}',
]


def _paths_of_live_routes():
    return sorted({"/" + str(p.pattern) for p in inference_urls()})


def _state():
    root = Path(settings.RELAY_BATCH_PAYLOAD_DIR)
    files = sorted(str(p) for p in root.rglob("*")) if root.exists() else []
    return (Batch.objects.count(), Item.objects.count(), File.objects.count(), Payload.objects.count(), files)


class Probe:
    """Sends one request, checks the answer, records every violation."""

    def __init__(self, key):
        self.client = Client(raise_request_exception=False)
        self.key = key
        self.sent = 0
        self.problems: list[str] = []

    def auth(self, admin=False):
        return ADMIN if admin else {"HTTP_AUTHORIZATION": f"Bearer {self.key}"}

    def send(self, method, path, data=b"", content_type="application/json", admin=False, **extra):
        before = _state()
        headers = {**self.auth(admin), **extra}
        resp = self.client.generic(method, path, data=data, content_type=content_type, **headers)
        self.sent += 1
        self.check(method, path, resp, before)
        return resp

    def check(self, method, path, resp, before):
        where = f"{method} {path[:80]!r} → {resp.status_code}"
        if resp.status_code >= 500:
            self.problems.append(f"{where}: 5xx {resp.content[:200]!r}")
            return
        if resp.status_code < 400:
            return
        if not resp.get("Content-Type", "").startswith("application/json"):
            self.problems.append(f"{where}: not JSON ({resp.get('Content-Type')}) {resp.content[:100]!r}")
            return
        try:
            err = json.loads(resp.content)["error"]
            assert isinstance(err["message"], str) and err["message"]
            assert isinstance(err["type"], str)
            if path.startswith(OPENAI_SURFACE) and not path.endswith("/results"):  # results: native only
                assert {"message", "type", "param", "code"} <= set(err), "OpenAI envelope"
            assert str(settings.RELAY_BATCH_PAYLOAD_DIR) not in err["message"], "a filesystem path in the message"
            assert "Traceback" not in err["message"]
        except Exception as exc:  # noqa: BLE001 - recorded, reported together
            self.problems.append(f"{where}: bad envelope ({exc!r}) {resp.content[:200]!r}")
            return
        if _state() != before:
            self.problems.append(f"{where}: a refused request left rows or payload files behind")


def _replace(template: str, value: str) -> bytes:
    return template.replace("@", value).encode("utf-8", "surrogatepass")


@pytest.fixture
def probe(catalog, tmp_path):
    from django.test import override_settings

    with override_settings(RELAY_BATCH_PAYLOAD_DIR=str(tmp_path / "payloads")):
        yield Probe(catalog.key)


def test_live_routes_refuse_hostile_json_cleanly(probe):
    templates = [
        '{"model": @, "messages": [{"role": "user", "content": "hi"}]}',
        '{"model": "gpt-4o", "messages": [{"role": "user", "content": @}]}',
        '{"model": "gpt-4o", "messages": @}',
        '{"model": "gpt-4o", "max_tokens": @, "messages": [{"role": "user", "content": "hi"}]}',
    ]
    paths = _paths_of_live_routes()
    for path in paths:  # every live route, with and without the /openai and /anthropic prefixes
        for value in (NUL, SURROGATE, DEEP, "NaN", "1e400"):
            probe.send("POST", path, _replace(templates[0], value))
    for template in templates[1:]:
        for value in HOSTILE_VALUES:
            probe.send("POST", "/v1/chat/completions", _replace(template, value))
    for raw in (
        b"",
        b"[]",
        b'"x"',
        b"1e400",
        b"\xef\xbb\xbf{}",
        b'{"model": "\xff\xfe"}',
        b'{"model": "gpt-4o", "model": "\\u0000"}',  # duplicate keys: the last one is checked
        b'{"model": "gpt-4o", "messages": [], "stream": "yes"}',
        b"{" * 100,
        b'{"a": 1',
    ):
        probe.send("POST", "/v1/messages", raw)
        probe.send("POST", "/anthropic/v1/messages", raw, content_type="text/plain")
    probe.send("POST", "/v1/chat/completions", b"model=x", content_type="application/x-www-form-urlencoded")
    probe.send("POST", "/v1/chat/completions", b"--b\r\n", content_type="multipart/form-data; boundary=b")
    assert probe.sent >= 100
    assert not probe.problems, "\n".join(probe.problems)


def test_batch_creation_refuses_hostile_json_cleanly(probe):
    native = '{"shape": "openai", "requests": [{"model": @, "messages": [{"role": "user", "content": "hi"}]}]}'
    native_shape = '{"shape": @, "requests": [{"model": "gpt-4o"}]}'
    openai_meta = '{"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [], "metadata": @}'
    openai_model = '{"endpoint": "/v1/chat/completions", "completion_window": "24h", "input_file_id": "x", "model": @}'
    openai_file = '{"endpoint": "/v1/chat/completions", "completion_window": "24h", "input_file_id": @}'
    openai_endpoint = '{"endpoint": @, "completion_window": "24h", "input_file_id": "file-x"}'
    for template in (native, native_shape, openai_meta, openai_model, openai_file, openai_endpoint):
        for value in HOSTILE_VALUES:
            probe.send("POST", "/v1/batches", _replace(template, value))
    for file_id in ('""', '"   "', '"../../etc/passwd"', '"file-\\u0000"', '"file-' + "0" * 32 + '"'):
        probe.send("POST", "/v1/batches", _replace(openai_file, file_id))
    for raw in (b"", b"[]", b"\xef\xbb\xbf{}", b'{"shape": "openai", "requests": [1]}', b'{"\xff": 1}'):
        probe.send("POST", "/v1/batches", raw)
    probe.send("POST", "/v1/batches", b"{}", content_type="text/plain")
    assert probe.sent >= 100
    assert not probe.problems, "\n".join(probe.problems)


def test_ids_query_parameters_methods_and_unknown_routes(probe):
    ids = [
        "..%2F..%2Fetc%2Fpasswd",
        "%2e%2e",
        "%00",
        "batch_%00",
        "batch_" + "f" * 32 + "%00",
        "file-" + "0" * 32 + "%00",
        "%ED%A0%80",  # an encoded lone surrogate
        "%FF%FE",
        "batch_" + "z" * 300,
        "x" * 5000,
    ]
    for id_ in ids:
        probe.send("GET", f"/v1/batches/{id_}")
        probe.send("GET", f"/v1/batches/{id_}/results")
        probe.send("POST", f"/v1/batches/{id_}/cancel")
        probe.send("GET", f"/v1/files/{id_}")
        probe.send("GET", f"/v1/files/{id_}/content")
        probe.send("DELETE", f"/v1/files/{id_}")
    for name in ("team", "policy", "project", "model", "host", "status", "cursor", "since", "from", "to", "limit"):
        for value in ("%00", "%ED%A0%80", "1e400", "NaN", "-1", "x" * 3000):
            for admin in (True, False):
                probe.send("GET", f"/api/usage/events?{name}={value}", admin=admin)
        probe.send("GET", f"/api/usage/summary?{name}=%00&group_by=team", admin=True)
    for query in ("after=%00", "limit=%00", "limit=1e400", "purpose=%00", "order=%00", "%00=1"):
        probe.send("GET", f"/v1/batches?{query}")
        probe.send("GET", f"/v1/files?{query}")
    for method, path in [
        ("DELETE", "/v1/chat/completions"),
        ("GET", "/v1/messages"),
        ("PUT", "/v1/batches"),
        ("PATCH", "/v1/files"),
        ("GET", "/v1/nope"),
        ("GET", "/openai/v1/nope"),
        ("POST", "/anthropic/nope"),
        ("GET", "/api/nope"),
        ("GET", "/v1/chat/completions/%00"),
    ]:
        probe.send(method, path)
    assert probe.sent >= 200
    assert not probe.problems, "\n".join(probe.problems)


def test_uploads_and_jsonl_with_hostile_names_and_bytes(probe):
    boundary = "XbOuNdArY"

    def multipart(filename: bytes, content: bytes, purpose: bytes = b"batch") -> bytes:
        return (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n'.encode()
            + purpose
            + f'\r\n--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
            + filename
            + b'"\r\nContent-Type: application/octet-stream\r\n\r\n'
            + content
            + f"\r\n--{boundary}--\r\n".encode()
        )

    ctype = f"multipart/form-data; boundary={boundary}"
    contents = [b"\xef\xbb\xbf{}\n", b"\xff\xfe\n", b'{"custom_id": "\\u0000"}\n', b"\x00\x00", b""]
    names = [b"../../etc/passwd", b"..\\..\\x.jsonl", b"a\x00b.jsonl", b"\xff.jsonl", b"/etc/shadow", b"ok.jsonl"]
    for name in names:
        for content in contents:
            resp = probe.send("POST", "/v1/files", multipart(name, content), content_type=ctype)
            if resp.status_code == 200:
                body = resp.json()
                assert "/" not in body["filename"] and "\x00" not in body["filename"], body
                probe.send("DELETE", f"/v1/files/{body['id']}")
    for purpose in (b"\x00", b"fine-tune", b"\xff"):
        probe.send("POST", "/v1/files", multipart(b"a.jsonl", b"{}\n", purpose), content_type=ctype)
    probe.send("POST", "/v1/files", b'{"file": "x"}')
    probe.send("POST", "/v1/files", b"--nope--", content_type=ctype)
    assert not probe.problems, "\n".join(probe.problems)


def test_declared_oversize_and_chunked_bodies(probe, fake):
    big = str(settings.RELAY_MAX_REQUEST_BYTES + 1)
    upload_big = str(settings.RELAY_MAX_UPLOAD_BYTES + 2 * 1024 * 1024)
    for path in ("/v1/chat/completions", "/anthropic/v1/messages", "/v1/batches", "/api/usage/events"):
        resp = probe.send("POST", path, b"{}", CONTENT_LENGTH=big)
        assert resp.status_code == (400 if path == "/v1/batches" else 413), (path, resp.content)
    resp = probe.send("POST", "/v1/files", b"{}", CONTENT_LENGTH=upload_big)
    assert resp.status_code == 413 and resp.json()["error"]["param"] == "file"  # the upload's own answer
    resp = probe.send("POST", "/v1/chat/completions", b"{}", CONTENT_LENGTH="12abc")
    assert resp.status_code == 400
    body = json.dumps({"model": "gpt-4o", "messages": [{"role": "user", "content": "chunked"}]}).encode()
    # A server that de-chunks the body (gunicorn sets wsgi.input_terminated): read correctly.
    chunked = {"HTTP_TRANSFER_ENCODING": "chunked", "CONTENT_LENGTH": ""}
    resp = probe.send(
        "POST",
        "/v1/chat/completions",
        **chunked,
        **{"wsgi.input": io.BytesIO(body), "wsgi.input_terminated": True},
    )
    assert resp.status_code == 200, resp.content
    assert fake.received[-1]["body"]["messages"][0]["content"] == "chunked"
    # A server that does not: refused clearly rather than read as empty.
    resp = probe.send("POST", "/v1/chat/completions", **chunked, **{"wsgi.input": io.BytesIO(body)})
    assert resp.status_code == 411, resp.content
    # Chunked and over the limit: 413.
    with_limit = {"wsgi.input": io.BytesIO(b" " * 2048 + body), "wsgi.input_terminated": True}
    from django.test import override_settings

    with override_settings(RELAY_MAX_REQUEST_BYTES=1024):
        resp = probe.send("POST", "/v1/chat/completions", **chunked, **with_limit)
    assert resp.status_code == 413, resp.content
    resp = probe.send("GET", "/v1/models?" + "a=b&" * 2000)
    assert resp.status_code == 414
    assert not probe.problems, "\n".join(probe.problems)


def test_an_unexpected_exception_is_logged_with_its_request_id_and_answered_500_json(caplog):
    from django.test import RequestFactory

    from gateway.edge import EdgeMiddleware

    request = RequestFactory().post("/v1/chat/completions", data=b"{}", content_type="application/json")
    request.relay_request_id = "req-123"
    response = EdgeMiddleware(lambda r: None).process_exception(
        request, OSError("[Errno 2] No such file: '/srv/relay/payloads/x'")
    )
    assert response.status_code == 500 and response["Content-Type"].startswith("application/json")
    err = json.loads(response.content)["error"]
    assert err["code"] == "internal_error" and "req-123" in err["message"]
    assert "/srv" not in response.content.decode() and "Errno" not in response.content.decode()
    assert response["X-Relay-Request-ID"] == "req-123"
    assert any("req-123" in r.getMessage() and r.exc_info for r in caplog.records)
