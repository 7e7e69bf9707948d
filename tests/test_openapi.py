"""The OpenAPI schema: every route declared, a valid OpenAPI 3.1 document, and the real answers of the
main flows match it. The docs page renders from local assets (no CDN)."""

import io
import json

import jsonschema
import pytest
import yaml
from django.test import Client
from django.urls import get_resolver
from openapi_spec_validator import validate
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

pytestmark = pytest.mark.django_db

BASE = "urn:relay-openapi"


@pytest.fixture(scope="module")
def schema():
    resp = Client().get("/api/schema/", {"format": "json"})
    assert resp.status_code == 200
    return json.loads(resp.content)


def check(schema, path, method, resp):
    """The response's body validates against the schema the document declares for its status."""
    op = schema["paths"][path][method]
    declared = op["responses"].get(str(resp.status_code))
    assert declared is not None, f"{method.upper()} {path} answered {resp.status_code}, which is not declared"
    content = b"".join(resp.streaming_content) if resp.streaming else resp.content
    body = json.loads(content)
    target = declared["content"]["application/json"]["schema"]
    registry = Registry().with_resource(BASE, Resource(contents=schema, specification=DRAFT202012))
    wrapper = {"$schema": "https://json-schema.org/draft/2020-12/schema", **_rebase(target)}
    jsonschema.Draft202012Validator(wrapper, registry=registry).validate(body)
    return body


def _rebase(node):
    """Point the document's local $refs (#/components/…) at the registered whole document."""
    if isinstance(node, dict):
        return {k: (f"{BASE}{v}" if k == "$ref" and v.startswith("#") else _rebase(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v) for v in node]
    return node


def test_schema_is_valid_openapi_and_declares_every_route(schema):
    validate(schema)  # openapi-spec-validator: OpenAPI 3.1
    assert schema["openapi"].startswith("3.1")
    assert "x-undeclared-operations" not in schema, schema.get("x-undeclared-operations")
    # Every API route of the URLconf is in the document (not the admin, the docs or /metrics).
    documented = set(schema["paths"])
    for pattern in get_resolver().url_patterns:
        route = str(pattern.pattern)
        if not route or route.startswith(("admin/", "api/schema", "api/docs", "api/redoc", "metrics")):
            continue
        if route.startswith("api/usage/"):
            continue  # an include: checked below
        assert "/" + route.replace("<str:", "{").replace(">", "}") in documented, route
    assert {"/api/usage/events", "/api/usage/summary", "/v1/files/{file_id}/content"} <= documented


def test_yaml_is_served_by_default(db):
    resp = Client().get("/api/schema/")
    assert resp.status_code == 200
    assert yaml.safe_load(resp.content)["info"]["title"] == "Relay batch API"


def test_docs_page_renders_from_local_assets(db):
    page = Client().get("/api/docs/").content.decode()
    assert "swagger-ui" in page and "cdn.jsdelivr.net" not in page
    assert "/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js" in page
    asset = Client().get("/static/drf_spectacular_sidecar/swagger-ui-dist/swagger-ui-bundle.js")
    assert asset.status_code == 200


def test_real_answers_of_the_main_flows_match_the_schema(schema, catalog, fake):
    c = Client(HTTP_AUTHORIZATION=f"Bearer {catalog.key}")

    # Live inference.
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    check(
        schema,
        "/v1/chat/completions",
        "post",
        c.post("/v1/chat/completions", json.dumps(chat), content_type="application/json"),
    )
    check(schema, "/v1/models", "get", c.get("/v1/models"))
    missing = Client().post("/v1/chat/completions", json.dumps(chat), content_type="application/json")
    check(schema, "/v1/chat/completions", "post", missing)  # 401 in the relay's envelope

    # Relay-native batch: create, status, results, cancel.
    native = {"shape": "openai", "requests": [chat, chat]}
    created = check(
        schema, "/v1/batches", "post", c.post("/v1/batches", json.dumps(native), content_type="application/json")
    )
    status = check(schema, "/v1/batches/{batch_id}", "get", c.get(f"/v1/batches/{created['id']}"))
    assert status["TotalItems"] == 2
    check(schema, "/v1/batches/{batch_id}/results", "get", c.get(f"/v1/batches/{created['id']}/results"))
    check(schema, "/v1/batches/{batch_id}/cancel", "post", c.post(f"/v1/batches/{created['id']}/cancel"))

    # OpenAI surface: upload, file objects, batch create/retrieve/list, errors.
    f = io.BytesIO(
        json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat}).encode()
    )
    f.name = "in.jsonl"
    file = check(
        schema,
        "/v1/files",
        "post",
        c.post(
            "/v1/files",
            {"file": f, "purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": 3600},
        ),
    )
    check(schema, "/v1/files/{file_id}", "get", c.get(f"/v1/files/{file['id']}"))
    check(schema, "/v1/files", "get", c.get("/v1/files"))
    body = {
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
        "input_file_id": file["id"],
        "metadata": {"job": "nightly"},
        "output_expires_after": {"anchor": "created_at", "seconds": 86400},
    }
    batch = check(
        schema, "/v1/batches", "post", c.post("/v1/batches", json.dumps(body), content_type="application/json")
    )
    assert batch["status"] == "validating"
    check(schema, "/v1/batches/{batch_id}", "get", c.get(f"/v1/batches/{batch['id']}"))
    check(schema, "/v1/batches", "get", c.get("/v1/batches"))
    bad = c.post("/v1/batches", json.dumps({**body, "completion_window": "1h"}), content_type="application/json")
    assert check(schema, "/v1/batches", "post", bad)["error"]["param"] == "completion_window"
    check(schema, "/v1/batches/{batch_id}/cancel", "post", c.post(f"/v1/batches/{batch['id']}/cancel"))
    check(schema, "/v1/files/{file_id}", "delete", c.delete(f"/v1/files/{file['id']}"))

    # Operations.
    check(schema, "/healthz", "get", Client().get("/healthz"))
