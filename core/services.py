"""Writes on credentials: create, rotate, revoke, disable relay keys; tokens."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from core import crypto
from core.errors import bad_request
from core.models import Project, RelayKey, ServiceAccount, User


def create_relay_key(
    *,
    service_account: ServiceAccount | None = None,
    user: User | None = None,
    project: Project | None = None,
    policy=None,
    name: str = "",
    expires_at=None,
) -> tuple[RelayKey, str]:
    """Create a key and return it with its plaintext, which is never stored."""
    if (service_account is None) == (user is None):
        raise bad_request("a relay key belongs to exactly one of a service account or a user")
    plaintext, key_hash, prefix = crypto.new_relay_key()
    key = RelayKey.objects.create(
        name=name,
        key_hash=key_hash,
        prefix=prefix,
        service_account=service_account,
        user=user,
        project=project,
        policy=policy,
        expires_at=expires_at,
    )
    return key, plaintext


def assign_new_value(key: RelayKey) -> str:
    """Give an unsaved or existing key a fresh value (used by the admin's create)."""
    plaintext, key.key_hash, key.prefix = crypto.new_relay_key()
    return plaintext


@transaction.atomic
def rotate_relay_key(key: RelayKey, grace_seconds: int = 0) -> str:
    """New value now; the old one keeps working for `grace_seconds` (0 = cut over)."""
    if grace_seconds < 0:
        raise bad_request("graceSeconds must not be negative")
    if grace_seconds > settings.RELAY_KEY_ROTATE_MAX_GRACE_SECONDS:
        raise bad_request(f"graceSeconds must not exceed {settings.RELAY_KEY_ROTATE_MAX_GRACE_SECONDS}")
    key = RelayKey.objects.select_for_update().get(pk=key.pk)
    if key.revoked_at is not None:
        raise bad_request("key is revoked; create a new key instead of rotating")
    old_hash = key.key_hash
    plaintext = assign_new_value(key)
    if grace_seconds:
        key.previous_key_hash = old_hash
        key.grace_until = timezone.now() + timedelta(seconds=grace_seconds)
    else:
        # Keep the old hash so the old value answers "api key rotated", not "invalid api key".
        key.previous_key_hash = old_hash
        key.grace_until = None
    key.save(update_fields=["key_hash", "prefix", "previous_key_hash", "grace_until"])
    return plaintext


def revoke_relay_key(key: RelayKey) -> None:
    RelayKey.objects.filter(pk=key.pk, revoked_at__isnull=True).update(revoked_at=timezone.now())


def set_relay_key_enabled(key: RelayKey, enabled: bool) -> None:
    RelayKey.objects.filter(pk=key.pk).update(enabled=enabled)
