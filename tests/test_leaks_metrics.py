"""/metrics is bounded by the catalog: no string a tenant sends becomes a label value, and
the route answers only GET and HEAD."""

import json
import time

import pytest
from django.conf import settings
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from usage.models import UsageEvent

pytestmark = pytest.mark.django_db

ADMIN = {"HTTP_AUTHORIZATION": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
JUNK_MODELS = 1000


def series() -> set[tuple]:
    resp = Client().get("/metrics", **ADMIN)
    assert resp.status_code == 200, resp.content
    out = set()
    for family in text_string_to_metric_families(resp.content.decode()):
        for s in family.samples:
            out.add((s.name, tuple(sorted(s.labels.items()))))
    return out


def _junk(i: int):
    """1,000 distinct model values a hostile tenant might send: names of every odd kind, and non-strings."""
    kinds = (
        lambda: f"junk-{i}",
        lambda: f"\u202egpt-{i}",  # right-to-left override
        lambda: f"zero\u200bwidth-{i}",
        lambda: {"a": i},
        lambda: [i, True],
        lambda: f"{i}-" + "x" * 300,  # longer than any catalog name
        lambda: i + 0.5,
    )
    return kinds[i % len(kinds)]()


def test_a_thousand_junk_models_add_only_the_unknown_series(catalog):
    client = Client()
    headers = {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}
    chat = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    assert (
        client.post("/v1/chat/completions", json.dumps(chat), content_type="application/json", **headers).status_code
        == 200
    )
    before = series()

    for model in (True, False, None, *(_junk(i) for i in range(JUNK_MODELS))):
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
        resp = client.post("/v1/chat/completions", body, content_type="application/json", **headers)
        assert 400 <= resp.status_code < 500, resp.content
    deadline = time.monotonic() + 30  # usage events are written as each answer closes
    while UsageEvent.objects.count() < JUNK_MODELS and time.monotonic() < deadline:
        time.sleep(0.1)
    assert UsageEvent.objects.exclude(model="gpt-4o").count() >= JUNK_MODELS  # the junk reached the usage table

    after = series()
    added = after - before
    assert added, "the junk requests were counted somewhere"
    for name, labels in added:
        model = dict(labels).get("model")
        assert model == "unknown", (name, labels)  # nothing but the one folded model label
    # The few series of model="unknown": requests per source and status, tokens per kind, two costs.
    assert len(added) <= 10, sorted(added)
    for _, labels in after:
        for value in dict(labels).values():
            assert "\u202e" not in value and "\u200b" not in value and "{" not in value and len(value) <= 200
    # Catalog models keep their own label.
    assert any(dict(labels).get("model") == "gpt-4o" for _, labels in after)


@pytest.mark.parametrize("method", ["post", "put", "patch", "delete", "options"])
def test_metrics_answers_405_to_every_method_but_get_and_head(db, method):
    client = Client(enforce_csrf_checks=True)  # as a browser-less client meets it in production
    resp = getattr(client, method)("/metrics", **ADMIN)
    assert resp.status_code == 405, resp.content
    assert resp["Allow"] == "GET, HEAD"
    assert resp.json()["error"]["code"] == "method_not_allowed"
    assert Client().head("/metrics", **ADMIN).status_code == 200
