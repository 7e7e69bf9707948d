"""Host kinds: each host is reached the way its provider takes calls (core.hostkinds), through the real pipeline
against the fakes of devkit.clouds, and `relay apply` refuses what a kind cannot serve, naming the entry."""

import json

import pytest
import requests
from django.test import Client

from core import hostkinds
from core.crypto import sha256_hex
from core.models import Host, HostBinding, HostKey
from core.redis import get_redis
from policies.models import PolicyHostKey
from relay.config_apply import ConfigError, apply_config

pytestmark = pytest.mark.django_db(transaction=True)

SECRETS = {"azure": "azure-secret", "gemini": "gemini-secret", "compat": "compat-secret"}


def chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello cloud"}], **extra}


@pytest.fixture
def clouds(catalog, fake):
    """One host of each new kind on the fake upstream, in the catalog policy's pool."""
    report = apply_config(
        {
            "hosts": [
                {"name": "azure", "kind": "azure_openai", "base_url": fake.url},
                {"name": "gemini", "kind": "gemini", "base_url": f"{fake.url}/v1beta/openai/"},
                {"name": "compat", "kind": "openai_compatible", "base_url": f"{fake.url}/v1"},
            ],
            "models": [
                {"name": name, "provider": provider}
                for name, provider in (
                    ("az-gpt", "openai"),
                    ("az-resp", "openai"),
                    ("az-embed", "openai"),
                    ("az-gone", "openai"),
                    ("gem-flash", "google"),
                    ("gem-embed", "google"),
                    ("llama", "meta"),
                )
            ],
            "bindings": [
                {"model": "az-gpt", "host": "azure", "upstream_name": "gpt-4o-mini"},
                {"model": "az-resp", "host": "azure", "adapter": "openai_responses", "upstream_name": "gpt-4.1-mini"},
                {"model": "az-embed", "host": "azure", "upstream_name": "text-embedding-3-small"},
                {"model": "az-gone", "host": "azure", "upstream_name": "deleted-deployment"},
                {"model": "gem-flash", "host": "gemini", "upstream_name": "gemini-2.5-flash"},
                {"model": "gem-embed", "host": "gemini", "upstream_name": "gemini-embedding-001"},
                {"model": "llama", "host": "compat", "upstream_name": "meta-llama/Llama-3.1-8B-Instruct"},
            ],
            "host_keys": [{"name": f"{host}-0", "host": host, "value": value} for host, value in SECRETS.items()],
        }
    )
    assert not report.updated and len(report.created) == 3 + 7 + 7 + 3
    for i, host in enumerate(SECRETS, start=len(catalog.keys)):
        PolicyHostKey.objects.create(policy=catalog.policy, host_key=HostKey.objects.get(host__name=host), position=i)
    return catalog


def post(catalog, path: str, body: dict):
    return Client().post(
        path, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {catalog.key}"
    )


def stream(catalog, path: str, body: dict) -> bytes:
    resp = post(catalog, path, dict(body, stream=True))
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/event-stream")
    content = b"".join(resp.streaming_content)
    resp.close()
    return content


def last(fake) -> dict:
    call = fake.received[-1]
    return {**call, "headers": {k.lower(): v for k, v in call["headers"].items()}}


# --- azure_openai -------------------------------------------------------------------------------------


def test_azure_calls_go_to_the_deployment_with_the_api_version_and_the_api_key(clouds, fake):
    resp = post(clouds, "/v1/chat/completions", chat("az-gpt"))
    assert resp.status_code == 200, resp.content
    sent = last(fake)
    assert sent["path"] == "/openai/deployments/gpt-4o-mini/chat/completions?api-version=2024-10-21"
    assert sent["headers"]["api-key"] == "azure-secret" and "authorization" not in sent["headers"]
    assert resp.json()["usage"]["prompt_tokens"] > 0

    resp = post(clouds, "/v1/embeddings", {"model": "az-embed", "input": ["a", "b"]})
    assert resp.status_code == 200, resp.content
    assert last(fake)["path"] == "/openai/deployments/text-embedding-3-small/embeddings?api-version=2024-10-21"

    # Responses: Azure's v1 API, the deployment as the body's model.
    resp = post(clouds, "/v1/responses", {"model": "az-resp", "input": "hello"})
    assert resp.status_code == 200, resp.content
    sent = last(fake)
    assert sent["path"] == "/openai/v1/responses" and sent["body"]["model"] == "gpt-4.1-mini"


def test_azure_api_version_is_the_hosts_setting(clouds, fake):
    apply_config(
        {
            "hosts": [
                {"name": "azure", "kind": "azure_openai", "base_url": fake.url, "api_version": "2025-04-01-preview"}
            ]
        }
    )
    assert post(clouds, "/v1/chat/completions", chat("az-gpt")).status_code == 200
    assert last(fake)["path"].endswith("/chat/completions?api-version=2025-04-01-preview")


def test_azure_streams(clouds, fake):
    content = stream(clouds, "/v1/chat/completions", chat("az-gpt"))
    assert b'"chat.completion.chunk"' in content and content.rstrip().endswith(b"data: [DONE]")
    assert last(fake)["path"].startswith("/openai/deployments/gpt-4o-mini/chat/completions?api-version=")
    content = stream(clouds, "/v1/responses", {"model": "az-resp", "input": "hello"})
    assert b"response.completed" in content


def test_an_unknown_azure_deployment_answers_azures_404(clouds, fake):
    resp = post(clouds, "/v1/chat/completions", chat("az-gone"))
    assert resp.status_code == 404
    assert b"DeploymentNotFound" in resp.content


def test_a_cloud_echoing_its_key_has_it_scrubbed(clouds, fake):
    from devkit.upstream import Reply

    for secret in SECRETS.values():
        fake.script(secret, [Reply(status=400, body={"error": {"message": f"bad request for key {secret}"}})])
    for model in ("az-gpt", "gem-flash", "llama"):
        resp = post(clouds, "/v1/chat/completions", chat(model))
        assert resp.status_code == 400 and b"bad request for key" in resp.content
        assert not any(secret.encode() in resp.content for secret in SECRETS.values())


def test_azures_quota_headers_feed_the_token_pacing(clouds, fake):
    """Azure says what is left but not when it resets: the kind gives its windows, so the word is kept."""
    assert post(clouds, "/v1/chat/completions", chat("az-gpt")).status_code == 200
    key_hash = sha256_hex(SECRETS["azure"])[:12]
    redis = get_redis()
    assert redis.get(f"relay:quota:{{{key_hash}}}") is not None
    assert redis.get(f"relay:quota:{{{key_hash}}}:tokens") is not None
    assert 0 < redis.pttl(f"relay:quota:{{{key_hash}}}") <= 10_000


# --- gemini -------------------------------------------------------------------------------------------


def test_gemini_calls_its_openai_endpoint_with_x_goog_api_key(clouds, fake):
    resp = post(clouds, "/v1/chat/completions", chat("gem-flash"))
    assert resp.status_code == 200, resp.content
    sent = last(fake)
    assert sent["path"] == "/v1beta/openai/chat/completions" and sent["body"]["model"] == "gemini-2.5-flash"
    assert sent["headers"]["x-goog-api-key"] == "gemini-secret" and "authorization" not in sent["headers"]
    assert post(clouds, "/v1/embeddings", {"model": "gem-embed", "input": "x"}).status_code == 200
    assert last(fake)["path"] == "/v1beta/openai/embeddings"


def test_gemini_streams(clouds, fake):
    content = stream(clouds, "/v1/chat/completions", chat("gem-flash", stream_options={"include_usage": True}))
    assert b'"usage"' in content and content.rstrip().endswith(b"data: [DONE]")
    assert last(fake)["path"] == "/v1beta/openai/chat/completions"


def test_an_endpoint_the_kind_does_not_serve_is_refused_before_any_call(clouds, fake):
    calls = len(fake.received)
    resp = post(clouds, "/v1/completions", {"model": "gem-flash", "prompt": "hi"})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["code"] == "unsupported_endpoint" and "gemini host" in error["message"]
    assert len(fake.received) == calls


# --- openai_compatible --------------------------------------------------------------------------------


def test_openai_compatible_uses_its_base_url_and_a_bearer_key(clouds, fake):
    resp = post(clouds, "/v1/chat/completions", chat("llama"))
    assert resp.status_code == 200, resp.content
    sent = last(fake)
    assert sent["path"] == "/v1/chat/completions" and sent["headers"]["authorization"] == "Bearer compat-secret"
    content = stream(clouds, "/v1/chat/completions", chat("llama"))
    assert content.rstrip().endswith(b"data: [DONE]")


# --- the fakes check what their provider checks -------------------------------------------------------


def test_the_fakes_refuse_calls_their_provider_refuses(fake):
    body = json.dumps(chat("gpt-4o-mini"))
    deployment = f"{fake.url}/openai/deployments/gpt-4o-mini/chat/completions"
    assert requests.post(f"{deployment}?api-version=2024-10-21", data=body, timeout=10).status_code == 401
    resp = requests.post(deployment, data=body, headers={"api-key": "k"}, timeout=10)
    assert resp.status_code == 404 and resp.json()["error"]["message"] == "Resource not found"
    resp = requests.post(f"{deployment}?api-version=2024-10-21", data=body, headers={"api-key": "k"}, timeout=10)
    assert resp.status_code == 200 and "x-ratelimit-remaining-tokens" in resp.headers
    gemini = f"{fake.url}/v1beta/openai/chat/completions"
    resp = requests.post(gemini, data=body, timeout=10)
    assert resp.status_code == 403 and resp.json()["error"]["status"] == "PERMISSION_DENIED"
    assert requests.post(gemini, data=body, headers={"x-goog-api-key": "k"}, timeout=10).status_code == 200


# --- relay apply and the admin ------------------------------------------------------------------------


def refused(doc: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        apply_config(doc)
    return str(exc.value)


def test_apply_refuses_what_a_kind_cannot_be_or_serve(catalog, fake):
    hosts = Host.objects.count()
    assert refused({"hosts": [{"name": "x", "kind": "bedrock-ish", "base_url": fake.url}]}).startswith(
        "hosts[0]: kind 'bedrock-ish' is not one of openai, anthropic"
    )
    assert "hosts[0]: unknown field(s): api_version" in refused(
        {"hosts": [{"name": "x", "kind": "openai_compatible", "base_url": fake.url, "api_version": "2024-10-21"}]}
    )
    assert "hosts[0]: options: 'api_version' 'latest' is not an Azure api-version" in refused(
        {"hosts": [{"name": "x", "kind": "azure_openai", "base_url": fake.url, "api_version": "latest"}]}
    )
    assert refused({"hosts": [{"name": "x", "kind": "azure_openai"}]}) == "hosts[0]: missing required field 'base_url'"
    gemini = {"hosts": [{"name": "g", "kind": "gemini"}], "models": [{"name": "c", "provider": "anthropic"}]}
    assert "bindings[0]: adapter: a gemini host serves adapter openai, not anthropic" in refused(
        {**gemini, "bindings": [{"model": "c", "host": "g", "adapter": "anthropic"}]}
    )
    assert "bindings[0]: batch_mode: a gemini host has no batch API the relay speaks" in refused(
        {**gemini, "bindings": [{"model": "c", "host": "g", "batch_mode": "provider"}]}
    )
    # A kind given to a host that has bindings it cannot serve (not named in the file): the host entry is named.
    assert refused({"hosts": [{"name": "anthropic", "kind": "gemini"}]}) == (
        "hosts[0]: binding claude-sonnet@anthropic: a gemini host serves adapter openai, not anthropic"
    )
    assert Host.objects.count() == hosts and not Host.objects.exclude(kind="").exists()  # nothing half-written


def test_a_kind_with_a_known_endpoint_fills_in_the_base_url_and_old_catalogs_stay_as_they_were(catalog, fake):
    report = apply_config({"hosts": [{"name": "g", "kind": "gemini"}, {"name": "openai", "base_url": fake.url}]})
    assert Host.objects.get(name="g").base_url == "https://generativelanguage.googleapis.com/v1beta/openai"
    assert report.unchanged == ["host openai"]  # no kind written: unchanged, reached as before
    assert Host.objects.get(name="openai").kind == "" and hostkinds.of(Host(kind=""), "anthropic").name == "anthropic"
    again = apply_config({"hosts": [{"name": "g", "kind": "gemini"}]})
    assert again.unchanged == ["host g"]


def test_a_binding_on_a_kind_is_checked_in_the_admin_too(catalog, fake):
    from django.core.exceptions import ValidationError

    from core.admin import HostForm

    host = Host.objects.create(name="g", kind="gemini", base_url=fake.url)
    binding = HostBinding(model=catalog.keys[0].host.bindings.first().model, host=host, adapter="anthropic")
    with pytest.raises(ValidationError, match="serves adapter openai"):
        binding.clean()
    form = HostForm(
        data={"name": "anthropic", "kind": "gemini", "base_url": fake.url, "options": "{}"},
        instance=catalog.hosts["anthropic"],
    )
    assert not form.is_valid() and "serves adapter openai, not anthropic" in str(form.errors["kind"])


def test_the_demo_catalog_has_a_host_of_each_cloud_kind_and_each_answers(fake, monkeypatch):
    from pathlib import Path

    from django.conf import settings

    from core.models import ServiceAccount
    from core.services import create_relay_key
    from devkit.demo import on_upstream
    from relay.config_apply import load_file

    doc = load_file(str(Path(settings.BASE_DIR) / "deploy" / "demo-catalog.yaml"))
    monkeypatch.setenv("RELAY_HOSTKEY_DEMO", "demo-upstream-key")
    apply_config(on_upstream(doc, fake.url))  # as `make run` seeds it (devkit.demo.seed_demo)
    assert {"azure_openai", "gemini", "openai_compatible"} <= set(Host.objects.values_list("kind", flat=True))
    _, key = create_relay_key(service_account=ServiceAccount.objects.get(name="demo-client"), name="t")
    for model, path in (
        ("azure-gpt-4o-mini", "/openai/deployments/gpt-4o-mini/chat/completions?api-version=2024-10-21"),
        ("gemini-2.5-flash", "/v1beta/openai/chat/completions"),
        ("llama-3.1-8b", "/v1/chat/completions"),
    ):
        resp = Client().post(
            "/v1/chat/completions",
            data=json.dumps(chat(model)),
            content_type="application/json",
            HTTP_AUTHORIZATION=f"Bearer {key}",
        )
        assert resp.status_code == 200, (model, resp.content)
        assert fake.received[-1]["path"] == path
