"""Google Vertex AI as a host kind: Claude through rawPredict / streamRawPredict in Vertex's envelope and
OpenAI-shaped models through its OpenAI-compatible endpoint, every call with an OAuth2 access token minted from
the host key's service account by google-auth, at the fake token endpoint (devkit.vertex) that verifies the
signed assertion, through the real pipeline."""

import json
import logging
from datetime import timedelta

import pytest
from django.test import Client

from core import hostkinds, scrub
from core.hostkinds import vertex as vertex_kind
from core.models import Host, HostKey
from devkit.upstream import Reply
from devkit.vertex import DEMO_BUCKET
from policies.models import PolicyHostKey
from relay.config_apply import ConfigError, apply_config

pytestmark = pytest.mark.django_db(transaction=True)

EMAIL = "relay-test@relay-test.iam.gserviceaccount.com"
CLAUDE = "claude-sonnet-4@20250514"
GEMINI = "google/gemini-2.0-flash-001"
BETA = "token-efficient-tools-2025-02-19"
LOCATION = "/v1/projects/relay-test/locations/us-east5"


def message(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hello vertex"}], **extra}


def host_entry(fake, **extra) -> dict:
    return {
        "name": "vertex",
        "kind": "vertex",
        "base_url": fake.url,
        "project": "relay-test",
        "region": "us-east5",
        "gcs_bucket": DEMO_BUCKET,
        "storage_url": fake.url,
        **extra,
    }


@pytest.fixture
def vertex(catalog, fake):
    vertex_kind.forget_tokens()
    sa = fake.vertex.add_service_account(EMAIL, "relay-test")
    apply_config(
        {
            "hosts": [host_entry(fake)],
            "models": [{"name": "vx-claude", "provider": "anthropic"}, {"name": "vx-gemini", "provider": "google"}],
            "bindings": [
                {
                    "model": "vx-claude",
                    "host": "vertex",
                    "adapter": "anthropic",
                    "upstream_name": CLAUDE,
                    "allowed_betas": [BETA],
                },
                {"model": "vx-gemini", "host": "vertex", "adapter": "openai", "upstream_name": GEMINI},
            ],
            "host_keys": [{"name": "vertex-0", "host": "vertex", "value": sa}],
        }
    )
    PolicyHostKey.objects.create(
        policy=catalog.policy, host_key=HostKey.objects.get(name="vertex-0"), position=len(catalog.keys)
    )
    catalog.sa_json = sa
    yield catalog
    vertex_kind.forget_tokens()


def post(catalog, body: dict, path: str = "/v1/messages", **headers):
    return Client().post(
        path,
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {catalog.key}",
        HTTP_ANTHROPIC_VERSION="2023-06-01",
        **headers,
    )


def sent_headers(fake, index: int = -1) -> dict:
    return {k.lower(): v for k, v in fake.received[index]["headers"].items()}


def minted(fake) -> list[str]:
    return [m["token"] for m in fake.vertex.mints if m["status"] == 200]


def test_a_message_goes_to_raw_predict_in_vertexs_envelope_with_a_minted_token(vertex, fake):
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 200, resp.content
    answer = resp.json()
    assert answer["type"] == "message" and answer["usage"]["input_tokens"] > 0
    sent = fake.received[-1]
    assert sent["path"] == f"{LOCATION}/publishers/anthropic/models/{CLAUDE}:rawPredict"
    assert sent["body"] == {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello vertex"}],
        "anthropic_version": "vertex-2023-10-16",
    }
    headers = sent_headers(fake)
    assert minted(fake) and headers["authorization"] == f"Bearer {minted(fake)[-1]}"
    assert "x-api-key" not in headers and "anthropic-version" not in headers
    assert sent["key"] == EMAIL  # the fake took the token as the service account's
    # The token is kept: a second call mints none.
    assert post(vertex, message("vx-claude")).status_code == 200
    assert len(fake.vertex.mints) == 1
    assert sent_headers(fake)["authorization"] == f"Bearer {minted(fake)[0]}"


def test_a_stream_goes_to_stream_raw_predict_and_is_relayed_as_anthropics_events(vertex, fake):
    from tests.workers import wait_for
    from usage.models import UsageEvent

    resp = post(vertex, message("vx-claude", stream=True))
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/event-stream")
    content = b"".join(resp.streaming_content)
    resp.close()
    sent = fake.received[-1]
    assert sent["path"] == f"{LOCATION}/publishers/anthropic/models/{CLAUDE}:streamRawPredict"
    assert sent["body"]["stream"] is True and "model" not in sent["body"]
    events = [e for e in content.split(b"\n\n") if e.strip()]
    assert events[0].startswith(b"event: message_start") and events[-1].startswith(b"event: message_stop")
    assert b"        }" in content  # Vertex's stray spaces, passed through as they came
    data = [json.loads(e.split(b"data: ", 1)[1]) for e in events if e.startswith(b"event: content_block_delta")]
    assert "hello vertex" in "".join(d["delta"]["text"] for d in data)
    wait_for(lambda: UsageEvent.objects.filter(model="vx-claude").exists(), 10, interval=0.02, what="the usage event")
    event = UsageEvent.objects.get(model="vx-claude")
    assert event.input_tokens > 0 and event.output_tokens > 0 and not event.usage_estimated


def test_count_tokens_goes_to_count_tokens_with_the_model_in_the_body(vertex, fake):
    resp = post(vertex, message("vx-claude"), path="/v1/messages/count_tokens")
    assert resp.status_code == 200, resp.content
    assert resp.json()["input_tokens"] > 0
    sent = fake.received[-1]
    assert sent["path"] == f"{LOCATION}/publishers/anthropic/models/count-tokens:rawPredict"
    assert sent["body"]["model"] == CLAUDE and sent["body"]["anthropic_version"] == "vertex-2023-10-16"


def test_an_allowed_beta_goes_as_the_anthropic_beta_header(vertex, fake):
    resp = post(vertex, message("vx-claude"), HTTP_ANTHROPIC_BETA=BETA)
    assert resp.status_code == 200, resp.content
    assert sent_headers(fake)["anthropic-beta"] == BETA
    refused = post(vertex, message("vx-claude"), HTTP_ANTHROPIC_BETA="files-api-2025-04-14")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "beta_not_allowed"


def test_an_openai_shaped_model_goes_to_the_openapi_endpoint_with_its_publisher_name(vertex, fake):
    body = {"model": "vx-gemini", "messages": [{"role": "user", "content": "hello gemini"}]}
    resp = post(vertex, body, path="/v1/chat/completions")
    assert resp.status_code == 200, resp.content
    assert resp.json()["object"] == "chat.completion"
    sent = fake.received[-1]
    assert sent["path"] == f"{LOCATION}/endpoints/openapi/chat/completions"
    assert sent["body"]["model"] == GEMINI
    assert sent_headers(fake)["authorization"] == f"Bearer {minted(fake)[-1]}"


def test_a_429_resource_exhausted_is_the_relays_rate_limited_answer_and_fails_over(vertex, fake):
    fake.vertex.throttle(1)
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 429
    assert resp["X-WR-Upstream-Status"] == "429"
    body = resp.json()
    assert isinstance(body, list) and body[0]["error"]["status"] == "RESOURCE_EXHAUSTED"  # as Vertex sent it
    # A second service account in the pool: the throttled call goes on to it.
    second = HostKey(name="vertex-1", host=Host.objects.get(name="vertex"))
    second.set_value(fake.vertex.add_service_account("relay-two@relay-test.iam.gserviceaccount.com", "relay-test"))
    second.save()
    PolicyHostKey.objects.create(policy=vertex.policy, host_key=second, position=len(vertex.keys) + 1)
    fake.vertex.throttle(1)
    calls = len(fake.received)
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 200, resp.content
    tried = fake.received[calls:]
    assert [c["key"] for c in tried] == [EMAIL, "relay-two@relay-test.iam.gserviceaccount.com"]


def test_an_expiring_token_is_minted_again(vertex, fake, monkeypatch):
    from google.auth import _helpers

    assert post(vertex, message("vx-claude")).status_code == 200
    first = minted(fake)
    assert len(first) == 1
    fake.vertex.expire_tokens()  # the old token no longer works at the fake…
    later = _helpers.utcnow() + timedelta(minutes=57)  # …and the relay's clock says it is about to expire
    monkeypatch.setattr(_helpers, "utcnow", lambda: later)
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 200, resp.content
    tokens = minted(fake)
    assert len(tokens) == 2 and tokens[1] != tokens[0]
    assert sent_headers(fake)["authorization"] == f"Bearer {tokens[1]}"


def test_a_token_the_relay_still_holds_is_reused_until_near_its_expiry(vertex, fake, monkeypatch):
    from google.auth import _helpers

    assert post(vertex, message("vx-claude")).status_code == 200
    later = _helpers.utcnow() + timedelta(minutes=50)  # an hour's token, ten minutes left: kept
    monkeypatch.setattr(_helpers, "utcnow", lambda: later)
    assert post(vertex, message("vx-claude")).status_code == 200
    assert len(minted(fake)) == 1


def test_a_refused_mint_fails_the_call_as_an_unreachable_key_and_leaks_nothing(vertex, fake, caplog):
    fake.vertex.refuse_tokens(1)
    with caplog.at_level(logging.INFO):
        resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unreachable"
    assert fake.vertex.mints[-1]["status"] == 400
    assert not [r for r in fake.received if r["path"].startswith("/v1/projects/")]  # nothing sent unsigned
    info = json.loads(vertex.sa_json)
    key_body = info["private_key"].splitlines()[1]
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "Invalid JWT Signature" in logged and EMAIL in logged
    for secret in (key_body, vertex.sa_json):
        assert secret not in logged and secret not in resp.content.decode()


def test_a_key_that_is_not_a_service_account_is_refused_without_naming_it(vertex, fake, caplog):
    key = HostKey.objects.get(name="vertex-0")
    key.set_value("not-a-service-account-key-value")
    key.save()
    with caplog.at_level(logging.INFO):
        resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 502
    assert "not-a-service-account-key-value" not in "\n".join(r.getMessage() for r in caplog.records)
    assert not fake.vertex.mints


def test_a_service_account_whose_key_the_fake_does_not_know_is_refused_by_the_signature_check(vertex, fake):
    from devkit.vertex import new_service_account

    impostor, _, _ = new_service_account(f"{fake.url}/token", EMAIL, "relay-test")  # same email, another key
    key = HostKey.objects.get(name="vertex-0")
    key.set_value(impostor)
    key.save()
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 502
    assert fake.vertex.mints[-1] == {"email": EMAIL, "status": 400, "token": None}


def test_the_token_and_the_private_key_echoed_by_vertex_are_scrubbed(vertex, fake):
    assert post(vertex, message("vx-claude")).status_code == 200
    token = minted(fake)[-1]
    key_lines = json.loads(vertex.sa_json)["private_key"].splitlines()
    key_body = "".join(key_lines[1:-1])
    echo = {"error": {"code": 400, "message": f"bad credential {token} for key {key_body}", "status": "INVALID"}}
    fake.script(EMAIL, [Reply(status=400, body=[echo])])
    resp = post(vertex, message("vx-claude"))
    assert resp.status_code == 400 and b"bad credential" in resp.content
    assert token.encode() not in resp.content and key_body.encode() not in resp.content
    assert key_lines[1].encode() not in resp.content
    # The scrubber knows both: a log line or a stored error body carrying them is cleaned the same way.
    assert token not in scrub.scrub_text(f"sent {token}", load=False)
    assert key_lines[2] not in scrub.scrub_text("\n".join(key_lines), load=False)


def test_urls_for_the_global_endpoint_google_s_regional_one_and_a_base_url_given():
    kind = hostkinds.get("vertex")

    class Binding:
        upstream_name = CLAUDE

    google = Host(kind="vertex", base_url="https://aiplatform.googleapis.com", options={"project": "p-123456"})
    assert kind.url(google, Binding, "/v1/messages") == (
        "https://us-east5-aiplatform.googleapis.com/v1/projects/p-123456/locations/us-east5/publishers/anthropic/"
        f"models/{CLAUDE}:rawPredict"
    )
    world = Host(
        kind="vertex",
        base_url="https://aiplatform.googleapis.com/",
        options={"project": "p-123456", "region": "global"},
    )
    assert kind.url(world, Binding, "/v1/chat/completions") == (
        "https://aiplatform.googleapis.com/v1/projects/p-123456/locations/global/endpoints/openapi/chat/completions"
    )
    own = Host(
        kind="vertex",
        base_url="https://psc.example.internal/v1",
        options={"project": "p-123456", "region": "europe-west1"},
    )
    url, body = kind.request(own, Binding, "/v1/messages", json.dumps(message(CLAUDE, stream=True)).encode())
    assert url == (
        "https://psc.example.internal/v1/projects/p-123456/locations/europe-west1/publishers/anthropic/models/"
        f"{CLAUDE}:streamRawPredict"
    )
    assert json.loads(body)["stream"] is True and "model" not in json.loads(body)


def test_the_catalog_refuses_what_a_vertex_host_cannot_be(catalog, fake):
    def refused(doc) -> str:
        with pytest.raises(ConfigError) as exc:
            apply_config(doc)
        return str(exc.value)

    no_project = {k: v for k, v in host_entry(fake).items() if k != "project"}
    assert "'project' is required" in refused({"hosts": [no_project]})
    assert "is not a Vertex AI location" in refused({"hosts": [host_entry(fake, region="Moon Base")]})
    assert "is not a Cloud Storage bucket name" in refused({"hosts": [host_entry(fake, gcs_bucket="B!")]})
    responses = {
        "models": [{"name": "r", "provider": "openai"}],
        "bindings": [{"model": "r", "host": "vertex", "adapter": "openai_responses"}],
    }
    assert "a vertex host serves adapter anthropic or openai" in refused({"hosts": [host_entry(fake)], **responses})
    # Google's endpoint is the default base URL.
    apply_config({"hosts": [{"name": "g", "kind": "vertex", "project": "relay-test"}]})
    assert Host.objects.get(name="g").base_url == "https://aiplatform.googleapis.com"


def test_the_demo_catalogs_vertex_host_answers_with_the_demo_service_account(fake, monkeypatch):
    from pathlib import Path

    from django.conf import settings

    from core.models import ServiceAccount
    from core.services import create_relay_key
    from devkit.demo import on_upstream
    from relay.config_apply import load_file

    vertex_kind.forget_tokens()
    doc = load_file(str(Path(settings.BASE_DIR) / "deploy" / "demo-catalog.yaml"))
    monkeypatch.setenv("RELAY_HOSTKEY_DEMO", "demo-upstream-key")
    apply_config(on_upstream(doc, fake.url))  # as `make run` seeds it: the token endpoint moves with the host
    _, key = create_relay_key(service_account=ServiceAccount.objects.get(name="demo-client"), name="t")
    for model, path, body in (
        ("vertex-claude-3-5-haiku", "/v1/messages", message("vertex-claude-3-5-haiku")),
        ("vertex-gemini-2.0-flash", "/v1/chat/completions", {"model": "vertex-gemini-2.0-flash", "messages": []}),
    ):
        resp = Client().post(
            path, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}"
        )
        assert resp.status_code == 200, (model, resp.content)
        assert fake.received[-1]["path"].startswith("/v1/projects/relay-demo/locations/us-east5/")
    assert [m["email"] for m in fake.vertex.mints] == ["relay-demo@relay-demo.iam.gserviceaccount.com"]
