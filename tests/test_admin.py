"""Every admin page renders for a staff user; secrets never come back."""

import re

import pytest
from django.contrib import admin
from django.urls import reverse

from relay.crypto import sha256_hex
from relay.models import HostKey, RelayKey

pytestmark = pytest.mark.django_db


@pytest.fixture
def staff_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(user)
    return client


def test_every_registered_model_has_rendering_pages(staff_client, catalog):
    for model, _model_admin in admin.site._registry.items():
        info = (model._meta.app_label, model._meta.model_name)
        changelist = staff_client.get(reverse("admin:{}_{}_changelist".format(*info)))
        assert changelist.status_code == 200, info
        searched = staff_client.get(reverse("admin:{}_{}_changelist".format(*info)), {"q": "a"})
        assert searched.status_code == 200, info
        add = staff_client.get(reverse("admin:{}_{}_add".format(*info)))
        assert add.status_code in (200, 403), info
        obj = model.objects.first()
        if obj is not None:
            change = staff_client.get(reverse("admin:{}_{}_change".format(*info), args=[obj.pk]))
            assert change.status_code == 200, info


def test_host_key_value_is_never_rendered(staff_client, catalog):
    key = HostKey.objects.get(name="openai-0")
    page = staff_client.get(reverse("admin:relay_hostkey_change", args=[key.pk])).content.decode()
    assert "upstream-openai-0" not in page and key.value_encrypted not in page
    listing = staff_client.get(reverse("admin:relay_hostkey_changelist")).content.decode()
    assert "upstream-openai-0" not in listing and "stored (encrypted)" in listing


def test_host_key_created_in_admin_is_encrypted(staff_client, catalog):
    resp = staff_client.post(
        reverse("admin:relay_hostkey_add"),
        {"name": "admin-made", "host": catalog.hosts["openai"].pk, "value": "sk-secret-123", "enabled": "on"},
    )
    assert resp.status_code == 302, resp.content
    key = HostKey.objects.get(name="admin-made")
    assert key.get_value() == "sk-secret-123" and "sk-secret-123" not in key.value_encrypted


def test_relay_key_created_in_admin_shows_plaintext_once(staff_client, catalog):
    resp = staff_client.post(
        reverse("admin:relay_relaykey_add"),
        {"name": "from-admin", "service_account": catalog.sa.pk, "enabled": "on"},
        follow=True,
    )
    assert resp.status_code == 200
    page = resp.content.decode()
    shown = re.findall(r"sk-wr-[A-Za-z0-9_\-]{64}", page)
    assert len(shown) == 1
    key = RelayKey.objects.get(name="from-admin")
    assert key.key_hash == sha256_hex(shown[0])
    again = staff_client.get(reverse("admin:relay_relaykey_change", args=[key.pk])).content.decode()
    assert shown[0] not in again
