"""`relay apply`: idempotent upsert, and bad files change nothing."""

import copy
from pathlib import Path

import pytest
import yaml
from django.core.management import CommandError, call_command

from core.models import HostBinding, HostKey, Pricing, Project
from policies.models import Policy
from relay.config_apply import ConfigError, apply_config

pytestmark = pytest.mark.django_db
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "catalog.yaml"


@pytest.fixture
def doc():
    return yaml.safe_load(EXAMPLE.read_text())


def snapshot():
    from django.apps import apps

    rows = {}
    for app in ("relay", "policies"):
        for model in apps.get_app_config(app).get_models():
            rows[model.__name__] = sorted(map(str, model.objects.values_list(flat=False)))
    return rows


def test_example_applies_and_second_apply_changes_nothing(doc):
    first = apply_config(copy.deepcopy(doc))
    assert len(first.created) == 1 + 1 + 1 + 3 + 5 + 4 + 5 + 2 + 4 + 1
    before = snapshot()
    second = apply_config(copy.deepcopy(doc))
    assert second.created == [] and second.updated == []
    assert snapshot() == before
    policy = Policy.objects.get(name="search-default")
    assert [k.name for k in policy.pool()] == ["openai-primary", "openai-backup", "anthropic-primary", "vllm"]
    assert Project.objects.get(name="search").default_policy == policy
    assert Pricing.objects.get(name="gpt-4o").input_nanos_per_mtok == 2_500_000_000
    assert HostKey.objects.get(name="vllm").get_value() == "not-needed-but-required"


def test_changed_entry_is_updated_in_place(doc):
    apply_config(copy.deepcopy(doc))
    doc["bindings"][0]["upstream_name"] = "gpt-4o-2024-11-20"
    doc["policies"][0]["host_keys"] = ["openai-backup", "openai-primary"]
    report = apply_config(doc)
    assert "binding gpt-4o@openai" in report.updated and "policy search-default" in report.updated
    assert HostBinding.objects.get(model__name="gpt-4o").upstream_name == "gpt-4o-2024-11-20"
    assert [k.name for k in Policy.objects.get(name="search-default").pool()][:2] == ["openai-backup", "openai-primary"]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d["bindings"].append({"model": "gpt-4o", "host": "nope"}), "bindings[5]: unknown host 'nope'"),
        (lambda d: d["bindings"][1].update(adapter="gemini"), "bindings[1]: adapter 'gemini' is not one of"),
        (lambda d: d["rate_limits"][0]["rules"][0].update(window="1m"), "rate_limits[0]: rules[0]: window must be"),
        (lambda d: d["host_keys"][0].update(value="x"), "host_keys[0]: give exactly one of"),
        (lambda d: d["policies"][0].update(models=["openai/gpt@"]), "policies[0]: grant 'openai/gpt@'"),
        (lambda d: d["pricing"][0].update(input="-1"), "pricing[0]: input must not be negative"),
        (lambda d: d["models"][0].update(colour="blue"), "models[0]: unknown field(s): colour"),
        (lambda d: d.update(widgets=[]), "unknown top-level key(s): widgets"),
        (lambda d: d["hosts"][0].update(base_url="not a url"), "hosts[0]: base_url: Enter a valid URL"),
        (lambda d: d["bindings"][0].update(batch_mode="later"), "bindings[0]: batch_mode 'later' is not one of"),
        (lambda d: d["pricing"][0].update(batch_output="-2"), "pricing[0]: batch_output must not be negative"),
    ],
)
def test_bad_file_names_the_entry_and_changes_nothing(doc, mutate, message):
    mutate(doc)
    with pytest.raises(ConfigError) as err:
        apply_config(doc)
    assert message in str(err.value)
    assert Project.objects.count() == 0 and HostBinding.objects.count() == 0


def test_bad_file_after_good_apply_leaves_previous_state(doc):
    apply_config(copy.deepcopy(doc))
    before = snapshot()
    doc["hosts"][0]["base_url"] = "https://changed.example"
    doc["policies"][0]["rate_limit"] = "missing-limit"
    with pytest.raises(ConfigError, match="policies\\[0\\]: unknown rate limit 'missing-limit'"):
        apply_config(doc)
    assert snapshot() == before


def test_cli_apply_reports_and_rejects(tmp_path, capsys):
    call_command("relay", "apply", "-f", str(EXAMPLE))
    assert "27 created" in capsys.readouterr().out
    call_command("relay", "apply", "-f", str(EXAMPLE))
    assert "0 created, 0 updated, 27 unchanged" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("hosts: [ {name: x")
    with pytest.raises(CommandError, match="not valid YAML"):
        call_command("relay", "apply", "-f", str(bad))


def test_a_host_key_whose_environment_variable_is_unset_is_named_at_apply(doc, monkeypatch, tmp_path):
    envs = {
        entry["value_from"]["env"] for entry in doc.get("host_keys", []) if isinstance(entry.get("value_from"), dict)
    }
    assert envs, "the example catalog reads some host key from the environment"
    for name in envs:
        monkeypatch.delenv(name, raising=False)
    report = apply_config(copy.deepcopy(doc))
    assert len(report.warnings) == sum(1 for e in doc["host_keys"] if "value_from" in e)
    assert all("is not set" in w and "no_keys" in w for w in report.warnings)
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(doc))
    from io import StringIO

    out = StringIO()
    call_command("relay", "apply", "-f", str(path), stdout=out)
    assert "warning" in out.getvalue() and sorted(envs)[0] in out.getvalue()
    for name in envs:
        monkeypatch.setenv(name, "sk-test-value-0001")
    assert apply_config(copy.deepcopy(doc)).warnings == []


def test_batch_mode_and_batch_rates_are_applied(doc):
    apply_config(doc)
    modes = dict(HostBinding.objects.values_list("model__name", "batch_mode"))
    assert modes["gpt-4o"] == "auto" and modes["claude-sonnet-4"] == "provider" and modes["gpt-4.1"] == "relay"
    gpt = Pricing.objects.get(name="gpt-4o")
    assert (gpt.batch_input_nanos_per_mtok, gpt.batch_output_nanos_per_mtok) == (1_250_000_000, 5_000_000_000)
    assert Pricing.objects.get(name="gpt-4.1").batch_input_nanos_per_mtok is None  # half the live rate
