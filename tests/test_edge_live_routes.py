"""gateway.edge: the live inference routes bypass Django's session, CSRF, auth and messages middleware."""

import pytest
from django.urls import resolve

from gateway.adapters import LIVE_PATHS, PATH_ADAPTER
from gateway.inference import InferenceView

pytestmark = pytest.mark.django_db


def test_the_bypassed_paths_are_exactly_the_live_routes():
    for path in LIVE_PATHS:
        assert resolve(path).func.view_class is InferenceView, path
    assert len(LIVE_PATHS) == 3 * len(PATH_ADAPTER)
    assert "/anthropic/v1/messages" in LIVE_PATHS and "/v1/chat/completions" in LIVE_PATHS


def test_a_live_request_gets_no_session_or_csrf_work(client, catalog):
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
    client.cookies["sessionid"] = "not-a-session"
    resp = client.post(
        "/v1/chat/completions",
        data=body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {catalog.key}"},
    )
    assert resp.status_code == 200
    assert not hasattr(resp.wsgi_request, "session") and not hasattr(resp.wsgi_request, "_messages")


def test_the_admin_still_runs_them(client):
    resp = client.get("/admin/login/")
    assert resp.status_code == 200 and "csrftoken" in resp.cookies
    assert hasattr(resp.wsgi_request, "session")
