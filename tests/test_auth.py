"""Every 401 reason, header order, rotation grace and token revocation."""

from datetime import timedelta

import pytest
from django.utils import timezone

from core import auth
from core.services import create_relay_key, revoke_relay_key, rotate_relay_key, set_relay_key_enabled
from tests import factories

pytestmark = pytest.mark.django_db


def get_models(client, **headers):
    return client.get("/v1/models", headers=headers)


def assert_401(resp, message, code="unauthenticated"):
    assert resp.status_code == 401, resp.content
    assert resp.json() == {"error": {"type": "invalid_request_error", "code": code, "message": message}}


def test_valid_key_lists_granted_models(client, catalog):
    resp = get_models(client, Authorization=f"Bearer {catalog.key}")
    assert resp.status_code == 200
    assert {m["id"] for m in resp.json()["data"]} == {"gpt-4o", "claude-sonnet", "gpt-resp"}


def test_header_order_x_wr_api_key_then_bearer_then_x_api_key(client, catalog):
    # X-WR-API-Key wins over a bad Authorization header …
    assert get_models(client, **{"X-WR-API-Key": catalog.key, "Authorization": "Bearer nope"}).status_code == 200
    # … Authorization wins over x-api-key …
    assert_401(get_models(client, Authorization="Bearer nope", **{"x-api-key": catalog.key}), "invalid api key")
    # … and x-api-key alone works (Anthropic clients).
    assert get_models(client, **{"x-api-key": catalog.key}).status_code == 200


def test_missing_key(client, catalog):
    assert_401(get_models(client), "missing relay key")


def test_invalid_key(client, catalog):
    assert_401(get_models(client, Authorization="Bearer sk-wr-notakey"), "invalid api key")


def test_disabled_key(client, catalog):
    set_relay_key_enabled(catalog.key_obj, False)
    assert_401(get_models(client, Authorization=f"Bearer {catalog.key}"), "api key disabled")


def test_revoked_key(client, catalog):
    revoke_relay_key(catalog.key_obj)
    assert_401(get_models(client, Authorization=f"Bearer {catalog.key}"), "api key revoked")


def test_expired_key(client, catalog):
    key, plaintext = create_relay_key(service_account=catalog.sa, expires_at=timezone.now() - timedelta(seconds=1))
    assert_401(get_models(client, Authorization=f"Bearer {plaintext}"), "api key expired")


def test_disabled_user_disables_personal_key(client, catalog):
    u = factories.user()
    _, plaintext = create_relay_key(user=u, project=catalog.project)
    assert get_models(client, Authorization=f"Bearer {plaintext}").status_code == 200
    u.is_active = False
    u.save()
    assert_401(get_models(client, Authorization=f"Bearer {plaintext}"), "api key disabled")


def test_rotation_with_grace_keeps_old_value_until_grace_ends(client, catalog):
    new = rotate_relay_key(catalog.key_obj, grace_seconds=3600)
    assert new.startswith("sk-wr-") and len(new) == 70
    assert get_models(client, Authorization=f"Bearer {catalog.key}").status_code == 200
    assert get_models(client, Authorization=f"Bearer {new}").status_code == 200
    # Grace over: the old value answers "api key rotated".
    type(catalog.key_obj).objects.filter(pk=catalog.key_obj.pk).update(grace_until=timezone.now())
    assert_401(get_models(client, Authorization=f"Bearer {catalog.key}"), "api key rotated")
    assert get_models(client, Authorization=f"Bearer {new}").status_code == 200


def test_rotation_without_grace_cuts_over_now(client, catalog):
    new = rotate_relay_key(catalog.key_obj, grace_seconds=0)
    assert_401(get_models(client, Authorization=f"Bearer {catalog.key}"), "api key rotated")
    assert get_models(client, Authorization=f"Bearer {new}").status_code == 200


@pytest.mark.parametrize(
    "grace,message",
    [(-1, "graceSeconds must not be negative"), (24 * 3600 + 1, "graceSeconds must not exceed 86400")],
)
def test_rotation_grace_bounds(catalog, grace, message):
    from core.errors import RelayError

    with pytest.raises(RelayError, match=message):
        rotate_relay_key(catalog.key_obj, grace_seconds=grace)


def test_revoked_key_cannot_rotate(catalog):
    from core.errors import RelayError

    revoke_relay_key(catalog.key_obj)
    with pytest.raises(RelayError, match="key is revoked"):
        rotate_relay_key(catalog.key_obj)


def test_key_format_and_storage(catalog):
    key = catalog.key_obj
    assert catalog.key.startswith("sk-wr-") and len(catalog.key) == 70
    assert key.prefix == catalog.key[:14]
    assert len(key.key_hash) == 64 and catalog.key not in key.key_hash


# --- tokens ------------------------------------------------------------------


@pytest.fixture
def alice_token(catalog):
    u = factories.user()
    catalog.project.default_policy = catalog.policy
    catalog.project.save()
    return u, auth.mint_token(u, catalog.project, 3600)


def test_token_authenticates_and_carries_claims(client, alice_token):
    u, minted = alice_token
    assert get_models(client, Authorization=f"Bearer {minted['token']}").status_code == 200
    import jwt

    header = jwt.get_unverified_header(minted["token"])
    claims = jwt.decode(minted["token"], options={"verify_signature": False})
    assert header["alg"] == "EdDSA"
    assert claims["sub"] == f"user:{u.id}" and claims["ver"] == u.token_version
    assert {"prj", "jti", "exp", "iat"} <= set(claims)


def test_token_expired(client, catalog):
    u = factories.user()
    minted = auth.mint_token(u, catalog.project, -5)
    assert_401(get_models(client, Authorization=f"Bearer {minted['token']}"), "token expired")


def test_token_revoked_by_jti(client, alice_token):
    _, minted = alice_token
    auth.revoke_token(minted["token"])
    assert_401(get_models(client, Authorization=f"Bearer {minted['token']}"), "token revoked", code="token_revoked")


def test_all_tokens_revoked_by_version_bump(client, catalog, alice_token):
    u, minted = alice_token
    other = auth.mint_token(u, catalog.project, 3600)
    u.bump_token_version()
    for t in (minted, other):
        assert_401(get_models(client, Authorization=f"Bearer {t['token']}"), "token revoked", code="token_revoked")
    fresh = auth.mint_token(u, catalog.project, 3600)
    assert get_models(client, Authorization=f"Bearer {fresh['token']}").status_code == 200


def test_forged_token_is_invalid(client, alice_token):
    _, minted = alice_token
    head, body, sig = minted["token"].split(".")
    forged = f"{head}.{body}.{sig[:-4]}AAAA"
    assert_401(get_models(client, Authorization=f"Bearer {forged}"), "invalid token")


def test_token_of_deleted_project_is_403(client, catalog):
    from core.models import Project

    u = factories.user("bob")
    tmp = Project.objects.create(name="tmp", team=catalog.team)
    minted = auth.mint_token(u, tmp, 3600)
    tmp.delete()
    resp = get_models(client, Authorization=f"Bearer {minted['token']}")
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "project_unavailable"


def test_recheck_sees_later_changes(catalog):
    from core.errors import AuthError

    p = auth.principal_for_key(catalog.key)
    auth.recheck(p)  # still fine
    rotate_relay_key(catalog.key_obj, grace_seconds=0)
    with pytest.raises(AuthError, match="api key rotated"):
        auth.recheck(p)
