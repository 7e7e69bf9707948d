"""Spend budgets seen from outside: `GET /api/usage/budgets` (the usage API's auth and scoping), live requests
refused with 429 `budget_exceeded` in each route's envelope, and live costs charged after the call
(answered whole and streamed), against the fake upstream."""

import json

import pytest
from django.conf import settings
from django.db import connection

from core import auth
from core.models import Project, ServiceAccount, Team
from core.services import create_relay_key
from gateway import streaming
from tests.workers import wait_for
from usage import budgets
from usage.models import Budget, BudgetPeriod, UsageEvent

pytestmark = pytest.mark.django_db

ADMIN = {"Authorization": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}
USD = 1_000_000_000
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "how much is this?"}]}
MESSAGES = {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def listed(client, headers) -> dict:
    resp = client.get("/api/usage/budgets", headers=headers)
    assert resp.status_code == 200, resp.content
    return {b["name"]: b for b in resp.json()["budgets"]}


def spent(name: str) -> int:
    start, _ = budgets.period_bounds(Budget.objects.get(name=name).period)
    row = BudgetPeriod.objects.filter(budget__name=name, period_start=start).first()
    return row.spent_nanos if row else 0


# --- GET /api/usage/budgets ---------------------------------------------------------------------


def test_the_operator_sees_every_budget_and_a_caller_only_those_governing_it(client, catalog):
    other = Project.objects.create(name="proj-b", team=Team.objects.create(name="team-b"))
    other_sa = ServiceAccount.objects.create(project=other, name="sa-b")
    _, other_key = create_relay_key(service_account=other_sa)
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    Budget.objects.create(name="team", team=catalog.team, usd_nanos=5 * USD, period="day")
    Budget.objects.create(name="sa", service_account=catalog.sa, usd_nanos=USD, period="day", enabled=False)
    Budget.objects.create(name="pol", policy=catalog.policy, usd_nanos=USD // 2, period="month")
    Budget.objects.create(name="theirs", project=other, usd_nanos=USD, period="month")

    assert sorted(listed(client, ADMIN)) == ["pol", "proj", "sa", "team", "theirs"]
    mine = listed(client, bearer(catalog.key))
    assert sorted(mine) == ["pol", "proj", "sa", "team"]
    assert sorted(listed(client, bearer(other_key))) == ["theirs"]
    assert mine["sa"]["scope"] == {"kind": "service_account", "name": "proj-a/sa-a"} and not mine["sa"]["enabled"]
    assert mine["team"]["scope"] == {"kind": "team", "name": "team-a"}
    assert mine["pol"]["scope"] == {"kind": "policy", "name": "pol-a"}

    resp = client.get("/api/usage/budgets")
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "unauthenticated"


def test_the_listing_shows_the_current_periods_account(client, catalog):
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    principal = auth.principal_for_key(catalog.key)
    assert listed(client, ADMIN)["proj"]["spent_usd"] == "0.00"  # a period nothing used yet
    budgets.charge(principal, None, 12_500_000_000)
    budgets.reserve(principal, None, 1_000_000_001)
    row = listed(client, ADMIN)["proj"]
    _, end = budgets.period_bounds("month")
    assert row == {
        "name": "proj",
        "scope": {"kind": "project", "name": "proj-a"},
        "period": "month",
        "enabled": True,
        "usd": "100.00",
        "spent_usd": "12.50",
        "reserved_usd": "1.000000001",
        "left_usd": "86.499999999",
        "period_start": budgets.period_bounds("month")[0].strftime("%Y-%m-%dT%H:%M:%SZ"),
        "period_ends_at": end.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    budgets.charge(principal, None, 200 * USD)
    assert listed(client, ADMIN)["proj"]["left_usd"] == "0.00"


def test_metrics_show_each_budgets_current_period(client, catalog):
    from prometheus_client.parser import text_string_to_metric_families

    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=100 * USD, period="month")
    principal = auth.principal_for_key(catalog.key)
    budgets.charge(principal, None, 12_500_000_000)
    budgets.reserve(principal, None, USD)
    text = client.get("/metrics", headers=ADMIN).content.decode()
    samples = {
        s.name: (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("relay_budget_")
    }
    labels = {"budget": "proj", "scope": "project", "scope_name": "proj-a", "period": "month"}
    assert samples["relay_budget_spent_usd"] == (labels, 12.5)
    assert samples["relay_budget_reserved_usd"] == (labels, 1.0)
    assert samples["relay_budget_limit_usd"] == (labels, 100.0)


# --- live requests over budget ------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/openai/v1/chat/completions"])
def test_a_spent_budget_refuses_a_live_openai_request_in_openais_envelope(client, catalog, fake, path):
    Budget.objects.create(name="team-daily", team=catalog.team, usd_nanos=0, period="day")
    resp = client.post(path, data=CHAT, content_type="application/json", headers=bearer(catalog.key))
    assert resp.status_code == 429, resp.content
    error = resp.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "budget_exceeded"
    assert "budget team-daily" in error["message"] and "$0.00 per day" in error["message"]
    assert int(resp["Retry-After"]) >= 1 and resp["X-WR-Origin"] == "relay"
    assert fake.received == []  # refused before any provider was called
    event = UsageEvent.objects.get()  # the refusal is in the usage events, as the relay's other refusals are
    assert (event.status, event.error_kind, event.model, event.project) == (0, "budget_exceeded", "gpt-4o", "proj-a")


@pytest.mark.parametrize("path", ["/v1/messages", "/anthropic/v1/messages"])
def test_a_spent_budget_refuses_a_live_anthropic_request_in_anthropics_envelope(client, catalog, fake, path):
    Budget.objects.create(name="sa-monthly", service_account=catalog.sa, usd_nanos=0, period="month")
    resp = client.post(path, data=MESSAGES, content_type="application/json", headers=bearer(catalog.key))
    assert resp.status_code == 429, resp.content
    body = resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "budget_exceeded"
    assert "budget sa-monthly" in body["error"]["message"]
    assert fake.received == []


def test_a_spent_budget_does_not_refuse_counting_tokens(client, catalog, fake):
    Budget.objects.create(name="sa-monthly", service_account=catalog.sa, usd_nanos=0, period="month")
    resp = client.post(
        "/v1/messages/count_tokens", data=MESSAGES, content_type="application/json", headers=bearer(catalog.key)
    )
    assert resp.status_code == 200, resp.content


def test_a_live_request_is_charged_its_cost_and_the_next_one_refused(client, catalog, fake):
    post = lambda: client.post(  # noqa: E731
        "/v1/chat/completions", data=CHAT, content_type="application/json", headers=bearer(catalog.key)
    )
    resp = post()
    assert resp.status_code == 200, resp.content
    cost = UsageEvent.objects.get().cost_nano_usd
    assert cost and cost > 0
    # A budget with room for three such calls, made after the first: it counts what this period spent before.
    Budget.objects.create(name="pol", policy=catalog.policy, usd_nanos=3 * cost, period="month")
    assert post().status_code == 200
    assert spent("pol") == 2 * cost
    assert post().status_code == 200
    assert spent("pol") == 3 * cost
    fourth = post()
    assert fourth.status_code == 429 and fourth.json()["error"]["code"] == "budget_exceeded"
    assert len(fake.received) == 3
    assert UsageEvent.objects.filter(status=200).count() == 3
    assert UsageEvent.objects.filter(status=0, error_kind="budget_exceeded").count() == 1


def test_an_unpriced_live_request_is_not_charged(client, catalog, fake):
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=USD, period="day")
    resp = client.post("/v1/messages", data=MESSAGES, content_type="application/json", headers=bearer(catalog.key))
    assert resp.status_code == 200, resp.content
    assert UsageEvent.objects.get().cost_nano_usd is None and spent("proj") == 0


@pytest.mark.django_db(transaction=True)
def test_a_streamed_live_request_is_charged_when_its_stream_ends(client, catalog, fake, monkeypatch):
    # The writer thread closes its connection soon after its last event, not 5 s later: the test database
    # can then be dropped at the end of the session.
    monkeypatch.setattr(streaming, "WRITER_IDLE_S", 0.05)
    started = db_now()
    Budget.objects.create(name="proj", project=catalog.project, usd_nanos=USD, period="day")
    resp = client.post(
        "/v1/chat/completions",
        data=json.dumps(dict(CHAT, stream=True)),
        content_type="application/json",
        headers=bearer(catalog.key),
    )
    assert resp.status_code == 200
    assert b"[DONE]" in b"".join(resp.streaming_content)
    resp.close()
    # The stream's event and charge are written by the process's writer thread (gateway.streaming).
    event = wait_for(lambda: UsageEvent.objects.first(), 10, interval=0.02, what="the stream's usage event")
    assert event.cost_nano_usd and event.cost_nano_usd > 0
    wait_for(lambda: spent("proj") == event.cost_nano_usd, 10, interval=0.02, what="the stream's charge")
    # Only the sessions this test opened: other modules on this xdist worker may keep theirs (a live server).
    wait_for(lambda: sessions_since(started) == 0, 10, interval=0.02, what="the writer thread to close its connection")


def db_now():
    with connection.cursor() as cursor:
        cursor.execute("SELECT now()")
        return cursor.fetchone()[0]


def sessions_since(started) -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            " AND backend_start >= %s",
            [started],
        )
        return cursor.fetchone()[0]


# --- the admin --------------------------------------------------------------------------------------


@pytest.fixture
def staff_client(client, django_user_model):
    user = django_user_model.objects.create_superuser("ops", "ops@example.com", "pw-ops")
    client.force_login(user)
    return client


def test_the_admin_edits_budgets_in_usd_and_shows_the_current_period(staff_client, catalog):
    form = {"name": "ops-day", "usd": "2.50", "period": "day", "enabled": "on"}
    resp = staff_client.post(
        "/admin/usage/budget/add/", {**form, "team": catalog.team.id, "project": catalog.project.id}
    )
    assert resp.status_code == 200 and not Budget.objects.exists()  # two scopes: the form says so, nothing saved
    assert "A budget has exactly one scope" in resp.content.decode()
    resp = staff_client.post("/admin/usage/budget/add/", {**form, "usd": "cheap", "team": catalog.team.id})
    assert resp.status_code == 200 and "usd must be an amount in USD" in resp.content.decode()
    resp = staff_client.post("/admin/usage/budget/add/", {**form, "team": catalog.team.id})
    assert resp.status_code == 302, resp.content
    budget = Budget.objects.get(name="ops-day")
    assert (budget.usd_nanos, budget.scope) == (2_500_000_000, ("team", catalog.team.id))
    budgets.charge(auth.principal_for_key(catalog.key), None, USD)
    page = staff_client.get("/admin/usage/budget/").content.decode()
    assert "team team-a" in page and "2.50" in page and "1.00" in page and "1.50" in page
    change = staff_client.get(f"/admin/usage/budget/{budget.pk}/change/").content.decode()
    assert 'value="2.50"' in change
