"""Usage events: written once, and the usage API (filters, keyset pages, summaries, who sees what)."""

import base64
import threading
from datetime import UTC, datetime, timedelta

import pytest
from django.conf import settings
from django.db import connections, transaction
from django.urls import reverse
from django.utils import timezone

from core import auth
from relay.reports.selectors import DIMENSIONS
from tests import factories
from tests.workers import wait_for
from usage.models import UsageEvent
from usage.services import record_event
from usage.tokens import Tokens

pytestmark = pytest.mark.django_db

ADMIN = {"Authorization": f"Bearer {settings.RELAY_ADMIN_TOKEN}"}


def ev(request_id: str, *, ago=timedelta(minutes=1), **fields) -> UsageEvent:
    fields.setdefault("source", "live")
    fields.setdefault("ts", timezone.now() - ago)
    return record_event(request_id=request_id, **fields)


def get(client, endpoint: str, params=None, headers=ADMIN):
    return client.get(f"/api/usage/{endpoint}", params or {}, headers=headers)


def ids(resp) -> list[str]:
    assert resp.status_code == 200, resp.content
    return [e["request_id"] for e in resp.json()["events"]]


def assert_400(resp, fragment: str):
    assert resp.status_code == 400, resp.content
    body = resp.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "invalid_request"
    assert fragment in body["error"]["message"]


# --- record_event ----------------------------------------------------------------


def test_record_event_is_written_once():
    first = ev("req-1", status=200, model="gpt-4o")
    again = ev("req-1", status=500, model="other", error_kind="upstream_error")
    assert again.pk == first.pk
    assert (again.status, again.model, again.error_kind) == (200, "gpt-4o", "")
    assert UsageEvent.objects.count() == 1


def test_record_event_inside_the_callers_transaction():
    with transaction.atomic():
        ev("req-1", status=200)
        # A duplicate must not break the transaction the caller is still using.
        assert ev("req-1", status=500).status == 200
        ev("req-2", status=201)
        assert UsageEvent.objects.count() == 2
    assert set(UsageEvent.objects.values_list("request_id", flat=True)) == {"req-1", "req-2"}


def test_record_event_rolls_back_with_the_caller():
    with pytest.raises(RuntimeError), transaction.atomic():
        ev("req-1")
        raise RuntimeError("item finish failed")
    assert not UsageEvent.objects.exists()
    assert ev("req-1", status=204).status == 204


@pytest.mark.django_db(transaction=True)
def test_record_event_race_between_two_writers():
    barrier = threading.Barrier(2)
    results, errors = [], []

    def other_waits_or_is_done() -> bool:
        if len(results) == 2:
            return True
        with connections["default"].cursor() as cursor:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # activity is snapshotted once per transaction
            cursor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
            )
            return cursor.fetchone()[0] >= 1

    def writer(status):
        try:
            with transaction.atomic():
                barrier.wait()
                results.append(record_event(request_id="raced", source="batch", status=status))
                # Hold the transaction open until the other INSERT waits for it.
                wait_for(other_waits_or_is_done, 10, interval=0.02, what="the other writer to wait")
        except Exception as exc:  # surfaced by the assertion below
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=writer, args=(s,)) for s in (200, 500)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert UsageEvent.objects.filter(request_id="raced").count() == 1
    assert results[0].pk == results[1].pk and results[0].status == results[1].status


def test_record_event_takes_tokens_and_cuts_long_error_messages():
    event = ev("req-1", tokens=Tokens(input=1, output=2, cache_read=3, cache_write=4), error_message="x" * 5000)
    assert (event.input_tokens, event.output_tokens, event.cache_read_tokens, event.cache_write_tokens) == (1, 2, 3, 4)
    assert event.total_tokens == 10
    assert event.error_message == "x" * 500


def test_record_event_needs_a_request_id():
    with pytest.raises(ValueError):
        record_event(request_id="", source="live")


# --- events: shape and visibility --------------------------------------------------


def test_event_json_has_every_field(client):
    ts = datetime(2025, 3, 4, 5, 6, 7, 123456, tzinfo=UTC)
    ev(
        "req-full",
        source="batch",
        ts=ts,
        status=200,
        duration_ms=1234,
        attempts=2,
        error_kind="",
        error_message="",
        credential_kind="key",
        credential_id="17",
        principal_kind="serviceaccount",
        principal_id=5,
        project_id=6,
        team_id=7,
        policy_id=8,
        host_key_id=9,
        project="proj-a",
        team="team-a",
        policy="pol-a",
        model="gpt-4o",
        provider="openai",
        host="openai",
        batch_id="0195-batch",
        tokens=Tokens(input=10, output=20, cache_read=30, cache_write=40),
        cost_nano_usd=123,
        billed_cost_nano_usd=140,
        executed_by="provider",
        usage_estimated=True,
    )
    resp = get(client, "events", {"from": "2025-03-04T00:00:00Z", "to": "2025-03-05T00:00:00Z"})
    assert resp.status_code == 200, resp.content
    assert resp.json() == {
        "events": [
            {
                "request_id": "req-full",
                "source": "batch",
                "ts": "2025-03-04T05:06:07.123456Z",
                "status": 200,
                "duration_ms": 1234,
                "attempts": 2,
                "error_kind": "",
                "error_message": "",
                "credential_kind": "key",
                "credential_id": "17",
                "principal_kind": "serviceaccount",
                "principal_id": 5,
                "project_id": 6,
                "team_id": 7,
                "policy_id": 8,
                "host_key_id": 9,
                "project": "proj-a",
                "team": "team-a",
                "policy": "pol-a",
                "model": "gpt-4o",
                "provider": "openai",
                "host": "openai",
                "batch_id": "0195-batch",
                "batch_surface": None,
                "tokens": {"input": 10, "output": 20, "cache_read": 30, "cache_write": 40, "total": 100},
                "cost_nano_usd": 123,
                "billed_cost_nano_usd": 140,
                "executed_by": "provider",
                "usage_estimated": True,
            }
        ]
    }


def test_events_are_newest_first_and_unpriced_cost_is_null(client):
    ev("old", ago=timedelta(minutes=30))
    ev("new", ago=timedelta(minutes=1), tokens=Tokens(input=5), cost_nano_usd=None)
    ev("mid", ago=timedelta(minutes=10))
    resp = get(client, "events")
    assert ids(resp) == ["new", "mid", "old"]
    assert resp.json()["events"][0]["cost_nano_usd"] is None
    assert "next_cursor" not in resp.json()


@pytest.fixture
def owned(catalog):
    """Events of the catalog's service account, of another service account, and of a user."""
    other_sa = catalog.sa.project.service_accounts.create(name="sa-b")
    ev("mine-1", principal_kind="serviceaccount", principal_id=catalog.sa.id, model="gpt-4o")
    ev("mine-2", principal_kind="serviceaccount", principal_id=catalog.sa.id, model="claude-sonnet")
    ev("other-sa", principal_kind="serviceaccount", principal_id=other_sa.id, model="gpt-4o")
    # Same id, other kind: must not leak to the service account.
    ev("user-same-id", principal_kind="user", principal_id=catalog.sa.id, model="gpt-4o")
    return catalog


def test_admin_token_sees_every_event(client, owned):
    assert sorted(ids(get(client, "events"))) == ["mine-1", "mine-2", "other-sa", "user-same-id"]


def test_relay_key_sees_only_its_principals_events(client, owned):
    headers = {"Authorization": f"Bearer {owned.key}"}
    assert sorted(ids(get(client, "events", headers=headers))) == ["mine-1", "mine-2"]
    summary = get(client, "summary", {"group_by": "model"}, headers=headers).json()["rows"]
    assert {r["group"]["model"]: r["requests"] for r in summary} == {"gpt-4o": 1, "claude-sonnet": 1}


def test_other_key_headers_work_too(client, owned):
    assert sorted(ids(get(client, "events", headers={"X-WR-API-Key": owned.key}))) == ["mine-1", "mine-2"]


def test_inference_token_sees_its_users_events(client, owned):
    alice = factories.user("alice")
    token = auth.mint_token(alice, owned.project, 600)["token"]
    ev("alice-1", principal_kind="user", principal_id=alice.id)
    assert ids(get(client, "events", headers={"Authorization": f"Bearer {token}"})) == ["alice-1"]


def test_no_credential_is_401(client, owned):
    for endpoint in ("events", "summary"):
        resp = get(client, endpoint, headers={})
        assert resp.status_code == 401
        assert resp.json() == {
            "error": {"type": "invalid_request_error", "code": "unauthenticated", "message": "missing relay key"}
        }


def test_wrong_admin_token_is_an_invalid_key(client, owned):
    resp = get(client, "events", headers={"Authorization": "Bearer not-the-admin-token"})
    assert resp.status_code == 401
    assert resp.json()["error"]["message"] == "invalid api key"


def test_authentication_comes_before_validation(client):
    assert get(client, "events", {"limit": "nope"}, headers={}).status_code == 401


def test_staff_session_sees_every_event(client, owned, django_user_model):
    staff = django_user_model.objects.create_user("ops", password="pw", is_staff=True)
    client.force_login(staff)
    assert len(ids(get(client, "events", headers={}))) == 4
    assert get(client, "summary", headers={}).json()["rows"][0]["requests"] == 4


def test_non_staff_session_is_not_enough(client, owned, django_user_model):
    client.force_login(django_user_model.objects.create_user("bob", password="pw"))
    assert get(client, "events", headers={}).status_code == 401


# --- filters -------------------------------------------------------------------------

SLUG_VALUES = {
    "source": ("live", "batch", "live"),
    "model": ("gpt-4o", "claude-sonnet", "gpt-resp"),
    "project": ("proj-a", "proj-b", "proj-c"),
    "team": ("team-a", "team-b", "team-c"),
    "policy": ("pol-a", "pol-b", "pol-c"),
    "host": ("openai", "anthropic", "vllm"),
}


@pytest.mark.parametrize("dimension", DIMENSIONS)
def test_slug_filters_are_exact_and_repeatable(client, dimension):
    first, second, third = SLUG_VALUES[dimension]
    ev("e1", **{dimension: first})
    ev("e2", **{dimension: second})
    ev("e3", **{dimension: third})
    if dimension != "source":  # sources are a closed set: no prefix of one can be stored
        ev("e4", **{dimension: first[:-1]})  # a prefix is not a match
    assert sorted(ids(get(client, "events", {dimension: second}))) == ["e2"]
    both = sorted(ids(get(client, "events", {dimension: [first, second]})))
    assert both == (["e1", "e2", "e3"] if dimension == "source" else ["e1", "e2"])
    assert ids(get(client, "events", {dimension: "nothing-like-it"})) == []


def test_filters_combine(client):
    ev("e1", model="gpt-4o", project="proj-a", status=200)
    ev("e2", model="gpt-4o", project="proj-b", status=200)
    ev("e3", model="claude-sonnet", project="proj-a", status=200)
    ev("e4", model="gpt-4o", project="proj-a", status=500)
    assert ids(get(client, "events", {"model": "gpt-4o", "project": "proj-a", "status": "200"})) == ["e1"]


def test_status_is_repeatable(client):
    for i, status in enumerate((200, 429, 500, 0)):
        ev(f"s{status}", ago=timedelta(minutes=i + 1), status=status)
    assert ids(get(client, "events", {"status": ["429", "500"]})) == ["s429", "s500"]
    assert ids(get(client, "events", {"status": "0"})) == ["s0"]


def test_error_filter(client):
    ev("ok", ago=timedelta(minutes=1), status=200)
    ev("redirect", ago=timedelta(minutes=2), status=302)
    ev("http-error", ago=timedelta(minutes=3), status=429)
    ev("rejected", ago=timedelta(minutes=4), status=0, error_kind="rate_limited")
    ev("canceled-after-200", ago=timedelta(minutes=5), status=200, error_kind="client_canceled")
    assert ids(get(client, "events", {"error": "true"})) == ["http-error", "rejected", "canceled-after-200"]
    assert ids(get(client, "events", {"error": "false"})) == ["ok", "redirect"]


def test_since_defaults_to_24h(client):
    ev("10m", ago=timedelta(minutes=10))
    ev("2h", ago=timedelta(hours=2))
    ev("23h", ago=timedelta(hours=23))
    ev("2d", ago=timedelta(days=2))
    ev("8d", ago=timedelta(days=8))
    assert ids(get(client, "events")) == ["10m", "2h", "23h"]
    assert ids(get(client, "events", {"since": "1h"})) == ["10m"]
    assert ids(get(client, "events", {"since": "30m"})) == ["10m"]
    assert ids(get(client, "events", {"since": "7d"})) == ["10m", "2h", "23h", "2d"]
    assert ids(get(client, "events", {"since": "7200s"})) == ["10m"]
    assert ids(get(client, "events", {"since": "121m"})) == ["10m", "2h"]


def test_from_and_to_are_inclusive_and_override_since(client):
    base = datetime(2025, 1, 31, 12, 0, tzinfo=UTC)
    for minute in (0, 10, 20, 30):
        ev(f"m{minute}", ts=base + timedelta(minutes=minute))
    window = {"from": "2025-01-31T12:10:00Z", "to": "2025-01-31T12:20:00Z"}
    assert ids(get(client, "events", window)) == ["m20", "m10"]
    # Long ago, so `since` alone would find nothing: from/to win.
    assert ids(get(client, "events", {**window, "since": "1h"})) == ["m20", "m10"]
    # `to` alone counts `since` back from it.
    assert ids(get(client, "events", {"to": "2025-01-31T12:20:00Z", "since": "15m"})) == ["m20", "m10"]
    # `from` alone runs to now.
    assert ids(get(client, "events", {"from": "2025-01-31T12:25:00Z"})) == ["m30"]
    # Offsets other than Z, including one whose "+" became a space in an unencoded query string.
    assert ids(get(client, "events", {"from": "2025-01-31T13:25:00+01:00"})) == ["m30"]
    assert ids(get(client, "events", {"from": "2025-01-31T13:25:00 01:00"})) == ["m30"]


def test_summary_reports_its_window(client):
    body = get(client, "summary", {"from": "2025-01-31T12:10:00Z", "to": "2025-01-31T13:10:00+01:00"}).json()
    assert (body["from"], body["to"], body["rows"]) == ("2025-01-31T12:10:00Z", "2025-01-31T12:10:00Z", [])
    body = get(client, "summary", {"since": "1h"}).json()
    start, end = (datetime.fromisoformat(body[k]) for k in ("from", "to"))
    assert end - start == timedelta(hours=1)
    assert abs(timezone.now() - end) < timedelta(minutes=1)


@pytest.mark.parametrize(
    "params,fragment",
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "10001"}, "limit"),
        ({"limit": "abc"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "1.5"}, "limit"),
        ({"limit": ""}, "limit"),
        ({"since": "abc"}, "since"),
        ({"since": "0h"}, "since"),
        ({"since": "2w"}, "since"),
        ({"since": "-1h"}, "since"),
        ({"since": "99999999999999d"}, "since"),
        ({"since": "999999999d"}, "since"),
        ({"from": "yesterday"}, "from"),
        ({"from": "2025-01-31"}, "from"),
        ({"from": "2025-01-31T12:00:00"}, "from"),
        ({"to": "2025-13-01T00:00:00Z"}, "to"),
        ({"from": "2025-02-01T00:00:00Z", "to": "2025-01-31T00:00:00Z"}, "from must not be after to"),
        ({"status": "abc"}, "status"),
        ({"status": "2000"}, "status"),
        ({"error": "yes"}, "error"),
        ({"error": "True"}, "error"),
        ({"cursor": "!!!!"}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"no-colon").decode()}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"abc:req-1").decode()}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"123:").decode()}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"\xff\xfe:x").decode()}, "cursor"),
        ({"cursor": base64.urlsafe_b64encode(b"99999999999999999999999999:x").decode()}, "cursor"),
    ],
)
def test_bad_values_are_400_in_the_envelope(client, params, fragment):
    assert_400(get(client, "events", params), fragment)
    if not {"limit", "cursor"} & params.keys():
        assert_400(get(client, "summary", params), fragment)


# --- paging --------------------------------------------------------------------------


def test_cursor_walks_every_page_across_ties_on_ts(client):
    base = timezone.now() - timedelta(minutes=5)
    stamps = {
        "a": base,
        "b": base - timedelta(seconds=1),
        "c": base - timedelta(seconds=1),
        "d": base - timedelta(seconds=1),
        "e": base - timedelta(seconds=1),
        "f": base - timedelta(seconds=2),
        "g": base - timedelta(seconds=3),
    }
    for request_id, ts in stamps.items():
        ev(request_id, ts=ts)
    expected = ["a", "e", "d", "c", "b", "f", "g"]

    seen, pages, cursor = [], [], None
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        body = get(client, "events", params).json()
        page = [e["request_id"] for e in body["events"]]
        seen += page
        pages.append(page)
        cursor = body.get("next_cursor")
        if cursor is None:
            break
        assert len(page) == 2
    assert seen == expected
    assert pages == [["a", "e"], ["d", "c"], ["b", "f"], ["g"]]


def test_cursor_format_is_unix_nanos_and_request_id(client):
    ts = datetime(2025, 1, 31, 12, 0, 0, 654321, tzinfo=UTC)
    ev("z", ts=ts)
    ev("y", ts=ts - timedelta(seconds=1))
    cursor = get(client, "events", {"limit": "1", "from": "2025-01-31T00:00:00Z"}).json()["next_cursor"]
    decoded = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    assert decoded == f"{int(ts.timestamp()) * 10**9 + 654321000}:z"
    # A cursor made by hand in that format continues right after it, padded or not.
    for handmade in (base64.urlsafe_b64encode(decoded.encode()).decode(), cursor):
        assert ids(get(client, "events", {"cursor": handmade, "from": "2025-01-31T00:00:00Z"})) == ["y"]


def test_full_last_page_gets_a_cursor_to_an_empty_page(client):
    for i in range(3):
        ev(f"e{i}", ago=timedelta(minutes=i + 1))
    body = get(client, "events", {"limit": "3"}).json()
    assert len(body["events"]) == 3
    last = get(client, "events", {"limit": "3", "cursor": body["next_cursor"]}).json()
    assert last == {"events": []}


def test_cursor_keeps_the_filters(client):
    for i in range(5):
        ev(f"e{i}", ago=timedelta(minutes=i + 1), model="gpt-4o" if i % 2 == 0 else "claude-sonnet")
    first = get(client, "events", {"limit": "2", "model": "gpt-4o"}).json()
    assert [e["request_id"] for e in first["events"]] == ["e0", "e2"]
    rest = get(client, "events", {"limit": "2", "model": "gpt-4o", "cursor": first["next_cursor"]})
    assert ids(rest) == ["e4"]


def test_limit_default_and_bounds(client):
    now = timezone.now()
    UsageEvent.objects.bulk_create(
        UsageEvent(request_id=f"r{i:03d}", source="live", ts=now - timedelta(seconds=i)) for i in range(101)
    )
    default = get(client, "events").json()
    assert len(default["events"]) == 100 and "next_cursor" in default
    assert len(ids(get(client, "events", {"limit": "1"}))) == 1
    # A full page gets a cursor even when nothing follows (the product's rule) …
    exact = get(client, "events", {"limit": "101"}).json()
    assert len(exact["events"]) == 101 and "next_cursor" in exact
    # … a short one does not.
    whole = get(client, "events", {"limit": "102"}).json()
    assert len(whole["events"]) == 101 and "next_cursor" not in whole
    at_max = get(client, "events", {"limit": "10000"}).json()
    assert len(at_max["events"]) == 101 and "next_cursor" not in at_max


# --- summary -------------------------------------------------------------------------


@pytest.fixture
def mixed():
    """Group A: three events (one unpriced with tokens, one failed); group B: one rejected event."""
    a = {dim: values[0] for dim, values in SLUG_VALUES.items()}
    b = {dim: values[1] for dim, values in SLUG_VALUES.items()}
    ev("a1", **a, status=200, tokens=Tokens(input=100, output=50, cache_read=25), cost_nano_usd=1_000)
    ev("a2", **a, status=200, tokens=Tokens(input=10, cache_write=5), cost_nano_usd=2_345)
    ev("a3", **a, status=500, tokens=Tokens(input=7), cost_nano_usd=None, error_kind="upstream_error")
    # Rejected before any upstream: no tokens, no cost, and not "unpriced".
    ev("b1", **b, status=0, error_kind="rate_limited")


@pytest.mark.parametrize("group_by", DIMENSIONS)
def test_summary_groups_by_each_dimension(client, mixed, group_by):
    body = get(client, "summary", {"group_by": group_by}).json()
    a_value, b_value = SLUG_VALUES[group_by][0], SLUG_VALUES[group_by][1]
    assert body["rows"] == [
        {
            "group": {group_by: a_value},
            "requests": 3,
            "errors": 1,
            "tokens": {"input": 117, "output": 50, "cache_read": 25, "cache_write": 5, "total": 197},
            "cost_nano_usd": 3_345,
            "unpriced": 1,
        },
        {
            "group": {group_by: b_value},
            "requests": 1,
            "errors": 1,
            "tokens": {"input": 0, "output": 0, "cache_read": 0, "cache_write": 0, "total": 0},
            "cost_nano_usd": 0,
            "unpriced": 0,
        },
    ]
    assert {"from", "to"} <= body.keys()


def test_summary_defaults_to_source_and_sorts_by_requests(client):
    ev("l1", source="live", model="m")
    ev("b1", source="batch", model="m")
    ev("b2", source="batch", model="m")
    ev("b3", source="batch", model="n")
    rows = get(client, "summary").json()["rows"]
    assert [(r["group"], r["requests"]) for r in rows] == [({"source": "batch"}, 3), ({"source": "live"}, 1)]


def test_summary_takes_the_same_filters(client, mixed):
    rows = get(client, "summary", {"group_by": "model", "error": "true"}).json()["rows"]
    # Equal request counts fall back to the group's name.
    assert [(r["group"]["model"], r["requests"]) for r in rows] == [("claude-sonnet", 1), ("gpt-4o", 1)]
    rows = get(client, "summary", {"group_by": "model", "status": "200"}).json()["rows"]
    assert [(r["requests"], r["cost_nano_usd"], r["unpriced"]) for r in rows] == [(2, 3_345, 0)]


def test_summary_unknown_group_by_is_400(client):
    for group_by in ("nope", "principal", "request_id", ""):
        assert_400(get(client, "summary", {"group_by": group_by}), "group_by")


# --- admin ---------------------------------------------------------------------------


def test_admin_browses_events_read_only(client, django_user_model):
    client.force_login(django_user_model.objects.create_superuser("root", "root@example.com", "pw"))
    event = ev("req-admin", model="gpt-4o", project="proj-a")
    changelist = client.get(reverse("admin:usage_usageevent_changelist"), {"q": "req-admin"})
    assert changelist.status_code == 200 and b"req-admin" in changelist.content
    change_url = reverse("admin:usage_usageevent_change", args=[event.pk])
    assert client.get(change_url).status_code == 200
    assert client.post(change_url, {"status": "500"}).status_code == 403
    assert client.get(reverse("admin:usage_usageevent_add")).status_code == 403
    assert client.post(reverse("admin:usage_usageevent_delete", args=[event.pk]), {"post": "yes"}).status_code == 403
    assert UsageEvent.objects.get(pk=event.pk).status == 0
