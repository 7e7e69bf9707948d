"""Admin actions declare the permission they need: a staff user who may only *view* is offered none of them,
and one posted by hand (the form's action name) changes nothing. Django offers an undeclared action to
anyone who may view the list, which let a read-only operator revoke keys and cancel batches."""

import json
import uuid

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission
from django.test import RequestFactory
from django.urls import reverse
from django.utils import timezone

from batches.models import Batch
from batches.webhooks.models import Delivery, Event, WebhookEndpoint
from core.models import RelayKey, User

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer(django_user_model):
    """Staff, with every model's view permission and nothing else."""
    user = django_user_model.objects.create_user("viewer", "viewer@example.com", "pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__startswith="view_"))
    return django_user_model.objects.get(pk=user.pk)  # no cached permissions


@pytest.fixture
def rows(client, catalog):
    """One row for every action: a native batch (made through the API), a webhook endpoint, a paused one
    and a delivered delivery."""
    resp = client.post(
        "/v1/batches",
        data=json.dumps({"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}]}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {catalog.key}",
    )
    assert resp.status_code == 202, resp.content
    batch = Batch.objects.get(pk=resp.json()["id"])
    now = timezone.now()

    def endpoint(name, paused_at=None):
        return WebhookEndpoint.objects.create(
            id=uuid.uuid4(),
            owner_hash=batch.owner_hash,
            name=name,
            url="https://hooks.example.com/relay",
            event_types=["batch.completed"],
            secret_sealed="sealed",
            secret_hint="whsec_…abcd",
            paused_at=paused_at,
        )

    active, paused = endpoint("active"), endpoint("paused", paused_at=now)
    event = Event.objects.create(id=uuid.uuid4(), type="batch.completed", owner_hash=batch.owner_hash, body="{}")
    delivery = Delivery.objects.create(
        id=uuid.uuid4(), event=event, endpoint=active, outcome="delivered", delivered_at=now, attempts=1
    )
    return {"batch": batch, "active": active, "paused": paused, "delivery": delivery, "key": catalog.key_obj}


def _post_action(client, model, action: str, pk) -> None:
    opts = model._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist")
    client.post(url, {"action": action, "_selected_action": [str(pk)], "index": 0, "post": "yes"})


def test_a_view_only_staff_user_is_offered_no_action(viewer):
    request = RequestFactory().get("/admin/")
    request.user = viewer
    offered = {}
    for model, model_admin in admin.site._registry.items():
        actions = model_admin.get_actions(request)
        if actions:
            offered[model._meta.label] = sorted(actions)
        # The list itself is still theirs to read.
        assert model_admin.has_view_permission(request), model._meta.label
    assert offered == {}


def test_every_action_declares_a_permission():
    """An action without `permissions=[…]` is offered to whoever may view the list."""
    undeclared = []
    for model, model_admin in admin.site._registry.items():
        for func, name, _ in model_admin._get_base_actions():
            if not getattr(func, "allowed_permissions", ()):
                undeclared.append(f"{model._meta.label}.{name}")
    assert undeclared == []


def test_each_action_posted_by_a_view_only_user_is_refused(client, viewer, rows):
    client.force_login(viewer)
    batch, key, delivery = rows["batch"], rows["key"], rows["delivery"]
    tokens_before = viewer.token_version
    attempts = [
        (Batch, "cancel_batches", batch.pk),
        (Batch, "retry_failed_records", batch.pk),
        (Batch, "delete_selected", batch.pk),
        (RelayKey, "revoke_keys", key.pk),
        (RelayKey, "delete_selected", key.pk),
        (User, "revoke_all_tokens", viewer.pk),
        (WebhookEndpoint, "pause", rows["active"].pk),
        (WebhookEndpoint, "resume", rows["paused"].pk),
        (WebhookEndpoint, "delete_selected", rows["active"].pk),
        (Delivery, "resend", delivery.pk),
    ]
    for model, action, pk in attempts:
        _post_action(client, model, action, pk)
    batch.refresh_from_db()
    assert batch.cancel_requested_at is None and batch.status == "queued"
    assert not Batch.objects.filter(retry_of=batch).exists()
    key.refresh_from_db()
    assert key.revoked_at is None and key.enabled
    viewer.refresh_from_db()
    assert viewer.token_version == tokens_before
    assert WebhookEndpoint.objects.get(pk=rows["active"].pk).paused_at is None
    assert WebhookEndpoint.objects.get(pk=rows["paused"].pk).paused_at is not None
    delivery.refresh_from_db()
    assert delivery.outcome == "delivered"


def test_the_change_permission_lets_an_operator_act(client, viewer, rows):
    """The declaration is the model's change permission: given it, the same user cancels the batch and pauses
    the endpoint (and a view-only admin's form stays read-only all the same)."""
    viewer.user_permissions.add(
        Permission.objects.get(codename="change_batch"), Permission.objects.get(codename="change_webhookendpoint")
    )
    client.force_login(viewer)
    _post_action(client, Batch, "cancel_batches", rows["batch"].pk)
    _post_action(client, WebhookEndpoint, "pause", rows["active"].pk)
    assert Batch.objects.get(pk=rows["batch"].pk).cancel_requested_at is not None
    assert WebhookEndpoint.objects.get(pk=rows["active"].pk).paused_at is not None
    page = client.get(reverse("admin:batches_batch_change", args=[rows["batch"].pk])).content.decode()
    assert 'name="_save"' not in page
