"""Waits where they belong: a wait for a host's keys holds only the records bound for that host,
records bound for healthy hosts keep running, and a waiting record is not claimed again before its wait ends.
The policy's own limit and a spent budget still hold the whole batch.

Driven step by step (claim, run_item), as the Celery tasks call them, against PostgreSQL, Redis and the
fake provider; the clock is moved by rewriting `not_before` and clearing Redis, never by sleeping.
"""

import json
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from batches import retrying
from batches.lifecycle import claim as claims
from batches.models import Attempt, Batch, Item
from batches.outcomes import Code
from batches.worker import execute, waits
from core.errors import RelayError
from core.models import Host, HostBinding, HostKey, LLMModel
from core.redis import get_redis
from devkit.upstream import Reply
from policies.models import PolicyHostKey

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def two_hosts(catalog, fake):
    """The catalog plus a second Anthropic host ("anthropic-b", model "claude-b") with its own key. The host
    waits this process knows are forgotten before and after (they outlive a test's database)."""
    host = Host.objects.create(name="anthropic-b", base_url=fake.url)
    model = LLMModel.objects.create(name="claude-b", provider="anthropic")
    HostBinding.objects.create(model=model, host=host, adapter="anthropic", upstream_name="claude-b-1")
    key = HostKey(name="anthropic-b-0", host=host)
    key.set_value("upstream-anthropic-b-0")
    key.save()
    PolicyHostKey.objects.create(policy=catalog.policy, host_key=key, position=10)
    waits.forget()
    yield catalog
    waits.forget()


def req(custom_id, model, content):
    return {
        "custom_id": custom_id,
        "params": {"model": model, "max_tokens": 16, "messages": [{"role": "user", "content": content}]},
    }


def anthropic_batch(catalog, records) -> Batch:
    resp = Client().post(
        "/v1/messages/batches",
        data=json.dumps({"requests": records}),
        content_type="application/json",
        HTTP_X_API_KEY=catalog.key,
        HTTP_ANTHROPIC_VERSION="2023-06-01",
    )
    assert resp.status_code == 200, resp.content
    return Batch.objects.get(pk=Item.objects.filter(custom_id=records[0]["custom_id"]).latest("idx").batch_id)


def drain(owner="runner", limit=100) -> int:
    """Claim and run until nothing is claimable; the number of claims made."""
    for n in range(limit):
        item = claims.claim(owner)
        if item is None:
            return n
        execute.run_item(item)
    raise AssertionError("the drain did not end")


def items(batch) -> dict:
    return {i.custom_id: i for i in Item.objects.filter(batch=batch)}


def calls_with(fake, text: str) -> int:
    return sum(1 for r in fake.received if text in json.dumps(r.get("body", r)))


def test_a_paused_host_holds_only_its_own_records(two_hosts, fake):
    """The issue's case: the first record's host has one key, paused by a 401. Its other records wait for it,
    each claimed at most once; the records for the healthy host run at once; the batch itself never waits."""
    fake.answer_when("poison", Reply(status=401, body={"type": "error", "error": {"type": "authentication_error"}}))
    records = [
        req("a0", "claude-sonnet", "poison"),
        req("a1", "claude-sonnet", "one"),
        req("a2", "claude-sonnet", "two"),
    ]
    records += [req(f"b{i}", "claude-b", f"healthy {i}") for i in range(8)]
    batch = anthropic_batch(two_hosts, records)

    claims_made = drain()

    got = items(batch)
    assert got["a0"].state == "discarded" and got["a0"].status_code == 401  # the 401 itself is final
    assert all(got[f"b{i}"].state == "completed" for i in range(8))  # the healthy host's records ran
    a1, a2 = got["a1"], got["a2"]
    assert a1.state == a2.state == "available"
    wait = (a1.not_before - timezone.now()).total_seconds()
    assert 30 < wait <= 60  # the key's pause (the breaker's first step for a 401)
    assert a2.not_before == a1.not_before  # held with it ...
    assert a2.attempt == 0  # ... without a claim of its own
    assert a1.attempt == 1 and not Attempt.objects.filter(item=a1).exists()  # no provider call, no attempt
    assert Batch.objects.get(pk=batch.pk).not_before is None  # the batch never waited
    assert claims_made == 1 + 1 + 8  # a0, a1, and the eight healthy records: nothing claimed twice
    assert claims.claim("again") is None  # a waiting record is not claimed before its wait ends

    # The pause ends (the clock moved past it; the breaker's state gone): the held records run.
    Item.objects.filter(pk__in=[a1.pk, a2.pk]).update(not_before=timezone.now() - timedelta(seconds=1))
    get_redis().flushdb()
    waits.forget()
    assert drain() == 2
    got = items(batch)
    assert got["a1"].state == got["a2"].state == "completed"
    assert (got["a1"].attempt, got["a2"].attempt) == (2, 1)
    assert Batch.objects.get(pk=batch.pk).status == "completed"


def test_a_batch_whose_records_all_go_to_the_paused_host_waits_as_a_batch(two_hosts, fake):
    """Then the host's wait concerns every record: the batch waits, and nothing of it is claimed until then."""
    fake.answer_when("poison", Reply(status=401, body={"type": "error", "error": {"type": "authentication_error"}}))
    records = [req("a0", "claude-sonnet", "poison")] + [req(f"a{i}", "claude-sonnet", f"r {i}") for i in range(1, 6)]
    batch = anthropic_batch(two_hosts, records)
    assert drain() == 2  # a0 (401), a1 (meets the pause): the other four are never claimed
    got = items(batch)
    assert Batch.objects.get(pk=batch.pk).not_before == got["a1"].not_before
    assert [got[f"a{i}"].attempt for i in range(2, 6)] == [0, 0, 0, 0]


def test_a_known_host_wait_is_met_before_any_call_by_other_batches(two_hosts, fake):
    """A record of another batch, claimed while its host is known to wait (by this worker process), waits too:
    no key pick, no call."""
    until = timezone.now() + timedelta(seconds=30)
    waits.remember(two_hosts.policy.id, "anthropic", until)
    batch = anthropic_batch(two_hosts, [req("x", "claude-sonnet", "late"), req("y", "claude-b", "fine")])
    before = len(fake.received)
    assert drain() == 2
    got = items(batch)
    assert got["x"].state == "available" and abs((got["x"].not_before - until).total_seconds()) < 0.01
    assert got["y"].state == "completed"
    assert len(fake.received) == before + 1  # only "y" reached a provider
    assert not Attempt.objects.filter(item=got["x"]).exists()
    assert Batch.objects.get(pk=batch.pk).not_before is None


def test_an_upstream_429_on_every_key_holds_the_host_not_the_batch(two_hosts, fake):
    fake.answer_when("busy", Reply(status=429, headers={"Retry-After": "20"}))
    batch = anthropic_batch(
        two_hosts, [req("a0", "claude-sonnet", "busy"), req("a1", "claude-sonnet", "next"), req("b0", "claude-b", "ok")]
    )
    assert drain() == 2  # a0 (waits, holds a1), b0
    got = items(batch)
    assert got["a0"].state == got["a1"].state == "available" and got["a1"].attempt == 0
    assert 15 < (got["a0"].not_before - timezone.now()).total_seconds() <= 20
    assert Attempt.objects.get(item=got["a0"]).decision == "wait"  # the provider was called: an attempt
    assert got["b0"].state == "completed"
    assert Batch.objects.get(pk=batch.pk).not_before is None


def test_a_spent_policy_limit_still_holds_the_whole_batch(two_hosts, fake):
    from tests import factories

    two_hosts.policy.rate_limit = factories.rate_limit("one-a-minute", ("requests", 1, 60, "fixed-window"))
    two_hosts.policy.save()
    batch = anthropic_batch(two_hosts, [req("a", "claude-b", "one"), req("b", "claude-b", "two")])
    assert drain() == 2
    got = items(batch)
    assert got["a"].state == "completed" and got["b"].state == "available"
    assert Batch.objects.get(pk=batch.pk).not_before == got["b"].not_before  # every record shares this limit


# --- spend budgets: the batch side of the classification ------------------------------------------------------


class _Batch:
    def __init__(self, wait_for_capacity, retry_transient=True):
        self.wait_for_capacity, self.retry_transient = wait_for_capacity, retry_transient
        self.created_at = timezone.now()


class _Item:
    retries, max_attempts = 0, 5


@pytest.mark.parametrize(
    "code,status,expected",
    [
        (Code.NO_KEYS, None, retrying.ROUTE),
        (Code.UPSTREAM_ERROR, 429, retrying.ROUTE),
        (Code.RATE_LIMIT_EXCEEDED, None, retrying.BATCH),
        (Code.BUDGET_EXCEEDED, None, retrying.BATCH),
    ],
)
def test_the_scope_of_a_wait(code, status, expected):
    assert retrying.wait_scope(code, status) == expected


def test_a_spent_budget_waits_where_the_surface_waits_and_fails_the_native_default():
    # Waiting surfaces (OpenAI, Anthropic, native opted in): until the period ends, looked at again each minute.
    assert retrying.decide(_Batch(True), _Item(), Code.BUDGET_EXCEEDED, None, 30.0) == retrying.Decision(
        retrying.WAIT, 30.0, retrying.BATCH
    )
    far = retrying.decide(_Batch(True), _Item(), Code.BUDGET_EXCEEDED, None, 20 * 3600.0)
    assert (far.action, far.delay) == (retrying.WAIT, retrying.BUDGET_RECHECK_S)
    no_hint = retrying.decide(_Batch(True), _Item(), Code.BUDGET_EXCEEDED, None, None)
    assert (no_hint.action, no_hint.delay) == (retrying.WAIT, retrying.BUDGET_RECHECK_S)
    # The native surface's default: the item fails with budget_exceeded.
    assert retrying.decide(_Batch(False, False), _Item(), Code.BUDGET_EXCEEDED, None, 30.0).action == retrying.FINISH


class _Outcome:
    def __init__(self, retry_after, error):
        self.retry_after, self.error = retry_after, error


def test_the_wait_of_a_budget_refusal_is_read_from_its_retry_after_header():
    refusal = RelayError(429, "budget_exceeded", "budget spent", headers={"retry-after": "3600"})
    assert retrying.wait_hint(_Outcome(None, refusal)) == 3600.0
    assert retrying.wait_hint(_Outcome(None, RelayError(429, "budget_exceeded", "x", headers={"Retry-After": 5}))) == 5
    assert retrying.wait_hint(_Outcome(2.5, refusal)) == 2.5  # the pipeline's own figure first
    assert retrying.wait_hint(_Outcome(None, RelayError(429, "budget_exceeded", "no header"))) is None
    assert retrying.wait_hint(None) is None
