"""The pipeline's stages (gateway.stages), each called directly against real PostgreSQL and Redis: resolve,
admit, pick, settle (price, the usage event, the budget charge). The live path, a relay-run record and a
provider job call these same functions; here each one's decisions are pinned on their own."""

import io
import json
import time
from datetime import timedelta
from types import SimpleNamespace

import pytest

from batches import ingest
from batches.provider import results
from batches.surfaces.openai import create as openai_create
from core import auth
from core import catalog as catalog_cache
from core.errors import RelayError
from core.models import Host, HostBinding, HostKey, Pricing
from core.services import revoke_relay_key
from gateway import pipeline, stages
from policies import breaker
from policies.breaker import Failure
from policies.models import Policy, PolicyHostKey
from usage import budgets
from usage.models import Budget, BudgetHold, BudgetPeriod
from usage.pricing import cost_nano_usd, provider_batch_cost
from usage.tokens import Tokens

pytestmark = pytest.mark.django_db

USD = 1_000_000_000
CHAT = "/v1/chat/completions"


@pytest.fixture
def principal(catalog):
    return auth.principal_for_key(catalog.key)


def call(principal, *, path=CHAT, model="gpt-4o", source="live", required_adapter=None, **kw) -> pipeline.Call:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    return pipeline.Call(
        path=path,
        body=body,
        principal=principal,
        source=source,
        request_id=kw.pop("request_id", "req-1"),
        deadline=time.monotonic() + 30,
        required_adapter=required_adapter,
        **kw,
    )


def spent(budget: Budget) -> tuple[int, int]:
    start, _ = budgets.period_bounds(budget.period)
    row = BudgetPeriod.objects.filter(budget=budget, period_start=start).first()
    return (row.spent_nanos, row.reserved_nanos) if row else (0, 0)


# --- resolve -----------------------------------------------------------------------------------------


def test_resolve_takes_a_policy_or_its_id_and_names_each_routing_error(catalog):
    route = stages.resolve(catalog.policy.id, "gpt-4o")
    assert route.binding.upstream_name == "gpt-4o-2024-08-06"
    assert [k.name for k in route.keys] == ["openai-0", "openai-1", "openai-2"]
    assert stages.resolve(catalog.policy, "gpt-4o").binding.id == route.binding.id

    def code(policy, model):
        with pytest.raises(RelayError) as err:
            stages.resolve(policy, model)
        return err.value.status, err.value.code

    assert code(catalog.policy, "no-such-model") == (404, "model_not_found")
    assert code(catalog.policy, None) == (400, "invalid_request")
    assert code(None, "gpt-4o") == (403, "no_policy")
    narrow = Policy.objects.create(name="narrow", project=catalog.project, grants=["anthropic/*"])
    assert code(narrow, "gpt-4o") == (403, "model_not_allowed")
    assert code(narrow, "claude-sonnet") == (503, "no_keys")  # granted, but no key of its host in the pool
    Policy.objects.filter(pk=narrow.pk).update(enabled=False)
    narrow.refresh_from_db()
    assert code(narrow, "claude-sonnet") == (403, "policy_disabled")


def test_resolve_call_checks_the_shape_against_the_binding(catalog, principal):
    _, route, path = stages.resolve_call(call(principal), None)
    assert path == CHAT and route.adapter == "openai"
    with pytest.raises(RelayError) as err:
        stages.resolve_call(call(principal, path="/v1/messages"), None)
    assert err.value.code == "cross_shape_dispatch"
    # A batch record of the Responses shape on an openai binding whose host serves Responses: the spec's exception.
    _, _, path = stages.resolve_call(call(principal, required_adapter="openai_responses"), None)
    assert path == CHAT
    with pytest.raises(RelayError) as err:
        stages.resolve_call(call(principal, model="claude-sonnet", required_adapter="openai"), None)
    assert err.value.code == "cross_shape_dispatch"


def test_responses_on_an_openai_binding_is_let_through_by_the_hosts_kind_not_its_name(catalog, principal, fake):
    # A host of the openai kind under another name serves /v1/responses natively.
    other = Host.objects.create(name="oai-eu", kind="openai", base_url=fake.url)
    model = HostBinding.objects.get(model__name="gpt-4o").model
    HostBinding.objects.filter(model=model).update(host=other)
    key = HostKey(name="oai-eu-0", host=other)
    key.set_value("upstream-oai-eu-0")
    key.save()
    PolicyHostKey.objects.create(policy=catalog.policy, host_key=key, position=10)
    _, route, path = stages.resolve_call(call(principal, path="/v1/responses"), None)
    assert path == "/v1/responses" and route.host.name == "oai-eu"
    # A host named "openai" whose kind does not serve Responses (Gemini's OpenAI wire) refuses it.
    Host.objects.filter(pk=catalog.hosts["openai"].pk).update(name="openai-old")
    gemini = Host.objects.create(name="openai", kind="gemini", base_url=fake.url)
    HostBinding.objects.filter(model=model).update(host=gemini)
    key = HostKey(name="gemini-0", host=gemini)
    key.set_value("upstream-gemini-0")
    key.save()
    PolicyHostKey.objects.create(policy=catalog.policy, host_key=key, position=11)
    with pytest.raises(RelayError) as err:
        stages.resolve_call(call(principal, path="/v1/responses"), None)
    assert err.value.code == "cross_shape_dispatch"


def test_the_credential_recheck_refuses_a_revoked_key(catalog, principal):
    stages.recheck_credential(principal, catalog_cache.current())
    revoke_relay_key(catalog.key_obj)
    with pytest.raises(RelayError):
        stages.recheck_credential(principal, catalog_cache.current())


# --- admit -------------------------------------------------------------------------------------------


def test_admit_reserves_a_batch_records_worst_case_and_refuses_when_the_budget_is_spent(catalog, principal):
    assert stages.admit(call(principal)) is None  # a live call: its view checks and charges
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    record = call(principal, source="batch", policy=catalog.policy, discount_percent=50)
    hold = stages.admit(record)
    route = stages.resolve(catalog.policy, "gpt-4o")
    worst = stages.worst_nanos(route.binding.pricing, record.body, 50)
    assert worst > 0 and spent(budget) == (0, worst)
    stages.charge([{"cost_nano_usd": 1000, "billed_cost_nano_usd": 500}], hold=hold, request_id="req-1")
    assert spent(budget) == (500, 0) and not BudgetHold.objects.exists()

    Budget.objects.filter(pk=budget.pk).update(usd_nanos=500)  # spent to the last nano-USD
    with pytest.raises(budgets.BudgetExceeded):
        stages.admit(call(principal, source="batch", policy=catalog.policy))
    with pytest.raises(budgets.BudgetExceeded):
        stages.admit_job_check(principal, catalog.policy.id)


def test_admit_job_reserves_the_records_worst_case_and_the_charge_settles_a_chunk(catalog, principal):
    assert stages.admit_job_check(principal, catalog.policy.id) is False  # no budget: nothing to reserve
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    assert stages.admit_job_check(principal, catalog.policy.id) is True
    held = stages.admit_job(principal, catalog.policy.id, 10_000, 4, timedelta(hours=1))
    assert held["per_record"] == 2_500 and spent(budget) == (0, 10_000)
    events = [{"cost_nano_usd": 400, "billed_cost_nano_usd": 700}, {"cost_nano_usd": 300}]
    stages.charge(events, job_hold=held, records=2)
    assert spent(budget) == (1_000, 5_000)


# --- pick --------------------------------------------------------------------------------------------


def test_pick_skips_a_key_whose_breaker_is_open(catalog):
    route = stages.resolve(catalog.policy, "gpt-4o")
    first = stages.key_candidates(route.keys)[0]
    stages.score_failure(first.key_hash, Failure.AUTH)  # a 401 benches the key for everyone
    picks = stages.pick(catalog.policy, route, source="live")
    cand, tier = next(iter(picks))
    assert cand.key.name == "openai-1"
    tier.release()
    picks.inbound.release()
    assert stages.pick_one(catalog.policy, stages.key_candidates(route.keys)).key.name != "openai-0"


def test_a_quiet_failure_of_a_retried_record_scores_nothing(catalog, principal):
    route = stages.resolve(catalog.policy, "gpt-4o")
    cand = stages.key_candidates(route.keys)[0]
    for _ in range(5):
        stages.score_failure(cand.key_hash, Failure.SERVER, principal=principal, quiet=True)
    assert breaker.try_acquire(cand.key_hash)
    assert stages.pick_one(catalog.policy, [cand]).key.name == "openai-0"


def test_pick_one_finds_nothing_when_every_breaker_is_open(catalog):
    route = stages.resolve(catalog.policy, "gpt-4o")
    cands = stages.key_candidates(route.keys)
    for cand in cands:
        stages.score_failure(cand.key_hash, Failure.AUTH)
    assert stages.pick_one(catalog.policy, cands) is None
    assert stages.pick_one(catalog.policy, []) is None


def test_a_route_whose_every_secret_is_unreadable_is_no_keys(catalog):
    HostKey.objects.filter(host=catalog.hosts["openai"]).update(value_env="RELAY_TEST_UNSET_SECRET", value_encrypted="")
    route = stages.resolve(Policy.objects.get(pk=catalog.policy.pk), "gpt-4o")
    with pytest.raises(RelayError) as err:
        stages.pick(catalog.policy, route, source="live")
    assert (err.value.status, err.value.code) == (503, "no_keys")


# --- settle ------------------------------------------------------------------------------------------


def test_price_is_the_list_price_relay_run_and_the_batch_price_provider_run():
    pricing = Pricing.objects.create(name="p", input_nanos_per_mtok=2_000_000_000, output_nanos_per_mtok=8_000_000_000)
    tokens = Tokens(input=1_000, output=500)
    listed = cost_nano_usd(pricing, tokens)
    assert listed == 6_000_000
    assert stages.price(pricing, tokens) == (listed, None)  # relay-run, no discount: billed is the cost
    assert stages.price(pricing, tokens, 50) == (listed, listed // 2)
    batch_price = provider_batch_cost(pricing, tokens)
    assert batch_price == listed // 2  # no batch rates set: half the live ones
    assert stages.price(pricing, tokens, 0, executed_by="provider") == (batch_price, listed)
    assert stages.price(pricing, tokens, 50, executed_by="provider") == (batch_price, listed // 2)
    assert stages.price(None, tokens, 50) == (None, None)
    assert stages.price(pricing, None, 50, executed_by="provider") == (None, None)


def test_a_relay_run_and_a_provider_run_records_events_differ_only_in_who_ran_it_and_its_cost(catalog, principal, fake):
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "gpt-4o", "messages": []}}
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": [line]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        batch = openai_create.create(principal, submission)
    assert batch.discount_percent > 0
    record = call(
        principal,
        source="batch",
        policy=catalog.policy,
        batch_id=str(batch.id),
        discount_percent=batch.discount_percent,
        request_id="item-1",
    )
    relay_run = pipeline.dispatch(record)
    assert relay_run.ok, relay_run.body
    route = stages.resolve(catalog.policy, "gpt-4o")
    job = SimpleNamespace(endpoint=CHAT, host_key_id=relay_run.event["host_key_id"], submitted_at=None)
    context = SimpleNamespace(batch=batch, binding=route.binding, route=route)
    provider_run = results._event(
        job, context, batch.event_attribution(), "item-1", 200, json.loads(relay_run.body), "", ""
    )
    assert set(relay_run.event) == set(provider_run)
    differ = {k for k in relay_run.event if relay_run.event[k] != provider_run[k]}
    assert differ - {"ts", "duration_ms"} == {"executed_by", "cost_nano_usd"}
    assert (relay_run.event["executed_by"], provider_run["executed_by"]) == ("relay", "provider")
    tokens = Tokens(relay_run.event["input_tokens"], relay_run.event["output_tokens"])
    assert tokens.output > 0
    assert relay_run.event["cost_nano_usd"] == cost_nano_usd(route.binding.pricing, tokens)
    assert provider_run["cost_nano_usd"] == provider_batch_cost(route.binding.pricing, tokens)
    assert provider_run["billed_cost_nano_usd"] == relay_run.event["billed_cost_nano_usd"]


def test_charge_without_a_reservation_bills_the_events_attribution(catalog, principal):
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    event = {**principal.usage_attribution(), "cost_nano_usd": 1000, "billed_cost_nano_usd": None}
    stages.charge([event, {**event, "billed_cost_nano_usd": 300}])
    assert spent(budget) == (1_300, 0)
    stages.charge([{**event, "cost_nano_usd": None}])  # unpriced: nothing
    assert spent(budget) == (1_300, 0)
    stages.charge([event], hold=None)  # a record no budget governed when it was admitted: nothing
    assert spent(budget) == (1_300, 0)
    stages.charge([event], job_hold=None, records=1)  # a job that reserved nothing: charged as a live call is
    assert spent(budget) == (2_300, 0)
