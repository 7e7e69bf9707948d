"""Spend budgets (usage/budgets.py): periods, which budgets apply, reserve / settle / charge, expiry of
holds, concurrency without overshoot, and `relay apply`'s `budgets:` section."""

import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from core import auth
from core.models import Pricing, Project, ServiceAccount, Team
from policies.models import Policy
from relay.config_apply import ConfigError, apply_config
from tests import factories
from usage import budgets
from usage.budgets import BudgetExceeded
from usage.models import Budget, BudgetHold, BudgetPeriod
from usage.services import record_event
from usage.tokens import Tokens

pytestmark = pytest.mark.django_db

USD = 1_000_000_000


def make(name="b", usd=10 * USD, period="month", **scope) -> Budget:
    return Budget.objects.create(name=name, usd_nanos=usd, period=period, **scope)


def account(budget: Budget) -> tuple[int, int]:
    start, _ = budgets.period_bounds(budget.period)
    row = BudgetPeriod.objects.get(budget=budget, period_start=start)
    return row.spent_nanos, row.reserved_nanos


@pytest.fixture
def principal(catalog):
    return auth.principal_for_key(catalog.key)


@pytest.fixture
def frozen(monkeypatch):
    """Set the clock the budgets read (django.utils.timezone.now) to a chosen instant."""

    def at(when: datetime):
        monkeypatch.setattr(timezone, "now", lambda: when)

    return at


# --- periods and money --------------------------------------------------------------------------


def test_periods_roll_over_at_utc_midnight_and_on_the_first():
    late = datetime(2026, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert budgets.period_bounds("day", late) == (datetime(2026, 12, 31, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    assert budgets.period_bounds("month", late) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))
    # A time given in another zone is placed by its UTC instant: 2027-01-01 00:30 UTC.
    east = datetime(2027, 1, 1, 1, 30, tzinfo=timezone.get_fixed_timezone(60))
    assert budgets.period_bounds("day", east)[0] == datetime(2027, 1, 1, tzinfo=UTC)
    assert budgets.period_bounds("month", datetime(2026, 2, 14, tzinfo=UTC))[1] == datetime(2026, 3, 1, tzinfo=UTC)


@pytest.mark.parametrize(
    "text,nanos", [("100.00", 100 * USD), ("0.5", USD // 2), (3, 3 * USD), ("0.000000001", 1), ("0", 0)]
)
def test_usd_parses_exactly(text, nanos):
    assert budgets.parse_usd(text) == nanos


@pytest.mark.parametrize("bad", ["-1", "ten", "0.0000000001", True, None, [1], "NaN", "1e30"])
def test_bad_usd_is_refused(bad):
    with pytest.raises(ValueError, match="usd"):
        budgets.parse_usd(bad)


def test_usd_text_keeps_every_nano_and_two_decimals():
    assert budgets.usd_text(100 * USD) == "100.00"
    assert budgets.usd_text(1) == "0.000000001"
    assert budgets.usd_text(12_340_000_000) == "12.34"
    assert budgets.usd_text(0) == "0.00"


# --- the model's invariants ---------------------------------------------------------------------


def test_a_budget_has_exactly_one_scope(catalog):
    with pytest.raises(IntegrityError), transaction.atomic():
        make("two", project=catalog.project, team=catalog.team)
    with pytest.raises(IntegrityError), transaction.atomic():
        make("none")
    with pytest.raises(IntegrityError), transaction.atomic():
        make("bad-period", period="week", team=catalog.team)
    assert make("one", team=catalog.team).scope == ("team", catalog.team.id)


# --- which budgets apply ------------------------------------------------------------------------


def test_budgets_of_the_callers_project_team_service_account_and_policy_apply(catalog, principal):
    other_team = Team.objects.create(name="team-b")
    other = Project.objects.create(name="proj-b", team=other_team)
    mine = [
        make("p", project=catalog.project),
        make("t", team=catalog.team),
        make("s", service_account=catalog.sa),
        make("pol", policy=catalog.policy),
    ]
    make("not-mine", project=other)
    make("not-my-sa", service_account=ServiceAccount.objects.create(project=other, name="sa-b"))
    make("off", team=catalog.team).__class__.objects.filter(name="off").update(enabled=False)
    assert [b.name for b in budgets.applicable(principal, None)] == [b.name for b in mine]
    # The governing policy can be given (a batch names its own): the principal's policy's budget goes.
    elsewhere = Policy.objects.create(name="pol-b", grants=["*"])
    names = [b.name for b in budgets.applicable(principal, elsewhere)]
    assert names == ["p", "t", "s"]


def test_no_query_for_budgets_when_none_exists_and_a_new_one_is_seen(catalog, principal, django_assert_num_queries):
    assert budgets.applicable(principal, None) == []  # warm the cache
    with django_assert_num_queries(0):
        assert budgets.applicable(principal, None) == []
        budgets.check(principal, None)
        budgets.charge(principal, None, 5000)
        assert budgets.reserve(principal, None, 5000) is None
    make("new", project=catalog.project)  # a write bumps the catalog generation
    assert [b.name for b in budgets.applicable(principal, None)] == ["new"]


# --- reserve, settle, charge, check -------------------------------------------------------------


def test_reserve_then_settle_replaces_the_reservation_with_the_real_cost(catalog, principal):
    b = make("p", usd=1000, project=catalog.project)
    hold = budgets.reserve(principal, None, 600)
    assert account(b) == (0, 600) and BudgetHold.objects.count() == 1
    with pytest.raises(BudgetExceeded) as exc:
        budgets.reserve(principal, None, 401)  # 600 + 401 > 1000
    assert exc.value.budget_name == "p" and exc.value.status == 429 and exc.value.code == "budget_exceeded"
    assert exc.value.period_ends_at == budgets.period_bounds("month")[1]
    assert "budget p" in exc.value.message and "$0.000001 per month" in exc.value.message
    assert "project proj-a" in exc.value.message
    budgets.settle(hold, 250)
    assert account(b) == (250, 0) and not BudgetHold.objects.exists()
    budgets.settle(budgets.reserve(principal, None, 750), None)  # released: nothing spent
    assert account(b) == (250, 0)


def test_a_reservation_is_all_or_none_across_budgets(catalog, principal):
    roomy = make("roomy", usd=10_000, team=catalog.team)
    tight = make("tight", usd=100, service_account=catalog.sa)
    with pytest.raises(BudgetExceeded) as exc:
        budgets.reserve(principal, None, 500)
    assert exc.value.budget_name == "tight"
    assert account(roomy) == (0, 0) and account(tight) == (0, 0) and not BudgetHold.objects.exists()
    hold = budgets.reserve(principal, None, 100)
    assert account(roomy) == (0, 100) and account(tight) == (0, 100)
    budgets.settle(hold, 40)
    assert account(roomy) == (40, 0) and account(tight) == (40, 0)


def test_a_zero_or_unknown_worst_case_still_needs_something_left(catalog, principal):
    b = make("p", usd=100, project=catalog.project)
    budgets.settle(budgets.reserve(principal, None, None), None)
    budgets.charge(principal, None, 100)
    assert account(b) == (100, 0)
    with pytest.raises(BudgetExceeded):
        budgets.reserve(principal, None, 0)


def test_live_check_and_charge(catalog, principal):
    b = make("p", usd=1000, policy=catalog.policy)
    budgets.check(principal, None)
    budgets.charge(principal, None, 999)
    budgets.check(principal, None)  # 1 nano-USD left
    budgets.charge(principal, None, 500)  # a live request may overshoot by its own cost
    assert account(b) == (1499, 0)
    with pytest.raises(BudgetExceeded) as exc:
        budgets.check(principal, None)
    assert int(exc.value.headers["Retry-After"]) >= 1 and exc.value.retry_after <= budgets.BATCH_RECHECK_S


def test_reservations_count_against_the_live_check(catalog, principal):
    make("p", usd=1000, project=catalog.project)
    hold = budgets.reserve(principal, None, 1000)
    with pytest.raises(BudgetExceeded):
        budgets.check(principal, None)
    budgets.settle(hold, None)
    budgets.check(principal, None)


def test_charge_event_bills_the_discounted_cost_to_the_events_scopes(catalog, principal):
    p = make("p", usd=10**6, project=catalog.project)
    s = make("s", usd=10**6, service_account=catalog.sa)
    event = {**principal.usage_attribution(), "cost_nano_usd": 1000, "billed_cost_nano_usd": 500}
    budgets.charge_event(event)
    budgets.charge_event({**event, "billed_cost_nano_usd": None})  # no discount: the cost
    budgets.charge_event({**event, "cost_nano_usd": None, "billed_cost_nano_usd": None})  # unpriced: nothing
    assert account(p) == (1500, 0) and account(s) == (1500, 0)


def test_a_raised_budget_counts_at_once(catalog, principal):
    b = make("p", usd=100, project=catalog.project)
    with pytest.raises(BudgetExceeded):
        budgets.reserve(principal, None, 150)
    b.usd_nanos = 200
    b.save()
    budgets.reserve(principal, None, 150)
    assert account(b) == (0, 150)


def test_a_budget_deleted_behind_a_processs_cache_is_skipped_not_an_error(catalog, principal, monkeypatch):
    b = make("gone", usd=10, project=catalog.project)
    kept = make("kept", usd=10**6, team=catalog.team)
    cached = budgets.applicable(principal, None)
    Budget.objects.filter(pk=b.pk).delete()
    # This process has not seen the delete yet (its cached list still has the budget).
    monkeypatch.setattr(budgets, "applicable", lambda *args, **kwargs: cached)
    budgets.check(principal, None)
    budgets.charge(principal, None, 50)
    budgets.settle(budgets.reserve(principal, None, 100), 60)
    assert account(kept) == (110, 0) and not BudgetPeriod.objects.filter(budget_id=b.pk).exists()


# --- spent before the budget, and periods rolling over ------------------------------------------


def test_spend_before_the_budget_was_made_counts_in_its_first_period(catalog, principal, frozen):
    now = datetime(2026, 6, 15, 12, 0, tzinfo=UTC)
    attribution = principal.usage_attribution()
    record_event(
        request_id="old", source="live", ts=datetime(2026, 5, 31, 23, 0, tzinfo=UTC), cost_nano_usd=7000, **attribution
    )
    record_event(request_id="a", source="live", ts=now - timedelta(hours=1), cost_nano_usd=300, **attribution)
    record_event(
        request_id="b",
        source="batch",
        ts=now - timedelta(hours=2),
        cost_nano_usd=400,
        billed_cost_nano_usd=200,
        **attribution,
    )
    record_event(request_id="other", source="live", ts=now - timedelta(hours=1), cost_nano_usd=900, project_id=-1)
    frozen(now)
    b = Budget.objects.create(name="p", usd_nanos=1000, period="month", project=catalog.project, created_at=now)
    [standing] = budgets.standings([b])
    assert (standing.spent_nanos, standing.left_nanos) == (500, 500)  # 300 + the billed 200, this month only
    budgets.charge(principal, None, 100)
    assert account(b) == (600, 0)


def test_a_day_budget_starts_afresh_at_midnight_utc(catalog, principal, frozen):
    frozen(datetime(2026, 6, 15, 10, 0, tzinfo=UTC))
    b = Budget.objects.create(name="d", usd_nanos=1000, period="day", team=catalog.team, created_at=timezone.now())
    budgets.charge(principal, None, 1000)
    with pytest.raises(BudgetExceeded) as exc:
        budgets.check(principal, None)
    assert exc.value.period_ends_at == datetime(2026, 6, 16, tzinfo=UTC)
    frozen(datetime(2026, 6, 15, 23, 59, 59, 999999, tzinfo=UTC))
    with pytest.raises(BudgetExceeded):
        budgets.reserve(principal, None, 1)
    frozen(datetime(2026, 6, 16, 0, 0, tzinfo=UTC))
    budgets.check(principal, None)
    hold = budgets.reserve(principal, None, 1000)
    budgets.settle(hold, 10)
    assert BudgetPeriod.objects.filter(budget=b).count() == 2
    assert BudgetPeriod.objects.get(budget=b, period_start=datetime(2026, 6, 16, tzinfo=UTC)).spent_nanos == 10


def test_a_record_settled_after_the_rollover_is_charged_to_the_new_period(catalog, principal, frozen):
    frozen(datetime(2026, 6, 30, 23, 59, tzinfo=UTC))
    b = Budget.objects.create(
        name="m", usd_nanos=1000, period="month", policy=catalog.policy, created_at=timezone.now()
    )
    hold = budgets.reserve(principal, None, 800)
    frozen(datetime(2026, 7, 1, 0, 1, tzinfo=UTC))
    budgets.settle(hold, 300)
    june, july = BudgetPeriod.objects.filter(budget=b).order_by("period_start")
    assert (june.spent_nanos, june.reserved_nanos) == (0, 0)
    assert (july.spent_nanos, july.reserved_nanos) == (300, 0)


# --- holds that are never settled ---------------------------------------------------------------


def test_an_expired_hold_is_reclaimed_and_stops_blocking(catalog, principal, frozen):
    b = make("p", usd=1000, project=catalog.project)
    lost = budgets.reserve(principal, None, 1000)  # its process dies: never settled
    with pytest.raises(BudgetExceeded):
        budgets.reserve(principal, None, 1)
    assert budgets.reclaim_expired() == 0  # not expired yet: a live hold is never taken back
    frozen(timezone.now() + budgets.hold_ttl() + timedelta(seconds=1))
    hold = budgets.reserve(principal, None, 900)  # finds no room, reclaims the expired hold, fits
    assert account(b) == (0, 900)
    budgets.settle(lost, 50)  # the late settle of the reclaimed hold releases nothing twice
    budgets.settle(hold, 100)
    assert account(b) == (150, 0)


def test_reclaim_expired_gives_back_every_dead_hold(catalog, principal):
    b = make("p", usd=10_000, project=catalog.project)
    for _ in range(3):
        budgets.reserve(principal, None, 1000)
    BudgetHold.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    assert budgets.reclaim_expired() == 3
    assert account(b) == (0, 0) and not BudgetHold.objects.exists()


def test_the_sweeper_gives_back_dead_holds(catalog, principal):
    from batches import sweeper

    b = make("p", usd=10_000, project=catalog.project)
    budgets.reserve(principal, None, 1000)
    BudgetHold.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    sweeper.sweep()
    assert account(b) == (0, 0) and not BudgetHold.objects.exists()


# --- the worst case -----------------------------------------------------------------------------


def test_worst_case_is_price_times_estimate_less_the_discount():
    price = Pricing(name="x", input_nanos_per_mtok=2 * USD, output_nanos_per_mtok=8 * USD)
    tokens = Tokens(input=1000, output=500)
    assert budgets.worst_case_nanos(price, tokens) == 2000 * 1000 + 8000 * 500
    assert budgets.worst_case_nanos(price, tokens, batch_discount_percent=50) == (2000 * 1000 + 8000 * 500) // 2
    assert budgets.worst_case_nanos(None, tokens) is None
    assert budgets.worst_case_nanos(Pricing(name="y", input_nanos_per_mtok=USD), tokens) is None  # output unpriced


# --- concurrency --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_concurrent_reservations_never_overshoot(fake):
    """Eight threads, each with its own database connection, reserve and settle against one budget until
    it refuses them: the budget ends exactly full, never past it, and no reservation is left behind."""
    cat = factories.make_catalog(fake.url)
    principal = auth.principal_for_key(cat.key)
    worst, limit = 700, 70_000 + 300  # room for exactly 100 worst cases
    b = make("shared", usd=limit, project=cat.project)
    budgets.settle(budgets.reserve(principal, None, 0), None)  # the period row exists before the race
    threads, barrier = 8, threading.Barrier(8)
    granted, refused, peaks, errors = [], [], [], []

    def spender():
        try:
            barrier.wait()
            while True:
                try:
                    hold = budgets.reserve(principal, None, worst)
                except BudgetExceeded:
                    refused.append(1)
                    return
                spent, reserved = (
                    BudgetPeriod.objects.filter(budget=b).values_list("spent_nanos", "reserved_nanos").get()
                )
                peaks.append(spent + reserved)
                granted.append(1)
                budgets.settle(hold, worst)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            connections.close_all()

    pool = [threading.Thread(target=spender) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert not errors, errors
    assert len(refused) == threads
    assert len(granted) == limit // worst == 100
    assert max(peaks) <= limit
    assert account(b) == (100 * worst, 0) and not BudgetHold.objects.exists()


# --- relay apply ----------------------------------------------------------------------------------


def _doc(*entries):
    return {"budgets": list(entries)}


def test_apply_creates_updates_and_reports_budgets(catalog):
    doc = _doc(
        {"name": "proj-month", "project": "proj-a", "usd": "100.00", "period": "month"},
        {"name": "team-day", "team": "team-a", "usd": 2.5, "period": "day"},
        {"name": "sa", "service_account": "proj-a/sa-a", "usd": "1"},
        {"name": "pol", "policy": "pol-a", "usd": "0.000000001", "period": "day", "enabled": False},
    )
    report = apply_config(doc)
    assert report.created == ["budget proj-month", "budget team-day", "budget sa", "budget pol"]
    got = {b.name: (b.scope[0], b.usd_nanos, b.period, b.enabled) for b in Budget.objects.all()}
    assert got == {
        "proj-month": ("project", 100 * USD, "month", True),
        "team-day": ("team", 2_500_000_000, "day", True),
        "sa": ("service_account", USD, "month", True),
        "pol": ("policy", 1, "day", False),
    }
    assert apply_config(doc).unchanged == [f"budget {e['name']}" for e in doc["budgets"]]
    doc["budgets"][0].update(usd="150", project=None, team="team-a")
    report = apply_config(doc)
    assert report.updated == ["budget proj-month"]
    assert Budget.objects.get(name="proj-month").scope == ("team", catalog.team.id)
    # A service account's bare name is enough while one project has it.
    apply_config(_doc({"name": "sa", "service_account": "sa-a", "usd": "1"}))


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"name": "x", "project": "proj-a", "team": "team-a", "usd": "1"}, "give exactly one of project, team"),
        ({"name": "x", "usd": "1"}, "give exactly one of project, team, service_account, policy"),
        ({"name": "x", "project": "nope", "usd": "1"}, "unknown project 'nope'"),
        ({"name": "x", "policy": "nope", "usd": "1"}, "unknown policy 'nope'"),
        ({"name": "x", "service_account": "proj-a/nope", "usd": "1"}, "unknown service account 'proj-a/nope'"),
        ({"name": "x", "team": "team-a", "usd": "lots"}, "usd must be an amount in USD"),
        ({"name": "x", "team": "team-a", "usd": "-5"}, "usd must not be negative"),
        ({"name": "x", "team": "team-a"}, "missing required field 'usd'"),
        ({"name": "x", "team": "team-a", "usd": "1", "period": "week"}, "period 'week' is not one of day, month"),
        ({"name": "x", "team": "team-a", "usd": "1", "limit": 3}, "unknown field(s): limit"),
        ({"team": "team-a", "usd": "1"}, "missing required field 'name'"),
        ({"name": "Not A Slug!", "team": "team-a", "usd": "1"}, "name:"),
    ],
)
def test_apply_refuses_a_bad_budget_and_changes_nothing(catalog, entry, message):
    good = {"name": "good", "team": "team-a", "usd": "1"}
    with pytest.raises(ConfigError) as err:
        apply_config(_doc(good, entry))
    assert str(err.value).startswith("budgets[1]: ") and message in str(err.value)
    assert not Budget.objects.exists()


def test_apply_asks_for_project_slash_name_when_a_service_account_name_is_ambiguous(catalog):
    ServiceAccount.objects.create(project=Project.objects.create(name="proj-b", team=catalog.team), name="sa-a")
    with pytest.raises(ConfigError, match="in several projects: write it as project/name"):
        apply_config(_doc({"name": "x", "service_account": "sa-a", "usd": "1"}))
    apply_config(_doc({"name": "x", "service_account": "proj-b/sa-a", "usd": "1"}))
    assert Budget.objects.get(name="x").service_account.project.name == "proj-b"


# --- metrics ----------------------------------------------------------------------------------------


def test_metric_rows(catalog, principal):
    make("p", usd=2 * USD, project=catalog.project)
    make("off", usd=USD, team=catalog.team).__class__.objects.filter(name="off").update(enabled=False)
    hold = budgets.reserve(principal, None, USD // 4)
    budgets.charge(principal, None, USD // 2)
    rows = budgets.metric_rows()
    assert rows == [({"budget": "p", "scope": "project", "scope_name": "proj-a", "period": "month"}, 0.5, 0.25, 2.0)]
    budgets.settle(hold, None)
