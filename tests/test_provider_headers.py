"""Provider headers are the operator's: which organization and project a host key bills, and which
anthropic-beta features a call may turn on, are set in the catalog, never by the caller."""

import copy
import json

import pytest
from django.test import Client

from batches.provider.models import ProviderJob
from core import crypto
from core.admin import HostKeyForm
from core.models import HostBinding, HostKey, Pricing
from devkit.upstream import Reply
from relay.config_apply import ConfigError, apply_config
from tests.test_provider_batches import drive, fast_polls, openai_batch  # noqa: F401 - fast_polls is a fixture
from usage.models import UsageEvent
from usage.pricing import cost_nano_usd, provider_batch_cost
from usage.tokens import Tokens

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
FILES_BETA = "files-api-2025-04-14"
LONG_BETA = "context-1m-2025-08-07"


def post(path, body, key, **headers):
    return Client().post(
        path, data=json.dumps(body), content_type="application/json", HTTP_AUTHORIZATION=f"Bearer {key}", **headers
    )


def sent(fake) -> dict:
    """The headers of the provider's last request, names lower-cased."""
    return {name.lower(): value for name, value in fake.received[-1]["headers"].items()}


def claude_binding() -> HostBinding:
    return HostBinding.objects.get(model__name="claude-sonnet")


# --- OpenAI organization and project ------------------------------------------------------------------


def test_the_callers_organization_and_project_are_dropped_and_the_host_keys_are_sent(catalog, fake):
    tenant = {"HTTP_OPENAI_ORGANIZATION": "org-tenant", "HTTP_OPENAI_PROJECT": "proj_tenant"}
    resp = post("/v1/chat/completions", CHAT, catalog.key, **tenant)
    assert resp.status_code == 200, resp.content
    headers = sent(fake)
    assert "openai-organization" not in headers and "openai-project" not in headers

    HostKey.objects.filter(host=catalog.hosts["openai"]).update(
        openai_organization="org-operator", openai_project="proj_operator"
    )
    resp = post("/v1/chat/completions", CHAT, catalog.key, **tenant)
    assert resp.status_code == 200, resp.content
    headers = sent(fake)
    assert headers["openai-organization"] == "org-operator" and headers["openai-project"] == "proj_operator"
    assert "org-tenant" not in json.dumps(fake.received[-1]["headers"])


def test_an_anthropic_key_sends_no_openai_account_headers(catalog, fake):
    HostKey.objects.filter(name="anthropic-0").update(openai_organization="org-operator")
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_OPENAI_ORGANIZATION="org-tenant")
    assert resp.status_code == 200, resp.content
    assert "openai-organization" not in sent(fake)


def test_a_provider_batch_job_bills_the_host_keys_organization_and_project(catalog, fake, fast_polls):  # noqa: F811
    fake.batches.job_seconds = 0.3
    HostBinding.objects.update(batch_mode="provider")
    HostKey.objects.filter(host=catalog.hosts["openai"]).update(
        openai_organization="org-operator", openai_project="proj_operator"
    )
    record = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    batch = openai_batch(catalog, [record])
    drive(batch)
    job = ProviderJob.objects.get(batch=batch)
    calls = fake.batches.requests(provider="openai")
    assert {c["op"] for c in calls} >= {"upload", "create", "retrieve"}, job
    for call in calls:
        assert call["headers"]["openai-organization"] == "org-operator", call["op"]
        assert call["headers"]["openai-project"] == "proj_operator", call["op"]


# --- anthropic-beta -------------------------------------------------------------------------------------


def test_a_beta_the_binding_does_not_allow_is_refused_in_anthropics_envelope(catalog, fake):
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_ANTHROPIC_BETA=FILES_BETA)
    assert resp.status_code == 400, resp.content
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "beta_not_allowed" and FILES_BETA in body["error"]["message"]
    assert fake.received == []  # refused before any provider saw it
    event = UsageEvent.objects.get()
    assert event.error_kind == "beta_not_allowed" and event.cost_nano_usd in (None, 0)


def test_allowed_betas_pass_and_one_not_allowed_refuses_the_call(catalog, fake):
    HostBinding.objects.filter(pk=claude_binding().pk).update(allowed_betas=[FILES_BETA, "mcp-client-2025-04-04"])
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_ANTHROPIC_BETA=f"{FILES_BETA}, mcp-client-2025-04-04")
    assert resp.status_code == 200, resp.content
    assert sent(fake)["anthropic-beta"] == f"{FILES_BETA},mcp-client-2025-04-04"
    # No header: none sent.
    assert post("/v1/messages", MESSAGES, catalog.key).status_code == 200
    assert "anthropic-beta" not in sent(fake)
    before = len(fake.received)
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_ANTHROPIC_BETA=f"{FILES_BETA},{LONG_BETA}")
    assert resp.status_code == 400 and LONG_BETA in resp.json()["error"]["message"]
    assert len(fake.received) == before


def test_anthropic_beta_on_an_openai_route_is_dropped_not_sent(catalog, fake):
    resp = post(
        "/v1/chat/completions", CHAT, catalog.key, HTTP_ANTHROPIC_BETA=FILES_BETA, HTTP_ANTHROPIC_VERSION="2023-06-01"
    )
    assert resp.status_code == 200, resp.content
    assert "anthropic-beta" not in sent(fake) and "anthropic-version" not in sent(fake)


def test_a_price_changing_beta_whose_pricing_lost_its_long_rates_is_refused(catalog, fake):
    price = Pricing.objects.create(
        name="p-claude",
        input_nanos_per_mtok=3_000_000_000,
        output_nanos_per_mtok=15_000_000_000,
        long_context_threshold_tokens=200_000,
        long_input_nanos_per_mtok=6_000_000_000,
        long_output_nanos_per_mtok=22_500_000_000,
    )
    HostBinding.objects.filter(pk=claude_binding().pk).update(pricing=price, allowed_betas=[LONG_BETA])
    # Over the threshold: every token at the long rates.
    fake.script("*", [Reply(body={"type": "message", "role": "assistant", "content": [], "usage": _usage(250_000)})])
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_ANTHROPIC_BETA=LONG_BETA)
    assert resp.status_code == 200, resp.content
    assert sent(fake)["anthropic-beta"] == LONG_BETA
    event = UsageEvent.objects.get()
    assert event.input_tokens == 250_000 and event.cost_nano_usd == 250_000 * 6_000 + 10 * 22_500
    # The tier removed behind `relay apply`'s back: the beta is refused rather than billed at the short rates.
    Pricing.objects.filter(pk=price.pk).update(
        long_context_threshold_tokens=None, long_input_nanos_per_mtok=None, long_output_nanos_per_mtok=None
    )
    resp = post("/v1/messages", MESSAGES, catalog.key, HTTP_ANTHROPIC_BETA=LONG_BETA)
    assert resp.status_code == 400 and "long-context" in resp.json()["error"]["message"]


def _usage(input_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": 10}


# --- the price table ------------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=False)
def test_long_context_rates_bill_every_token_above_the_threshold():
    price = Pricing(
        input_nanos_per_mtok=3_000_000_000,
        output_nanos_per_mtok=15_000_000_000,
        cache_read_nanos_per_mtok=300_000_000,
        long_context_threshold_tokens=200_000,
        long_input_nanos_per_mtok=6_000_000_000,
        long_output_nanos_per_mtok=22_500_000_000,
        long_cache_read_nanos_per_mtok=600_000_000,
    )
    at = Tokens(input=150_000, cache_read=50_000, output=1_000)
    assert cost_nano_usd(price, at) == 150_000 * 3_000 + 50_000 * 300 + 1_000 * 15_000
    over = Tokens(input=150_001, cache_read=50_000, output=1_000)  # input side 200,001: all at the long rates
    assert cost_nano_usd(price, over) == 150_001 * 6_000 + 50_000 * 600 + 1_000 * 22_500
    assert provider_batch_cost(price, over) == 150_001 * 3_000 + 50_000 * 300 + 1_000 * 11_250
    # A long meter left unpriced is unknown, never 0.
    assert cost_nano_usd(price, Tokens(input=200_001, cache_write=5)) is None


# --- relay apply ----------------------------------------------------------------------------------------


def _doc():
    return {
        "hosts": [
            {"name": "anthropic", "base_url": "https://api.anthropic.com"},
            {"name": "openai", "base_url": "https://api.openai.com"},
        ],
        "models": [{"name": "claude-sonnet-4", "provider": "anthropic"}, {"name": "gpt-4o", "provider": "openai"}],
        "pricing": [
            {"name": "sonnet", "input": 3, "output": 15},
            {
                "name": "sonnet-1m",
                "input": 3,
                "output": 15,
                "long_context": {"above_input_tokens": 200000, "input": 6, "output": 22.5, "cache_read": 0.6},
            },
        ],
        "bindings": [
            {"model": "gpt-4o", "host": "openai"},
            {
                "model": "claude-sonnet-4",
                "host": "anthropic",
                "adapter": "anthropic",
                "pricing": "sonnet-1m",
                "allowed_betas": [LONG_BETA, FILES_BETA],
            },
        ],
        "host_keys": [
            {
                "name": "oa",
                "host": "openai",
                "value": "sk-operator-value-1",
                "openai_organization": "org-op",
                "openai_project": "proj_op",
            },
            {"name": "an", "host": "anthropic", "value_from": {"env": "RELAY_HOSTKEY_ANTHROPIC"}},
        ],
    }


def test_apply_sets_betas_account_and_long_context_idempotently():
    report = apply_config(_doc())
    assert not report.updated
    binding = HostBinding.objects.get(model__name="claude-sonnet-4")
    assert binding.allowed_betas == [LONG_BETA, FILES_BETA]
    price = Pricing.objects.get(name="sonnet-1m")
    assert (price.long_context_threshold_tokens, price.long_input_nanos_per_mtok) == (200_000, 6_000_000_000)
    assert (price.long_output_nanos_per_mtok, price.long_cache_read_nanos_per_mtok) == (22_500_000_000, 600_000_000)
    assert price.long_cache_write_nanos_per_mtok is None
    key = HostKey.objects.get(name="oa")
    assert (key.openai_organization, key.openai_project) == ("org-op", "proj_op")
    again = apply_config(_doc())
    assert again.created == [] and again.updated == []


def _break(path, value):
    def mutate(doc):
        section, index, field = path
        doc[section][index][field] = value

    return mutate


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            _break(("bindings", 1, "pricing"), "sonnet"),
            "bindings[1]: allowed_betas: 'context-1m-2025-08-07' bills long-context rates",
        ),
        (_break(("bindings", 1, "pricing"), None), "bindings[1]: allowed_betas: 'context-1m-2025-08-07' bills"),
        (_break(("bindings", 0, "allowed_betas"), [FILES_BETA]), "bindings[0]: allowed_betas: only an anthropic"),
        (_break(("bindings", 1, "allowed_betas"), "files"), "bindings[1]: allowed_betas: must be a list"),
        (_break(("bindings", 1, "allowed_betas"), ["Files API"]), "bindings[1]: allowed_betas: 'Files API' is not"),
        (_break(("pricing", 1, "long_context"), {"input": 6, "output": 9}), "pricing[1]: long_context: 'above_input"),
        (
            _break(("pricing", 1, "long_context"), {"above_input_tokens": 9, "input": 6}),
            "pricing[1]: long_context: give",
        ),
        (
            _break(("host_keys", 1, "value_from"), {"env": "RELAY_MASTER_KEY"}),
            "host_keys[1]: value_from: environment variable RELAY_MASTER_KEY does not start with RELAY_HOSTKEY_",
        ),
        (
            _break(("host_keys", 1, "value_from"), {"env": "AWS_SECRET_ACCESS_KEY"}),
            "host_keys[1]: value_from: environment variable AWS_SECRET_ACCESS_KEY does not start",
        ),
        (_break(("host_keys", 0, "openai_project"), "proj op\r\nX-Evil: 1"), "host_keys[0]: 'openai_project' must"),
    ],
)
def test_apply_refuses_and_names_the_entry(mutate, message):
    doc = _doc()
    mutate(doc)
    with pytest.raises(ConfigError) as info:
        apply_config(copy.deepcopy(doc))
    assert message in str(info.value)
    assert not HostBinding.objects.exists() and not HostKey.objects.exists()  # nothing half-written


# --- value_env: only the operator's prefix ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["RELAY_MASTER_KEY", "DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "RELAY_HOSTKEY_"])
def test_apply_refuses_a_host_key_reading_a_variable_outside_the_prefix(name, monkeypatch):
    monkeypatch.setenv(name, "anything-at-all")
    doc = {
        "hosts": [{"name": "openai", "base_url": "https://api.openai.com"}],
        "host_keys": [
            {"name": "ok", "host": "openai", "value_from": {"env": "RELAY_HOSTKEY_OPENAI"}},
            {"name": "bad", "host": "openai", "value_from": {"env": name}},
        ],
    }
    with pytest.raises(ConfigError, match=rf"^host_keys\[1\]: value_from: environment variable {name} does not start"):
        apply_config(doc)
    assert not HostKey.objects.exists()


def test_a_host_key_reads_no_variable_outside_the_prefix_even_when_written_past_apply(catalog, monkeypatch, settings):
    monkeypatch.setenv("OTHER_SECRET", "a-cloud-credential")
    key = HostKey.objects.get(name="openai-0")
    HostKey.objects.filter(pk=key.pk).update(value_env="RELAY_MASTER_KEY", value_encrypted="")
    key.refresh_from_db()
    with pytest.raises(crypto.SecretUnavailable, match="does not start with RELAY_HOSTKEY_"):
        key.get_value()
    # A prefix that covers the relay's own secrets still does not reach them.
    settings.RELAY_HOSTKEY_ENV_PREFIX = "RELAY_"
    with pytest.raises(crypto.SecretUnavailable, match="one of the relay's own secrets"):
        key.get_value()
    settings.RELAY_HOSTKEY_ENV_PREFIX = "OTHER_"
    key.value_env = "OTHER_SECRET"
    assert key.get_value() == "a-cloud-credential"  # the operator chose that prefix


def test_the_admin_form_refuses_a_variable_outside_the_prefix(catalog):
    data = {"name": "k", "host": catalog.hosts["openai"].pk, "value_env": "RELAY_MASTER_KEY", "enabled": "on"}
    form = HostKeyForm(data=data)
    assert not form.is_valid()
    assert "does not start with RELAY_HOSTKEY_" in str(form.errors["value_env"])
    form = HostKeyForm(data={**data, "value_env": "RELAY_HOSTKEY_K", "openai_organization": "org\nX"})
    assert not form.is_valid() and "openai_organization" in form.errors
    form = HostKeyForm(data={**data, "value_env": "RELAY_HOSTKEY_K", "openai_organization": "org-op"})
    assert form.is_valid(), form.errors
