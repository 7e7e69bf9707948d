"""The per-process catalog cache (core.catalog): every catalog write, whatever path it
takes, is seen by the next request — in this process and in another one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from core import generation
from core.errors import RelayError
from core.models import HostBinding, HostKey, LLMModel, Pricing, RelayKey
from gateway import routing
from policies.models import Policy, PolicyHostKey, RateLimit, RateLimitRule
from tests import factories
from tests.workers import wait_for

ROOT = Path(__file__).resolve().parent.parent


def route_of(policy_id, model="gpt-4o"):
    policy = routing.load_policy(policy_id)
    return routing.resolve(policy, model)


def test_a_worker_warms_every_route_once_before_its_first_item(catalog):
    """gateway.routing.warm (a Celery worker's parent, before the fork; each pool process again)."""
    from core import catalog as cache

    cache._local_cache.clear()
    assert routing.warm() > 0
    with CaptureQueriesContext(connection) as ctx:
        route = route_of(catalog.policy.id)
        assert routing.warm() == 0  # loaded already, as in a pool process that inherited it
    assert len(ctx.captured_queries) == 0
    assert route.binding.upstream_name == "gpt-4o-2024-08-06"


def test_second_request_reads_no_catalog_rows(catalog):
    route_of(catalog.policy.id)
    with CaptureQueriesContext(connection) as ctx:
        route = route_of(catalog.policy.id)
        [k.get_value() for k in route.keys]
    assert len(ctx.captured_queries) == 0
    assert route.binding.upstream_name == "gpt-4o-2024-08-06"


def _expect_error(policy_id, code, model="gpt-4o"):
    with pytest.raises(RelayError) as info:
        route_of(policy_id, model)
    assert info.value.code == code


@pytest.mark.parametrize(
    "write, code",
    [
        (lambda c: HostBinding.objects.filter(model__name="gpt-4o").update(enabled=False), "no_host_binding"),
        (lambda c: HostBinding.objects.filter(model__name="gpt-4o").delete(), "no_host_binding"),
        (lambda c: LLMModel.objects.filter(name="gpt-4o").delete(), "model_not_found"),
        (lambda c: Policy.objects.filter(pk=c.policy.pk).update(enabled=False), "policy_disabled"),
        (lambda c: Policy.objects.filter(pk=c.policy.pk).update(grants=["anthropic/*"]), "model_not_allowed"),
        (lambda c: HostKey.objects.filter(host__name="openai").update(enabled=False), "no_keys"),
        (lambda c: c.policy.pool_links.all().delete(), "no_keys"),
        (lambda c: c.hosts["openai"].delete(), "no_host_binding"),
    ],
)
def test_every_bulk_write_is_seen_by_the_next_request(catalog, write, code):
    route_of(catalog.policy.id)  # cached
    write(catalog)
    _expect_error(catalog.policy.id, code)


def test_saves_are_seen_by_the_next_request(catalog):
    route_of(catalog.policy.id)
    binding = HostBinding.objects.get(model__name="gpt-4o")
    binding.upstream_name = "gpt-4o-new"
    binding.save()
    assert route_of(catalog.policy.id).binding.upstream_name == "gpt-4o-new"

    price = Pricing.objects.get(name="p-gpt")
    price.input_nanos_per_mtok = 1
    price.save()
    assert route_of(catalog.policy.id).binding.pricing.input_nanos_per_mtok == 1

    key = HostKey.objects.get(name="openai-0")
    key.set_value("rotated-value")
    key.save()
    assert route_of(catalog.policy.id).keys[0].get_value() == "rotated-value"

    PolicyHostKey.objects.filter(policy=catalog.policy, host_key=key).delete()
    assert [k.name for k in route_of(catalog.policy.id).keys] == ["openai-1", "openai-2"]


def test_rate_limit_rules_are_seen_by_the_next_request(catalog):
    rl = factories.rate_limit("rl-1", ("requests", 5, 60, "sliding-window"))
    Policy.objects.filter(pk=catalog.policy.pk).update(rate_limit=rl)
    assert [r.amount for r in routing.load_policy(catalog.policy.id).rate_limit.rules.all()] == [5]
    RateLimitRule.objects.filter(rate_limit=rl).update(amount=7)
    assert [r.amount for r in routing.load_policy(catalog.policy.id).rate_limit.rules.all()] == [7]
    RateLimit.objects.filter(pk=rl.pk).update(enabled=False)
    assert routing.load_policy(catalog.policy.id).rate_limit.enabled is False


def test_a_flushed_counter_restarts_elsewhere(catalog):
    from core import catalog as cache
    from core.redis import get_redis

    route_of(catalog.policy.id)
    old = cache._local_cache.current().gen
    get_redis().delete(cache.GEN_KEY)
    # A new random start: a process holding `old` cannot mistake the new counter for its own.
    assert cache._local_cache.current().gen != old


# --- another process -----------------------------------------------------------------------------

_CHILD = r"""
import json, os, sys
import django
django.setup()
from core import generation
from gateway import routing
from core.errors import RelayError
for line in sys.stdin:
    pid = int(line)
    try:
        r = routing.resolve(routing.load_policy(pid), "gpt-4o")
        out = {"upstream_name": r.binding.upstream_name, "keys": [k.name for k in r.keys]}
    except RelayError as e:
        out = {"error": e.code}
    print(json.dumps(out), flush=True)
"""


@pytest.fixture
def child(transactional_db):
    from tests.workers import database_url

    env = dict(os.environ, DATABASE_URL=database_url(connection.settings_dict), DJANGO_SETTINGS_MODULE="relay.settings")
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env
    )

    def ask(policy_id: int) -> dict:
        proc.stdin.write(f"{policy_id}\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    yield ask
    proc.stdin.close()
    proc.wait(timeout=10)


def test_another_process_sees_every_write_at_its_next_request(fake, child):
    c = factories.make_catalog(fake.url)
    assert child(c.policy.id)["upstream_name"] == "gpt-4o-2024-08-06"
    assert child(c.policy.id)["upstream_name"] == "gpt-4o-2024-08-06"  # served from its cache

    HostBinding.objects.filter(model__name="gpt-4o").update(upstream_name="changed-by-update")
    assert child(c.policy.id)["upstream_name"] == "changed-by-update"

    key = HostKey.objects.get(name="openai-0")
    key.enabled = False
    key.save()
    assert child(c.policy.id)["keys"] == ["openai-1", "openai-2"]

    Policy.objects.get(pk=c.policy.pk).delete()
    assert child(c.policy.id) == {"error": "no_policy"}


def test_without_redis_nothing_is_cached_and_a_lost_bump_is_retried(catalog, settings):
    from core import catalog as cache
    from core.redis import get_redis

    route_of(catalog.policy.id)
    before = cache._local_cache.current().gen
    good_url = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/11"  # nothing listens there
    try:
        # Reads go to the database, and a write's bump cannot reach Redis.
        HostBinding.objects.filter(model__name="gpt-4o").update(upstream_name="during-outage")
        assert route_of(catalog.policy.id).binding.upstream_name == "during-outage"
        assert generation.bump_pending()
    finally:
        settings.REDIS_URL = good_url
    assert get_redis().get(cache.GEN_KEY) == before  # the bump was lost …
    cache._local_cache.current()  # … and is made by this process's next request
    assert get_redis().get(cache.GEN_KEY) != before
    assert not generation.bump_pending()


# --- the pipeline: routed with the held snapshot, confirmed by the key pick ----------------------


def _chat(client, catalog, model="gpt-4o"):
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return client.post(
        "/v1/chat/completions",
        data=body,
        content_type="application/json",
        headers={"Authorization": f"Bearer {catalog.key}"},
    )


def _as_if_elsewhere(write):
    """Run a catalog write as another process would: the counter in Redis moves on, but this
    process keeps the snapshot it holds (its cache is not cleared by somebody else's write)."""
    from core import catalog as cache

    held = cache._local_cache.snapshot
    write()
    cache._local_cache.snapshot = held
    return held


def test_the_pipeline_routes_again_when_the_pick_finds_its_snapshot_stale(client, catalog):
    from core import catalog as cache

    assert _chat(client, catalog).json()["model"] == "gpt-4o-2024-08-06"
    held = _as_if_elsewhere(
        lambda: HostBinding.objects.filter(model__name="gpt-4o").update(upstream_name="changed-elsewhere")
    )
    resp = _chat(client, catalog)
    assert resp.status_code == 200 and resp.json()["model"] == "changed-elsewhere"
    assert cache._local_cache.snapshot is not held


def test_a_refusal_found_with_a_held_snapshot_is_confirmed_before_it_is_answered(client, catalog):
    assert _chat(client, catalog, "gpt-new").json()["error"]["code"] == "model_not_found"

    def add_model():
        model = LLMModel.objects.create(name="gpt-new", provider="openai")
        HostBinding.objects.create(
            model=model, host=catalog.hosts["openai"], adapter="openai", upstream_name="gpt-new-1"
        )

    _as_if_elsewhere(add_model)
    resp = _chat(client, catalog, "gpt-new")
    assert resp.status_code == 200 and resp.json()["model"] == "gpt-new-1"


def test_a_disabled_key_is_never_picked_from_a_held_snapshot(client, catalog):
    _chat(client, catalog)
    _as_if_elsewhere(lambda: HostKey.objects.filter(host__name="openai").exclude(name="openai-2").update(enabled=False))
    for _ in range(4):
        resp = _chat(client, catalog)
        assert resp.status_code == 200
    from usage.models import UsageEvent

    last = UsageEvent.objects.order_by("-id")[:4]
    assert {e.host_key_id for e in last} == {HostKey.objects.get(name="openai-2").id}


# --- relay keys: cached with the catalog, re-checked when it moves on --------------------------


def test_a_key_revoked_elsewhere_is_refused_at_the_next_live_request(client, catalog):
    from core import services

    assert _chat(client, catalog).status_code == 200  # the key's row is now cached here
    _as_if_elsewhere(lambda: services.revoke_relay_key(catalog.key_obj))
    resp = _chat(client, catalog)
    assert resp.status_code == 401 and resp.json()["error"]["message"] == "api key revoked"


def test_a_key_disabled_elsewhere_is_refused_by_the_batch_api_too(client, catalog):
    headers = {"Authorization": f"Bearer {catalog.key}"}
    assert client.get("/v1/batches", headers=headers).status_code == 200
    _as_if_elsewhere(lambda: RelayKey.objects.filter(pk=catalog.key_obj.pk).update(enabled=False))
    resp = client.get("/v1/batches", headers=headers)
    assert resp.status_code == 401 and resp.json()["error"]["message"] == "api key disabled"


def test_a_cached_key_still_expires_on_time(client, catalog):
    from datetime import timedelta

    from django.utils import timezone

    expires_at = timezone.now() + timedelta(seconds=1)
    RelayKey.objects.filter(pk=catalog.key_obj.pk).update(expires_at=expires_at)
    assert _chat(client, catalog).status_code == 200
    # No write: only the clock moves, past the expiry.
    wait_for(lambda: timezone.now() > expires_at + timedelta(seconds=0.1), 5, interval=0.05, what="the expiry")
    resp = _chat(client, catalog)
    assert resp.status_code == 401 and resp.json()["error"]["message"] == "api key expired"


def test_a_key_enabled_again_elsewhere_is_accepted_at_the_next_live_request(client, catalog):
    RelayKey.objects.filter(pk=catalog.key_obj.pk).update(enabled=False)
    assert _chat(client, catalog).status_code == 401  # the disabled row is now cached here
    _as_if_elsewhere(lambda: RelayKey.objects.filter(pk=catalog.key_obj.pk).update(enabled=True))
    assert _chat(client, catalog).status_code == 200


# --- batch items: checked against the held catalog; the pick confirms it ---------------------------


def _batch_items(catalog, n):
    import io

    from batches.surfaces.native import submit
    from core import auth

    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * n}
    principal = auth.principal_for_key(catalog.key)
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def _run_next():
    from batches.lifecycle import claim as batch_claims
    from batches.models import Item
    from batches.worker import execute as batch_execute

    item = batch_claims.claim("test")
    batch_execute.run_item(item)
    return Item.objects.get(pk=item.pk)


@pytest.mark.parametrize(
    "write, error, code",
    [
        (
            lambda c: RelayKey.objects.filter(pk=c.key_obj.pk).update(enabled=False),
            "batch: credential no longer valid: api key disabled",
            "credential_invalid",
        ),
        (lambda c: Policy.objects.filter(pk=c.policy.pk).update(enabled=False), "batch: policy_unavailable", None),
    ],
    ids=["key-disabled", "policy-disabled"],
)
def test_a_batch_item_checked_with_a_held_snapshot_fails_as_before_when_the_pick_finds_it_stale(
    catalog, fake, write, error, code
):
    from usage.models import UsageEvent

    _batch_items(catalog, 2)
    assert _run_next().state == "completed"  # the key's row and the policy are now cached here
    _as_if_elsewhere(lambda: write(catalog))
    item = _run_next()
    assert (item.state, item.error) == ("discarded", error)
    assert len(fake.received) == 1, "the stale pick consumed nothing: the second item never reached the provider"
    event = UsageEvent.objects.get(request_id=str(item.pk))
    assert event.error_kind == (code or "policy_unavailable")
