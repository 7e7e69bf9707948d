"""`relay key …` and `relay token …`."""

import io

import pytest
from django.core.management import CommandError, call_command

from core.crypto import sha256_hex
from core.models import RelayKey, RevokedToken
from tests import factories

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command("relay", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue().strip()


def test_key_create_prints_plaintext_once_and_stores_hash(catalog):
    plaintext = run("key", "create", "--service-account", "proj-a/sa-a", "--policy", "pol-a", "--expires", "30d")
    key = RelayKey.objects.get(key_hash=sha256_hex(plaintext))
    assert key.policy == catalog.policy and key.expires_at is not None
    assert not RelayKey.objects.filter(key_hash=plaintext).exists()


def test_key_lifecycle_commands(client, catalog):
    plaintext = run("key", "create", "--service-account", "proj-a/sa-a")
    key = RelayKey.objects.get(key_hash=sha256_hex(plaintext))
    run("key", "disable", "--id", str(key.id))
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {plaintext}"}).json()["error"]["message"] == (
        "api key disabled"
    )
    run("key", "enable", "--prefix", key.prefix)
    new = run("key", "rotate", "--id", str(key.id), "--grace", "1h")
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {plaintext}"}).status_code == 200
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {new}"}).status_code == 200
    run("key", "revoke", "--id", str(key.id))
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {new}"}).json()["error"]["message"] == (
        "api key revoked"
    )


def test_key_create_errors(catalog):
    with pytest.raises(CommandError, match="exactly one of"):
        run("key", "create")
    with pytest.raises(CommandError, match="unknown service account"):
        run("key", "create", "--service-account", "nope/nope")
    with pytest.raises(CommandError, match="neither a duration"):
        run("key", "create", "--service-account", "proj-a/sa-a", "--expires", "soon")
    with pytest.raises(CommandError, match="must not exceed"):
        run("key", "rotate", "--id", str(catalog.key_obj.id), "--grace", "25h")


def test_token_mint_and_revoke(client, catalog):
    u = factories.user()
    catalog.project.default_policy = catalog.policy
    catalog.project.save()
    token = run("token", "mint", "--user", "alice", "--project", "proj-a", "--ttl", "1h")
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {token}"}).status_code == 200
    run("token", "revoke", "--token", token)
    assert RevokedToken.objects.count() == 1
    resp = client.get("/v1/models", headers={"Authorization": f"Bearer {token}"})
    assert resp.json()["error"]["code"] == "token_revoked"
    token2 = run("token", "mint", "--user", "alice", "--project", "proj-a")
    run("token", "revoke", "--user", "alice", "--all")
    u.refresh_from_db()
    assert u.token_version == 2
    assert client.get("/v1/models", headers={"Authorization": f"Bearer {token2}"}).status_code == 401
