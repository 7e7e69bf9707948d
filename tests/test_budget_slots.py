"""A spend budget against a full fleet's slots (usage/budgets.py): eight slots reserving at once never take a
budget past its limit by more than one record. The pipeline runs in eight threads, each claiming and running
records as an item worker's slot does, against PostgreSQL, Redis and the fake provider."""

import io
import json
import threading

import pytest
from django.db import connections

from batches.lifecycle import claim as claims
from batches.models import Item
from batches.surfaces.native import submit
from batches.worker import execute
from core import auth, generation
from core.models import Pricing
from devkit.upstream import Reply, canned
from usage import budgets
from usage.models import Budget, BudgetHold, BudgetPeriod, UsageEvent
from usage.pricing import cost_nano_usd
from usage.tokens import Tokens, estimate, worst_case

pytestmark = pytest.mark.django_db(transaction=True)

SLOTS = 8
RECORDS = 30
# A prompt of short words: one token each (the fake counts words, as a tokenizer counts " a"), twice what
# the ~4-characters-a-token size estimate makes of it. Digits, code and most non-Latin text do the same.
PROMPT = " ".join(["a"] * 2000)


def record(i: int) -> dict:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": f"{PROMPT} {i}"}]}
    usage = canned("/v1/chat/completions", body)["usage"]
    # The output limit is what the answer takes (the fake ignores it; a provider stops there).
    return dict(body, max_tokens=usage["completion_tokens"])


def real_cost(body: dict, price: Pricing) -> int:
    usage = canned("/v1/chat/completions", body)["usage"]
    return cost_nano_usd(price, Tokens(input=usage["prompt_tokens"], output=usage["completion_tokens"]))


def run_slots(n: int) -> list:
    """`n` slots claiming and running records until none is left; what any of them raised."""
    errors = []

    def slot(number: int) -> None:
        try:
            while (item := claims.claim(f"slot-{number}")) is not None:
                execute.run_item(item)
        except Exception as exc:  # pragma: no cover - reported by the test
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=slot, args=(n,)) for n in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_eight_slots_reserving_at_once_never_overshoot_a_budget_that_fits_five_records(catalog, fake):
    price = Pricing.objects.get(name="p-gpt")
    bodies = [record(i) for i in range(RECORDS)]
    cost = max(real_cost(b, price) for b in bodies)  # what one record really costs, at most
    # The size estimate falls short of what these records cost: reserving it let every slot overshoot.
    assert budgets.worst_case_nanos(price, estimate(bodies[0])) < real_cost(bodies[0], price)
    assert budgets.worst_case_nanos(price, worst_case(bodies[0])) >= cost
    limit = 5 * cost + cost // 2  # room for five records' real cost, not six
    budget = Budget.objects.create(name="proj-day", project=catalog.project, usd_nanos=limit, period="day")
    # Each call takes a while, so all eight slots have reserved before the first one settles.
    fake.script("*", [Reply(delay=0.4) for _ in range(RECORDS)])
    principal = auth.principal_for_key(catalog.key)
    batch = submit.submit_native(principal, io.BytesIO(json.dumps({"shape": "openai", "requests": bodies}).encode()))

    assert run_slots(SLOTS) == []

    billed = [e.cost_nano_usd for e in UsageEvent.objects.filter(batch_id=str(batch.id)) if e.cost_nano_usd]
    spent = sum(billed)
    assert billed, "no record ran"
    assert spent <= limit + cost, f"spent {spent} against a limit of {limit}: {spent - limit} over"
    # Every record's cost reached the budget, and no reservation is left behind.
    row = BudgetPeriod.objects.get(budget=budget)
    assert (row.spent_nanos, row.reserved_nanos) == (spent, 0)
    assert not BudgetHold.objects.exists()
    # The records that found no room failed with the budget's code (the native surface's rule).
    refused = Item.objects.filter(batch_id=batch.id, state="discarded")
    assert refused.exists() and {i.error_code for i in refused} == {"budget_exceeded"}


def test_the_worst_case_bounds_the_prompt_by_its_bytes_and_the_output_by_every_choice():
    ascii_body = {"model": "m", "messages": [{"role": "user", "content": "1 2 3 4 5 6 7 8"}], "max_tokens": 10}
    size = len(json.dumps(ascii_body, separators=(",", ":")))
    assert worst_case(ascii_body) == Tokens(input=size, output=10)
    assert estimate(ascii_body).input < size  # the estimate is a quarter of it
    # A character of most non-Latin scripts is a token or more: its three UTF-8 bytes bound it.
    cjk = {"model": "m", "messages": [{"role": "user", "content": "预算" * 50}], "max_tokens": 10}
    assert worst_case(cjk).input >= 100 * 3
    # n completions are n outputs (best_of generates that many, billed, and returns n).
    assert worst_case(dict(ascii_body, n=3)).output == 30
    assert worst_case(dict(ascii_body, n=2, best_of=5)).output == 50
    assert worst_case({"model": "m", "prompt": "x", "n": True}).output == 4096  # not a count: one choice


def test_a_prompt_that_may_write_the_cache_is_reserved_at_the_cache_write_rate():
    price = Pricing(name="c", input_nanos_per_mtok=3_000_000_000, output_nanos_per_mtok=15_000_000_000)
    price.cache_write_nanos_per_mtok = 3_750_000_000  # Anthropic's 5-minute cache write: 1.25 x input
    worst = budgets.worst_case_nanos(price, Tokens(input=1000, output=100))
    assert worst == 1000 * 3_750 + 100 * 15_000
    price.cache_write_nanos_per_mtok = None
    assert budgets.worst_case_nanos(price, Tokens(input=1000, output=100)) == 1000 * 3_000 + 100 * 15_000


# --- a budget made while a worker holds an older catalog ----------------------------------------------------


def made_elsewhere(monkeypatch, **fields) -> Budget:
    """A budget written by another process (the admin's, `relay apply`'s): the row and the catalog generation
    in Redis are new, while this process's catalog snapshot (its budgets with it) is not told until it looks."""
    monkeypatch.setattr(generation, "_listeners", [])
    budget = Budget.objects.create(**fields)
    monkeypatch.undo()
    return budget


def test_a_budget_made_in_another_process_governs_a_workers_next_record_at_once(catalog, fake, monkeypatch):
    from tests.test_batch_retries import native_batch, run_next

    native_batch(catalog, n=2)
    run_next()  # this worker has routed and read its budgets (none) with the catalog it holds
    budget = made_elsewhere(monkeypatch, name="proj", project=catalog.project, usd_nanos=10**9, period="day")
    item = run_next()
    assert item.state == "completed"
    # Reserved and charged (on top of the day's spend before the budget was made): before, the stale
    # snapshot's "no budget" let the record run unreserved, and its cost never reached the budget.
    events = UsageEvent.objects.filter(project_id=catalog.project.id)
    assert events.count() == 2 and events.get(request_id=str(item.id)).cost_nano_usd
    row = BudgetPeriod.objects.filter(budget=budget).first()
    assert row is not None and (row.spent_nanos, row.reserved_nanos) == (sum(e.cost_nano_usd for e in events), 0)


def test_a_spent_budget_made_in_another_process_stops_a_workers_next_record_before_its_call(catalog, fake, monkeypatch):
    from tests import factories
    from tests.test_batch_retries import native_batch, run_next

    # One call at a time on the policy and on the key: what the pick took must come back.
    catalog.policy.rate_limit = factories.rate_limit("one-at-a-time", ("concurrency", 1, 60, "sliding-window"))
    catalog.policy.save()
    for key in catalog.keys:
        key.rate_limit = catalog.policy.rate_limit
        key.save()
    native_batch(catalog, n=3)
    run_next()
    calls = len(fake.received)
    budget = made_elsewhere(monkeypatch, name="proj", project=catalog.project, usd_nanos=0, period="day")
    item = run_next()
    assert (item.state, item.error_code) == ("discarded", "budget_exceeded")
    assert len(fake.received) == calls  # the key was picked, given back, and never called
    budget.usd_nanos = 10**9
    budget.save()
    assert run_next().state == "completed"  # the policy's and the key's one slot were given back
