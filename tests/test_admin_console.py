"""The admin's landing page, the operator's console: now / money / trouble from cheap reads, every figure a link
to the list it was counted from, the charts drawn on the server with their text beside them, and a query count
that does not grow with the rows shown."""

import io
import json
import re
import uuid
from datetime import UTC, timedelta
from html import unescape

import pytest
from django.db import connection
from django.db.models import Sum
from django.db.models.functions import Coalesce, TruncDate
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from batches.models import Batch
from batches.provider.models import ProviderJob
from batches.webhooks.models import WebhookEndpoint
from core.crypto import sha256_hex
from core.models import HostBinding
from policies import breaker
from relay import console, metrics_rollup
from usage import budgets as spend_budgets
from usage.models import Budget, BudgetPeriod, UsageEvent

pytestmark = pytest.mark.django_db

USD = 1_000_000_000
FREE = {"cost_nano_usd": None}  # a failed call is not priced
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}


def _native(client, key, n=3) -> Batch:
    resp = client.post(
        "/v1/batches",
        data=json.dumps({"shape": "openai", "requests": [CHAT] * n}),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    assert resp.status_code == 202, resp.content
    return Batch.objects.get(pk=resp.json()["id"])


def _openai(client, key) -> Batch:
    lines = b"".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}).encode()
        + b"\n"
        for i in range(3)
    )
    f = io.BytesIO(lines)
    f.name = "in.jsonl"
    up = client.post("/v1/files", data={"file": f, "purpose": "batch"}, HTTP_AUTHORIZATION=f"Bearer {key}")
    assert up.status_code == 200, up.content
    resp = client.post(
        "/v1/batches",
        data=json.dumps(
            {"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        ),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    assert resp.status_code == 200, resp.content
    return Batch.objects.get(pk=uuid.UUID(hex=resp.json()["id"].removeprefix("batch_")))


def _anthropic(client, key) -> Batch:
    body = {
        "requests": [
            {
                "custom_id": f"m{i}",
                "params": {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "x"}]},
            }
            for i in range(3)
        ]
    }
    resp = client.post(
        "/v1/messages/batches", data=json.dumps(body), content_type="application/json", HTTP_X_API_KEY=key
    )
    assert resp.status_code == 200, resp.content
    return Batch.objects.get(pk=uuid.UUID(hex=resp.json()["id"].removeprefix("msgbatch_")))


def _event(catalog, **values) -> UsageEvent:
    base = {
        "request_id": uuid.uuid4().hex,
        "source": "live",
        "status": 200,
        "model": "gpt-4o",
        "host": "openai",
        "project": catalog.project.name,
        "project_id": catalog.project.pk,
        "cost_nano_usd": USD // 10,
    }
    return UsageEvent(**{**base, **values})


def seed_console(catalog) -> dict:
    """What an operator's relay holds after a few hours: batches in flight on every surface (items in several
    states), a provider job, spend over several days for two projects and a provider-run record, a budget
    at 90%, an open breaker, a failing webhook endpoint, failures in the last hour. Used by the browser test."""
    client = Client()
    now = timezone.now()
    native, openai, anthropic = (
        _native(client, catalog.key),
        _openai(client, catalog.key),
        _anthropic(client, catalog.key),
    )
    items = native.items.order_by("idx")
    items.filter(idx=0).update(state="completed", finished_at=now)
    items.filter(idx=1).update(state="discarded", finished_at=now, error="upstream answered 500")
    anthropic.items.filter(idx=0).update(state="completed", finished_at=now)
    binding = HostBinding.objects.get(model__name="claude-sonnet")
    job = ProviderJob.objects.create(
        id=uuid.uuid4(),
        batch=anthropic,
        binding_id=binding.pk,
        host_id=binding.host_id,
        kind="anthropic",
        endpoint="/v1/messages",
        status="running",
        upstream_id="msgbatch_upstream_1",
        records=2,
        completed=1,
    )
    events = [
        _event(catalog, ts=now - timedelta(days=d), cost_nano_usd=(d + 1) * USD // 10) for d in range(0, 12, 2)
    ] + [
        _event(catalog, ts=now - timedelta(days=1), project="proj-b", model="claude-sonnet", cost_nano_usd=USD // 4),
        _event(
            catalog,
            source="batch",
            executed_by="provider",
            input_tokens=1_000_000,
            output_tokens=100_000,
            cost_nano_usd=1_750_000_000,  # the pricing's batch rates: half of 2.5 + 1.0 USD
            billed_cost_nano_usd=1_750_000_000,
            batch_id=str(anthropic.pk),
        ),
        _event(catalog, source="batch", status=500, error_kind="upstream_error", batch_id=str(native.pk), **FREE),
        _event(
            catalog, source="batch", status=0, error_kind="budget_exceeded", host="", batch_id=str(native.pk), **FREE
        ),
        _event(catalog, status=429, error_kind="rate_limited", **FREE),
    ]
    UsageEvent.objects.bulk_create(events)
    metrics_rollup.catch_up()
    budget = Budget.objects.create(name="proj-a-monthly", project=catalog.project, usd_nanos=10 * USD, period="month")
    Budget.objects.create(
        name="team-a-daily", team=catalog.team, usd_nanos=100 * USD, period="day", created_at=now - timedelta(days=2)
    )
    start, _ = spend_budgets.period_bounds("month", now)
    BudgetPeriod.objects.create(budget=budget, period_start=start, spent_nanos=8 * USD, reserved_nanos=USD)
    key = catalog.keys[1]
    breaker.record_failure(sha256_hex(key.get_value())[:12], breaker.Failure.AUTH)
    endpoint = WebhookEndpoint.objects.create(
        id=uuid.uuid4(),
        owner_hash=native.owner_hash,
        name="billing-hook",
        url="https://hooks.example.com/relay",
        event_types=["batch.completed"],
        secret_sealed="sealed",
        secret_hint="whsec_…abcd",
        failing_since=now - timedelta(hours=3),
        last_failure_at=now,
    )
    return {"native": native, "openai": openai, "anthropic": anthropic, "job": job, "budget": budget,
            "endpoint": endpoint, "key": key}  # fmt: skip


@pytest.fixture
def seeded(catalog):
    return seed_console(catalog)


def _console_links(html: str) -> list[str]:
    start = html.index('id="relay-console"')
    end = html.index("</section>\n</div>", start)
    return [unescape(h) for h in re.findall(r'href="([^"]+)"', html[start:end])]


def test_the_landing_page_answers_now_money_and_trouble(admin_client, seeded):
    html = admin_client.get("/admin/").content.decode()
    for panel in ("panel-now", "panel-money", "panel-trouble"):
        assert f'id="{panel}"' in html
    # now: each surface's batches in flight (product names), their progress, the provider job, the breaker,
    # the failing endpoint
    assert "1</strong> OpenAI batch in flight" in html and "1</strong> Anthropic batch in flight" in html
    assert "1</strong> native batch in flight" in html
    assert seeded["native"].public_id[:15] in html and "1 completed, 1 discarded, 1 available" in html
    assert "1 done at the provider" in html
    assert f"openai / {seeded['key'].name}" in html and "open (upstream_auth_failed)" in html
    assert "billing-hook" in html and "failing since" in html
    # money: today's and this month's spend, the chart (SVG with a title and a description) and its table,
    # the provider's saving (live 2.5 + 1.0 USD less 1.75 paid), the budget at 90% first
    assert "<svg" in html and 'role="img"' in html and "<desc" in html and 'id="spend-table"' in html
    assert "$1.75</strong> saved by provider batch mode" in html
    budgets_html = html[html.index('id="budgets"') :]
    assert budgets_html.index("proj-a-monthly") < budgets_html.index("team-a-daily")
    assert "$8.00 + $1.00 of $10.00" in budgets_html and "90%" in budgets_html
    # trouble: batch records failed by reason, error codes per host
    trouble = html[html.index('id="panel-trouble"') :]
    assert "upstream_error" in trouble and "budget_exceeded" in trouble and "rate_limited × 1" in trouble


def test_spend_is_per_day_by_project_or_model(seeded):
    now = timezone.now()
    by_project = console.spend("project", now)
    assert [name for name, _ in by_project.series] == ["proj-a", "proj-b"]
    proj_a = dict(by_project.series)["proj-a"]
    assert proj_a[-1] == USD // 10 + 1_750_000_000  # today: the live call and the provider-run record
    assert by_project.today_nanos == proj_a[-1]  # the failures cost nothing
    assert dict(by_project.series)["proj-b"][-2] == USD // 4
    by_model = console.spend("model", now)
    assert {name for name, _ in by_model.series} == {"gpt-4o", "claude-sonnet"}
    assert sum(by_model.totals) == sum(by_project.totals)
    month_start = now.date().replace(day=1)
    in_month = sum(v for d, v in zip(by_project.days, by_project.totals, strict=True) if d >= month_start)
    assert by_project.month_nanos >= in_month


def test_every_figure_links_to_a_list_that_opens(admin_client, seeded):
    """A link whose filter the admin refuses redirects to `?e=1` (or answers 400): every one must open."""
    links = _console_links(admin_client.get("/admin/").content.decode())
    assert len(links) > 20
    for link in links:
        if link.startswith("?"):
            link = "/admin/" + link
        resp = admin_client.get(link)
        assert resp.status_code == 200, link
        assert "e=1" not in resp.request.get("QUERY_STRING", ""), link


def test_the_filtered_lists_hold_what_the_figure_counted(admin_client, seeded):
    html = admin_client.get("/admin/").content.decode()
    links = _console_links(html)
    openai_list = next(link for link in links if "surface__exact=openai" in link)
    cl = admin_client.get(openai_list).context["cl"]
    assert [b.pk for b in cl.result_list] == [seeded["openai"].pk]
    jobs = next(link for link in links if "status__exact=running" in link and "providerjob" in link)
    assert [j.pk for j in admin_client.get(jobs).context["cl"].result_list] == [seeded["job"].pk]


def test_the_landing_page_is_for_staff_only(client, seeded):
    resp = client.get("/admin/")
    assert resp.status_code == 302 and "/admin/login/" in resp["Location"]


# The landing page's reads, pinned: in-flight batches 4 (per surface, newest, their items per state, their
# provider jobs' progress), running items 1, provider jobs 1, host keys 1 (breakers: Redis), failing endpoints
# 1, spend 1 (the spend rollup), savings 2 (rollup, bindings), budgets 2, trouble 1, expiries 2. A new panel, or
# a read per row shown, changes it.
LANDING_QUERIES = 16


def test_the_landing_pages_reads_do_not_grow_with_rows(seeded, catalog):
    with CaptureQueriesContext(connection) as first:
        shown = console.landing()
    assert shown["errors"] == {}
    # Read now: a request (the batches below) resets the connection's query log the context slices.
    first_sql = [q["sql"] for q in first.captured_queries]
    # More of everything the page lists: batches in flight, provider jobs, budgets, endpoints, spend.
    client = Client()
    for _ in range(4):
        _native(client, catalog.key)
    for i in range(3):
        # Made before this period: a budget made in it and not charged yet has its baseline read once, in
        # usage.budgets.standings, until its first charge.
        Budget.objects.create(
            name=f"extra-{i}",
            project=catalog.project,
            usd_nanos=USD,
            period="day",
            created_at=timezone.now() - timedelta(days=2),
        )
        WebhookEndpoint.objects.create(
            id=uuid.uuid4(),
            owner_hash="o",
            name=f"down-{i}",
            url="https://x.example.com",
            secret_sealed="s",
            secret_hint="h",
            failing_since=timezone.now(),
        )
    UsageEvent.objects.bulk_create(_event(catalog, project=f"p{i}", model="m") for i in range(20))
    console.landing()  # the rollup counts the new events (its own writes are not the page's reads)
    with CaptureQueriesContext(connection) as second:
        console.landing()
    second_sql = [q["sql"] for q in second.captured_queries]
    assert len(first_sql) == LANDING_QUERIES, "\n".join(q[:70] for q in first_sql)
    assert len(second_sql) == LANDING_QUERIES, "\n".join(q[:70] for q in second_sql)


def test_the_spend_chart_equals_a_direct_sum_of_the_usage_events(admin_client, catalog):
    """Spend over several days, projects and models (billed after a discount, or at cost; unpriced failures; days
    before the chart's window) read from the spend rollup equals a SUM over the usage events themselves, per day
    and series, today and this month, and the page's table shows those figures. The chart's read scans no usage
    events."""
    now = timezone.now()
    events = []
    for d in (0, 0, 1, 2, 5, 13, 28, 29, 30, 40):
        for p, project in enumerate(("proj-a", "proj-b", "proj-c")):
            model = "claude-sonnet" if (d + p) % 2 else "gpt-4o"
            cost = (d + 1) * (p + 2) * 10_000_000
            billed = cost // 2 if d % 3 == 0 else None
            at = now - timedelta(days=d, minutes=p)
            events.append(_event(catalog, ts=at, project=project, model=model, cost_nano_usd=cost))
            events.append(
                _event(catalog, ts=at, source="batch", project=project, billed_cost_nano_usd=billed, cost_nano_usd=cost)
            )
        events.append(_event(catalog, ts=now - timedelta(days=d), project="proj-d", status=500, **FREE))
    UsageEvent.objects.bulk_create(events)
    metrics_rollup.catch_up()

    def direct(by):
        rows = (
            UsageEvent.objects.annotate(day=TruncDate("ts", tzinfo=UTC))
            .values_list("day", by)
            .annotate(nanos=Sum(Coalesce("billed_cost_nano_usd", "cost_nano_usd")))
            .order_by()
        )
        return {(day, name): nanos for day, name, nanos in rows if nanos}

    for by in ("project", "model"):
        with CaptureQueriesContext(connection) as reads:
            shown = console.spend(by, now)
        assert not any("usage_usageevent" in q["sql"] for q in reads.captured_queries)
        expected = direct(by)
        charted = {
            (day, name): v for name, values in shown.series for day, v in zip(shown.days, values, strict=True) if v
        }
        assert charted == {(day, name): v for (day, name), v in expected.items() if day >= shown.days[0]}
        assert shown.today_nanos == sum(v for (day, _), v in expected.items() if day == shown.days[-1])
        assert shown.month_nanos == sum(v for (day, _), v in expected.items() if day >= shown.month_start)
    assert {name for name, _ in console.spend("project", now).series} == {"proj-a", "proj-b", "proj-c"}
    # The page's text equivalent: one row per day with spend, its total the direct sum of that day.
    html = admin_client.get("/admin/").content.decode()
    table = html[html.index('id="spend-table"') : html.index("</table>", html.index('id="spend-table"'))]
    per_day: dict = {}
    for (day, _), v in direct("project").items():
        per_day[day] = per_day.get(day, 0) + v
    shown_rows = re.findall(r"(\d{4}-\d{2}-\d{2})</a></th>(?:<td>[^<]*</td>)*?<td>([^<]*)</td></tr>", table)
    window = console.spend("project", now).days
    assert {d: total for d, total in shown_rows} == {
        day.isoformat(): console.usd(v) for day, v in per_day.items() if day >= window[0]
    }


def test_list_filters_name_the_products(admin_client):
    """The batches' inbound shape and the provider jobs' batch API filters read OpenAI / Anthropic, as the surface
    filter does, rather than Django's title-cased stored values; and they still filter."""
    batches = admin_client.get("/admin/batches/batch/").content.decode()
    for label in ("OpenAI Chat Completions", "OpenAI Responses", "Anthropic"):
        assert f">{label}</a>" in batches
    jobs = admin_client.get("/admin/batches/providerjob/").content.decode()
    for label in ("OpenAI", "Anthropic", "Azure OpenAI Global Batch", "Amazon Bedrock batch inference"):
        assert f">{label}</a>" in jobs  # every registered batch API, by its product's name
    assert "Openai" not in batches + jobs
    for link in ("/admin/batches/batch/?inbound_shape=openai_responses", "/admin/batches/providerjob/?kind=anthropic"):
        resp = admin_client.get(link)
        assert resp.status_code == 200 and "e=1" not in resp.request.get("QUERY_STRING", "")


def test_a_failed_source_is_reported_in_its_panel(admin_client, seeded, monkeypatch):
    def down():
        raise ConnectionError("broker down")

    monkeypatch.setattr(console.metrics, "queue_depths", down)
    html = admin_client.get("/admin/").content.decode()
    assert "Broker unreachable: ConnectionError: broker down" in html and 'id="panel-money"' in html
