"""Encryption at rest, start-up refusal without secrets, /healthz."""

import os
import subprocess
import sys

import pytest
from django.test import override_settings

from core import crypto
from core.models import HostKey

pytestmark = pytest.mark.django_db


def test_host_key_value_round_trips_and_is_not_stored_in_clear(catalog):
    key = HostKey.objects.get(name="openai-0")
    assert key.get_value() == "upstream-openai-0"
    assert "upstream-openai-0" not in key.value_encrypted
    assert key.value_encrypted.startswith("v1:")
    # A fresh nonce every time: the same value encrypts differently.
    assert crypto.encrypt("x") != crypto.encrypt("x")


def test_wrong_master_key_cannot_decrypt(catalog):
    key = HostKey.objects.get(name="openai-0")
    with override_settings(RELAY_MASTER_KEY="another-master-key"):
        crypto._derive.cache_clear()
        with pytest.raises(crypto.SecretUnavailable, match="RELAY_MASTER_KEY"):
            key.get_value()
    crypto._derive.cache_clear()


def test_env_sourced_host_key(catalog, monkeypatch):
    key = HostKey.objects.create(name="env-key", host=catalog.hosts["openai"], value_env="RELAY_HOSTKEY_TEST")
    with pytest.raises(crypto.SecretUnavailable, match="RELAY_HOSTKEY_TEST is not set"):
        key.get_value()
    monkeypatch.setenv("RELAY_HOSTKEY_TEST", "from-env")
    assert key.get_value() == "from-env"


def test_host_key_needs_exactly_one_value_source(catalog):
    from django.db import IntegrityError, transaction

    with transaction.atomic(), pytest.raises(IntegrityError):
        HostKey.objects.create(name="no-source", host=catalog.hosts["openai"])


@pytest.mark.parametrize("missing", ["SECRET_KEY", "RELAY_MASTER_KEY", "RELAY_ADMIN_TOKEN"])
def test_missing_secret_stops_start_up_and_names_it(missing):
    env = {k: v for k, v in os.environ.items() if k not in ("DEBUG", "RELAY_EMBEDDED")}
    env.update(SECRET_KEY="s", RELAY_MASTER_KEY="m", RELAY_ADMIN_TOKEN="t", DEBUG="0")
    env.pop(missing)
    out = subprocess.run(
        [sys.executable, "manage.py", "check"], env=env, capture_output=True, text=True, cwd=os.getcwd()
    )
    assert out.returncode != 0
    assert f"{missing} is not set" in out.stderr


ADMIN = {"HTTP_AUTHORIZATION": "Bearer test-admin-token"}


@pytest.fixture
def admin_token(settings):
    settings.RELAY_ADMIN_TOKEN = "test-admin-token"


def test_healthz_says_ok_to_anyone_and_the_checks_to_the_operator(client, admin_token):
    resp = client.get("/healthz")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}
    resp = client.get("/healthz", **ADMIN)
    assert resp.json() == {"status": "ok", "database": {"ok": True}, "redis": {"ok": True}}
    # A wrong token is anyone.
    assert client.get("/healthz", HTTP_AUTHORIZATION="Bearer nope").json() == {"status": "ok"}


def test_healthz_error_shows_no_exception_text_without_the_admin_token(client, admin_token):
    with override_settings(REDIS_URL="redis://127.0.0.1:1/0"):
        resp = client.get("/healthz")
        detailed = client.get("/healthz", **ADMIN)
    assert resp.status_code == 503
    assert resp.json() == {"status": "error"}
    assert b"127.0.0.1" not in resp.content and b"redis" not in resp.content.lower()
    assert detailed.status_code == 503
    body = detailed.json()
    assert body["status"] == "error" and body["redis"]["ok"] is False and body["database"]["ok"] is True
    assert "127.0.0.1:1" in body["redis"]["error"]  # the operator sees where it looked


def test_migrations_are_complete():
    from django.core.management import call_command

    call_command("makemigrations", "--check", "--dry-run", verbosity=0)
