"""Spend budgets on batch records: a record reserves its worst case before its call and settles
with its billed cost after; a spent budget makes an OpenAI (or Anthropic) batch wait for the period to
roll over, and fails the item with budget_exceeded on the native surface. In process, against the fake
provider, with real PostgreSQL and Redis."""

import pytest
from django.utils import timezone

from batches.models import Batch, Item
from tests.test_batch_retries import native_batch, openai_batch, run_next
from usage import budgets
from usage.models import Budget, BudgetHold, BudgetPeriod, UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

USD = 1_000_000_000


def account(budget: Budget) -> tuple[int, int]:
    start, _ = budgets.period_bounds(budget.period)
    row = BudgetPeriod.objects.filter(budget=budget, period_start=start).first()
    return (row.spent_nanos, row.reserved_nanos) if row else (0, 0)


def test_a_record_with_room_is_charged_its_billed_cost_and_reserves_nothing_after(catalog, fake):
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    batch = openai_batch(catalog)
    item = run_next()
    assert item.state == "completed"
    event = UsageEvent.objects.get(request_id=str(item.id))
    assert event.billed_cost_nano_usd == event.cost_nano_usd * (100 - batch.discount_percent) // 100
    assert account(budget) == (event.billed_cost_nano_usd, 0)
    assert not BudgetHold.objects.exists()


def test_a_spent_budget_fails_a_native_item_with_budget_exceeded_and_calls_nothing(catalog, fake):
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=0, period="day")
    native_batch(catalog)
    item = run_next()
    assert item.state == "discarded" and item.error_code == "budget_exceeded"
    assert "budget" in item.error and fake.received == []


def test_a_spent_budget_makes_an_openai_batch_wait_for_the_period_not_fail(catalog, fake):
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=0, period="day")
    batch = openai_batch(catalog)
    item = run_next()
    assert item.state == "available" and item.retries == 0  # a wait, not an attempt used up
    batch.refresh_from_db()
    assert batch.not_before is not None and batch.not_before > timezone.now()  # every record charges the budget
    assert fake.received == []
    # The budget raised, and the wait (at most 60 s, to notice a raise) over: the record runs.
    budget = Budget.objects.get(name="proj")
    budget.usd_nanos = 100 * USD
    budget.save()
    Batch.objects.filter(pk=batch.pk).update(not_before=None)
    Item.objects.filter(pk=item.pk).update(not_before=None)
    assert run_next().state == "completed"
