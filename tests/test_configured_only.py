"""Pay only for what is configured: a feature nobody configured does no work on the hot path.

Each test counts the work itself (matcher builds, estimator calls, Redis keys written, result groups
stored), never a time: the scrubber's matcher is built when the secrets change, not per call; the token
estimate is made only where a token limit or a learned token quota meters tokens; live first's marks
are written only where a batch pick reads them (a batch_share below 1); the bookkeeper groups results
only where a group saves a write (not on the `dir` store)."""

import io
import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from batches.surfaces.native import submit
from batches.worker import bookkeeper as keeper
from batches.worker import drain as draining
from core import auth, scrub
from core.crypto import sha256_hex
from core.models import HostKey
from core.redis import get_redis
from gateway import pipeline
from policies import keypool, provider_limits
from policies.models import Policy
from tests import factories

pytestmark = pytest.mark.django_db

CHAT = "/v1/chat/completions"
BODY = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10}


def live_call(client, catalog):
    resp = client.post(
        CHAT, data=BODY, content_type="application/json", headers={"Authorization": f"Bearer {catalog.key}"}
    )
    assert resp.status_code == 200, resp.content
    return resp


@pytest.fixture
def estimates(monkeypatch):
    """Calls of the pipeline's token estimator; no key is known to this process as token-metered yet."""
    calls = []
    real = pipeline.estimate
    monkeypatch.setattr(pipeline, "estimate", lambda body, *a: calls.append(body) or real(body, *a))
    monkeypatch.setattr(keypool, "_token_metered", set(), raising=False)
    return calls


# --- the scrubber's matcher ------------------------------------------------------------------------------


def test_the_scrubbers_matcher_is_built_when_the_secrets_change_not_per_call(monkeypatch):
    scrub.forget_all()
    built = []
    real = scrub._Matcher
    monkeypatch.setattr(scrub, "_Matcher", lambda values: built.append(values) or real(values))
    listed = []  # the secrets gathered and sorted: once per build, not per call
    real_known = scrub.known_values
    monkeypatch.setattr(scrub, "known_values", lambda **kw: listed.append(1) or real_known(**kw))
    try:
        scrub.remember("sk-live-one-abcdefgh")
        for _ in range(5):
            assert scrub.scrub_text("echo sk-live-one-abcdefgh", load=False) == f"echo {scrub.REDACTED}"
            scrub.scrub_headers({"x-a": "a header value", "x-b": "another header value"}, load=False)
        assert len(built) == len(listed) == 1
        scrub.remember("sk-live-two-abcdefgh")  # a new secret: built again, once
        for _ in range(3):
            assert scrub.scrub_text("echo sk-live-two-abcdefgh", load=False) == f"echo {scrub.REDACTED}"
        assert len(built) == len(listed) == 2
    finally:
        scrub.forget_all()


def test_a_text_too_short_to_hold_a_secret_is_not_searched(monkeypatch):
    scrub.forget_all()
    monkeypatch.setattr(scrub, "_matcher", lambda load: pytest.fail("searched"))
    assert scrub.scrub_text("gzip", load=False) == "gzip"
    assert scrub.scrub_bytes(b"{}", load=False) == b"{}"
    assert scrub.scrub_headers({"Content-Length": "42"}, load=False) == {"Content-Length": "42"}


def test_a_catalog_write_has_the_scrubber_read_the_host_keys_again(catalog):
    scrub.forget_all()
    try:
        assert scrub.scrub_text("no secret in this text") == "no secret in this text"  # the catalog is loaded
        key = HostKey(name="openai-new", host=catalog.hosts["openai"])
        key.set_value("sk-added-a-moment-ago")
        key.save()  # bumps the generation: read again at the next load=True use, not RELOAD_SECONDS later
        assert scrub.scrub_text("echo sk-added-a-moment-ago") == f"echo {scrub.REDACTED}"
    finally:
        scrub.forget_all()


# --- the token estimate ------------------------------------------------------------------------------------


def test_no_token_estimate_where_nothing_meters_tokens(client, catalog, estimates):
    live_call(client, catalog)
    live_call(client, catalog)
    assert estimates == []


def test_a_token_rule_of_the_policys_limit_has_the_request_estimated(client, catalog, estimates):
    catalog.policy.rate_limit = factories.rate_limit("tok", ("tokens", 100_000, 60, "sliding-window"))
    catalog.policy.save()
    live_call(client, catalog)
    assert len(estimates) == 1


def test_a_learned_token_quota_has_the_request_estimated_and_reserved(client, catalog, estimates, monkeypatch):
    key_hash = sha256_hex("upstream-openai-0")[:12]
    headers = {
        "x-ratelimit-limit-tokens": "100000",
        "x-ratelimit-remaining-tokens": "90000",
        "x-ratelimit-reset-tokens": "60s",
    }
    provider_limits.learn(key_hash, headers)
    taken = []
    real = provider_limits.settle_args
    monkeypatch.setattr(
        provider_limits,
        "settle_args",
        lambda h, held=provider_limits.NOTHING_HELD, used=None: taken.append(held) or real(h, held, used),
    )
    live_call(client, catalog)  # the pick finds the quota (nothing taken), the request is estimated, picked again
    live_call(client, catalog)  # this process knows the key now: estimated up front
    assert len(estimates) == 2
    assert keypool._token_metered == {key_hash}
    # Both calls held their worst case on the quota, as when every call was estimated.
    assert [bool(held) for held in taken] == [True, True]


# --- live first ----------------------------------------------------------------------------------------------


def live_marks() -> list:
    return sorted(k for k in get_redis().scan_iter("relay:live:*") if not k.endswith(":denied"))


def limit_policy(catalog, share: str) -> None:
    """The catalog's policy with a rate limit of its own (a limit live and batch traffic share) and `share`."""
    catalog.policy.rate_limit = factories.rate_limit(f"req-{share}", ("requests", 1000, 60, "sliding-window"))
    catalog.policy.batch_share = Decimal(share)
    catalog.policy.save()


def test_live_requests_leave_no_live_marks_where_no_batch_share_is_below_one(client, catalog):
    limit_policy(catalog, "1.00")
    live_call(client, catalog)
    assert live_marks() == []


def test_live_requests_mark_what_a_batch_pick_with_a_share_below_one_reads(client, catalog):
    key_hash = sha256_hex("upstream-openai-0")[:12]
    limit_policy(catalog, "1.00")
    # Another policy pooling the same key leaves live traffic a part of it: the key is marked, not the policy.
    other = Policy.objects.create(name="pol-b", project=catalog.project, grants=["*"], batch_share=Decimal("0.5"))
    other.pool_links.create(host_key=catalog.keys[0], position=0)
    live_call(client, catalog)
    assert live_marks() == [f"relay:live:{{{key_hash}}}"]
    limit_policy(catalog, "0.80")
    live_call(client, catalog)
    assert live_marks() == [f"relay:live:{{{key_hash}}}", f"relay:live:{{policy:{catalog.policy.pk}}}"]


# --- the bookkeeper's result groups -----------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("store,groups", [("dir", 0), ("db", 1)])
def test_results_are_grouped_only_where_a_group_saves_a_write(catalog, fake, monkeypatch, settings, store, groups):
    settings.RELAY_BATCH_PAYLOAD_STORE = store
    grouped = []
    real = keeper.write_results
    monkeypatch.setattr(keeper, "write_results", lambda writes: grouped.append(len(writes)) or real(writes))
    principal = auth.principal_for_key(catalog.key)
    body = {"shape": "openai", "requests": [BODY]}
    batch = submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))
    assert draining.drain() == 1
    keeper.bookkeeper().submit(lambda: None).result()  # the item's final write has run
    assert len(grouped) == groups
    batch.refresh_from_db()
    assert batch.status == "completed"


# --- the sweeper's feature steps ------------------------------------------------------------------------------


def test_the_sweep_skips_provider_jobs_and_budget_holds_where_none_is_in_use(catalog, monkeypatch):
    from batches import sweeper
    from batches.provider import jobs as provider_jobs
    from usage import budgets
    from usage.models import Budget, BudgetHold

    ran = []
    real_jobs, real_holds = provider_jobs.due_jobs, budgets.reclaim_expired
    monkeypatch.setattr(provider_jobs, "due_jobs", lambda: ran.append("jobs") or real_jobs())
    monkeypatch.setattr(budgets, "reclaim_expired", lambda: ran.append("holds") or real_holds())
    sweeper.sweep()
    assert ran == []
    # A budget's reservation whose holder died: the sweep gives it back.
    Budget.objects.create(name="b", usd_nanos=10**10, period="month", project=catalog.project)
    budgets.reserve(auth.principal_for_key(catalog.key), None, 1000)
    BudgetHold.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    sweeper.sweep()
    assert ran == ["holds"] and not BudgetHold.objects.exists()


# --- the metrics rollup's beat job -------------------------------------------------------------------------------


def test_the_rollup_beat_job_is_one_statement_when_nothing_was_written(client, catalog):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from core.models import UsageRollup
    from relay import tasks

    tasks.roll_up_metrics()  # its first run makes the cursor
    with CaptureQueriesContext(connection) as idle:
        assert tasks.roll_up_metrics() == 0
    assert len(idle.captured_queries) == 1
    live_call(client, catalog)  # a usage event: the next run counts it
    assert tasks.roll_up_metrics() == 1
    assert sum(UsageRollup.objects.values_list("n", flat=True)) == 1
