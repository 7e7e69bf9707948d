"""GET /v1/batches/{id} streams its items list: valid JSON across chunk boundaries."""

import io
import json

import pytest

from batches.surfaces.native import submit
from core import auth

pytestmark = pytest.mark.django_db


def test_status_of_a_batch_larger_than_one_chunk(client, catalog):
    principal = auth.principal_for_key(catalog.key)
    n = 5003  # the items list is streamed 5,000 at a time
    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * n}
    batch = submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))
    resp = client.get(f"/v1/batches/{batch.id}", headers={"Authorization": f"Bearer {catalog.key}"})
    assert resp.status_code == 200 and resp["Content-Type"] == "application/json"
    status = json.loads(b"".join(resp.streaming_content))
    assert status["ID"] == str(batch.id) and status["TotalItems"] == n and status["counts"] == {"available": n}
    assert [i["idx"] for i in status["items"]] == list(range(n))
    assert {i["state"] for i in status["items"]} == {"available"}
