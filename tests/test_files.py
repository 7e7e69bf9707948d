"""Files API of the OpenAI surface over HTTP: upload (streamed), list, retrieve, content, delete, limits.

Most tests go through Django's test client (the real views, parser and
storage, in one transaction); the ones about sockets — a slow upload holding
its slot, a declared length refused before the body — use the live server.
"""

import http.client
import io
import json
import threading
import time
import tracemalloc
from urllib.parse import urlparse

import pytest
import requests
from django.conf import settings
from django.test import override_settings

from batches import storage
from batches.models import File, Payload
from core.redis import get_redis
from core.services import create_relay_key
from policies.models import Policy
from tests.workers import wait_for

pytestmark = pytest.mark.django_db
live = pytest.mark.django_db(transaction=True)  # the live server's thread must see committed rows

JSONL = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class Response:
    """What the tests read of an answer, from Django's test client or from `requests`."""

    def __init__(self, status_code, headers, content):
        self.status_code, self.headers, self.content = status_code, headers, content

    def json(self):
        return json.loads(self.content)

    @property
    def text(self):
        return self.content.decode()


class Files:
    """The Files API through Django's test client."""

    url = "/v1/files"

    def __init__(self, key):
        from django.test import Client

        self.key = key
        self.client = Client()

    def h(self, key=None):
        return {"HTTP_AUTHORIZATION": f"Bearer {key or self.key}"}

    def _wrap(self, resp):
        content = b"".join(resp.streaming_content) if resp.streaming else resp.content
        return Response(resp.status_code, resp.headers, content)

    def upload(self, data=JSONL, filename="in.jsonl", purpose="batch", key=None, **fields):
        upload = io.BytesIO(data)
        upload.name = filename
        form = {"file": upload, **fields}
        if purpose is not None:
            form["purpose"] = purpose
        return self._wrap(self.client.post(self.url, data=form, **self.h(key)))

    def get(self, path="", key=None, **params):
        return self._wrap(self.client.get(self.url + path, data=params, **self.h(key)))

    def delete(self, file_id, key=None):
        return self._wrap(self.client.delete(f"{self.url}/{file_id}", **self.h(key)))

    def post_raw(self, data, content_type):
        return self._wrap(self.client.post(self.url, data=data, content_type=content_type, **self.h()))


class LiveFiles:
    """The Files API over a real socket, against the live server."""

    def __init__(self, url, key):
        self.url, self.key = url + "/v1/files", key

    def upload(self, data=JSONL, filename="in.jsonl", key=None):
        resp = requests.post(
            self.url,
            files={"file": (filename, data)},
            data={"purpose": "batch"},
            headers={"Authorization": f"Bearer {key or self.key}"},
            timeout=30,
        )
        return Response(resp.status_code, resp.headers, resp.content)

    def get(self, path=""):
        resp = requests.get(self.url + path, headers={"Authorization": f"Bearer {self.key}"}, timeout=30)
        return Response(resp.status_code, resp.headers, resp.content)


@pytest.fixture
def files(catalog):
    return Files(catalog.key)


@pytest.fixture
def live_files(live_server, catalog):
    return LiveFiles(live_server.url, catalog.key)


def test_upload_retrieve_content_list_delete(files, django_capture_on_commit_callbacks):
    resp = files.upload(JSONL * 3, filename="prompts.jsonl")
    assert resp.status_code == 200, resp.text
    obj = resp.json()
    assert obj["id"].startswith("file-") and obj["object"] == "file" and obj["purpose"] == "batch"
    assert obj["bytes"] == len(JSONL) * 3 and obj["filename"] == "prompts.jsonl" and obj["status"] == "processed"
    assert abs(obj["created_at"] - time.time()) < 60
    assert files.get(f"/{obj['id']}").json() == obj
    content = files.get(f"/{obj['id']}/content")
    assert content.status_code == 200 and content.content == JSONL * 3
    assert content.headers["Content-Length"] == str(len(JSONL) * 3)
    assert 'filename="prompts.jsonl"' in content.headers["Content-Disposition"]
    listing = files.get().json()
    assert listing["object"] == "list" and [f["id"] for f in listing["data"]] == [obj["id"]]
    assert listing["has_more"] is False and listing["first_id"] == listing["last_id"] == obj["id"]
    ref = File.objects.get().ref
    with django_capture_on_commit_callbacks(execute=True):  # the bytes go once the delete has committed
        resp = files.delete(obj["id"])
    assert resp.status_code == 200 and resp.json() == {"id": obj["id"], "object": "file", "deleted": True}
    assert files.get(f"/{obj['id']}").status_code == 404
    with pytest.raises(storage.PayloadMissing):
        list(storage.iter_file(ref))


def test_list_pages_with_after_limit_order_and_purpose(files):
    ids = [files.upload(JSONL).json()["id"] for _ in range(5)]
    page = files.get(limit=2).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][:2] and page["has_more"] is True
    page = files.get(limit=2, after=page["last_id"]).json()
    assert [f["id"] for f in page["data"]] == ids[::-1][2:4]
    page = files.get(limit=10, order="asc").json()
    assert [f["id"] for f in page["data"]] == ids and page["has_more"] is False
    assert files.get(purpose="batch_output").json()["data"] == []
    bad = files.get(limit=0)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    assert files.get(order="sideways").status_code == 400


def test_files_are_private_to_their_owner(files, catalog):
    file_id = files.upload().json()["id"]
    _, other = create_relay_key(service_account=catalog.sa)
    for resp in (
        files.get(f"/{file_id}", key=other),
        files.get(f"/{file_id}/content", key=other),
        files.delete(file_id, key=other),
    ):
        assert resp.status_code == 404
        assert resp.json()["error"] == {
            "message": f"No such File object: {file_id}",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    assert files.get(key=other).json()["data"] == []
    assert files.get("/file-not-an-id").status_code == 404
    assert File.objects.count() == 1


@pytest.mark.parametrize(
    "kwargs,param,code",
    [
        ({"purpose": "fine-tune"}, "purpose", "invalid_value"),
        ({"purpose": None}, "purpose", "missing_required_parameter"),
        ({"expires_after[anchor]": "created_at"}, "expires_after.seconds", "invalid_value"),  # half a policy
        ({"ttl": "3600"}, "ttl", "unknown_parameter"),
    ],
)
def test_bad_uploads_are_400_and_store_nothing(files, kwargs, param, code):
    before = _stored_files()
    resp = files.upload(**kwargs)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == code and error["type"] == "invalid_request_error"
    assert File.objects.count() == 0 and _stored_files() == before


def test_upload_needs_a_multipart_file_part(files):
    resp = files.post_raw(b"purpose=batch", "application/x-www-form-urlencoded")
    assert resp.status_code == 400 and "multipart/form-data" in resp.json()["error"]["message"]
    resp = files.post_raw(
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--b--\r\n',
        "multipart/form-data; boundary=b",
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "file"
    resp = files.post_raw(b"--b\r\nbroken", "multipart/form-data; boundary=b")
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


def test_over_the_size_limit_is_413_and_stores_nothing(files):
    before = _stored_files()
    with override_settings(RELAY_MAX_UPLOAD_BYTES=1000):
        resp = files.upload(JSONL * 20)  # ~1.6 KB, streamed past the limit
        assert resp.status_code == 413, resp.text
        assert resp.json()["error"]["code"] == "file_too_large" and "1000 bytes" in resp.json()["error"]["message"]
        ok = files.upload(JSONL * 5)
        assert ok.status_code == 200
    assert File.objects.count() == 1 and len(_stored_files() - before) == 1


@live
def test_a_declared_length_over_the_limit_is_refused_before_reading(live_files):
    files = live_files
    url = urlparse(files.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    conn.putrequest("POST", url.path)
    conn.putheader("Authorization", f"Bearer {files.key}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=xyz")
    conn.putheader("Content-Length", str(settings.RELAY_MAX_UPLOAD_BYTES + 2 * 1024 * 1024))
    conn.endheaders()  # not a byte of the body is sent
    resp = conn.getresponse()
    assert resp.status == 413 and json.loads(resp.read())["error"]["code"] == "file_too_large"
    conn.close()


@live
def test_more_concurrent_uploads_than_allowed_is_429(live_files, catalog):
    """A slow upload holds its slot for as long as its body is arriving."""
    files = live_files
    url = urlparse(files.url)
    head = b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n'
    tail = JSONL + b"\r\n--xyz--\r\n"
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=20)
    conn.putrequest("POST", url.path)
    conn.putheader("Authorization", f"Bearer {files.key}")
    conn.putheader("Content-Type", "multipart/form-data; boundary=xyz")
    conn.putheader("Content-Length", str(len(head) + len(tail)))
    conn.endheaders()
    conn.send(head)
    slots = f"uploads:{{cred:key:{catalog.key_obj.id}}}"
    with override_settings(RELAY_MAX_CONCURRENT_UPLOADS=1):
        wait_for(lambda: get_redis().zcard(slots) == 1, 10, what="the slow upload to hold its slot")
        resp = files.upload()
        assert resp.status_code == 429, resp.text
        assert resp.json()["error"]["type"] == "rate_limit_error" and resp.headers["Retry-After"] == "1"
        # Another credential has its own slots.
        _, other = create_relay_key(service_account=catalog.sa)
        assert files.upload(key=other).status_code == 200
        conn.send(tail)
        slow = conn.getresponse()
        assert slow.status == 200 and json.loads(slow.read())["filename"] == "slow.jsonl"
        assert get_redis().zcard(slots) == 0  # released
        assert files.upload().status_code == 200
    conn.close()


def test_files_api_is_404_when_the_policy_has_batch_access_off(files, catalog):
    Policy.objects.filter(pk=catalog.policy.pk).update(batch_enabled=False)
    for resp in (files.upload(), files.get()):
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "batch_access_disabled"


def test_without_credential_is_401_in_openai_shape(files):
    resp = files._wrap(files.client.get(files.url))
    assert resp.status_code == 401
    assert resp.json()["error"] == {
        "message": "missing relay key",
        "type": "invalid_request_error",
        "param": None,
        "code": "unauthenticated",
    }


@override_settings(RELAY_BATCH_PAYLOAD_STORE="db")
def test_database_store_streams_files_in_chunks(files, django_capture_on_commit_callbacks):
    data = (JSONL * 50_000)[: 3 * storage.FILE_CHUNK + 123]
    obj = files.upload(data).json()
    ref = File.objects.get().ref
    assert ref.startswith("dbfile:")
    chunks = Payload.objects.filter(key__startswith=ref.partition(":")[2] + "/")
    assert obj["bytes"] == len(data) and chunks.count() == 4
    assert files.get(f"/{obj['id']}/content").content == data
    with django_capture_on_commit_callbacks(execute=True):
        files.delete(obj["id"])
    assert not chunks.exists()


def test_upload_memory_stays_flat_for_a_large_file(catalog):
    """A 48 MiB upload through the real view and Django's multipart parser: peak Python memory stays small."""
    from django.core.handlers.wsgi import WSGIRequest

    from batches.api.views import FileListView

    size = 48 * 1024 * 1024
    head = b'--xyz\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--xyz\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
    tail = b"\r\n--xyz--\r\n"

    class Body(io.RawIOBase):
        """The request body, generated as it is read: the test never holds it either."""

        def __init__(self):
            self.parts = [head, None, tail]
            self.left = size

        def readable(self):
            return True

        def readinto(self, buf):
            while self.parts:
                if self.parts[0] is None:
                    n = min(len(buf), self.left)
                    if n:
                        buf[:n] = (JSONL * (n // len(JSONL) + 1))[:n]
                        self.left -= n
                        return n
                    self.parts.pop(0)
                    continue
                part = self.parts[0]
                n = min(len(buf), len(part))
                buf[:n] = part[:n]
                self.parts[0] = part[n:]
                if not self.parts[0]:
                    self.parts.pop(0)
                return n
            return 0

    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/v1/files",
        "SERVER_NAME": "testserver",
        "SERVER_PORT": "80",
        "wsgi.url_scheme": "http",
        "wsgi.input": io.BufferedReader(Body(), 256 * 1024),
        "CONTENT_TYPE": "multipart/form-data; boundary=xyz",
        "CONTENT_LENGTH": str(len(head) + size + len(tail)),
        "HTTP_AUTHORIZATION": f"Bearer {catalog.key}",
    }
    tracemalloc.start()
    try:
        response = FileListView.as_view()(WSGIRequest(environ))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert response.status_code == 200, response.content
    assert json.loads(response.content)["bytes"] == size
    assert peak < 8 * 1024 * 1024, f"peak {peak} bytes"


@live
def test_threads_do_not_share_an_upload(live_files):
    """Concurrent uploads from one credential each get their own file (the limit allows 4)."""
    results = []

    def up(i):
        results.append(live_files.upload(JSONL * (i + 1), filename=f"f{i}.jsonl").json())

    threads = [threading.Thread(target=up, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r["bytes"] for r in results) == [len(JSONL) * n for n in (1, 2, 3, 4)]
    for r in results:
        assert live_files.get(f"/{r['id']}/content").content == JSONL * (r["bytes"] // len(JSONL))


def _stored_files() -> set:
    root = settings.RELAY_BATCH_PAYLOAD_DIR
    from pathlib import Path

    path = Path(root) / "files"
    return set(path.iterdir()) if path.exists() else set()
