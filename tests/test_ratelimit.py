"""The rate-limit engine against a real Redis: every strategy spends and refills,
token meters charge at commit, the concurrency gauge, all-or-nothing decisions
and the Retry-After a caller is given.

Windows are 1-2 s where a test must see a refill; elsewhere they are long, so
nothing refills while the test runs and no assertion depends on timing."""

import math
import pickle

import pytest

from core.redis import get_redis
from policies.models import RateLimitRule
from policies.ratelimit import RateLimited, reserve
from tests import factories
from tests.workers import wait_for

pytestmark = pytest.mark.django_db

SCOPE = "policy:1"
STRATEGIES = ["token-bucket", "sliding-window", "fixed-window"]


def _server_ms() -> int:
    sec, usec = get_redis().time()
    return sec * 1000 + usec // 1000


def _start_of_window(window_s: int, margin_ms: int = 300) -> int:
    """Wait until at least `margin_ms` remain in the current window of Redis time;
    return the milliseconds already elapsed in it. Keeps a burst of calls inside
    one fixed window."""
    window_ms = window_s * 1000
    wait_for(lambda: window_ms - _server_ms() % window_ms >= margin_ms, margin_ms / 1000 + 2, interval=0.01)
    return _server_ms() % window_ms


def _wait_out(seconds: float) -> None:
    """Let `seconds` pass on Redis's clock, the one the limiter reads."""
    until = _server_ms() + seconds * 1000
    wait_for(lambda: _server_ms() >= until, seconds + 2, interval=0.02, what=f"{seconds} s on Redis's clock")


def _spend(scope, rl, n):
    return [reserve(scope, rl, subject="policy pol-a") for _ in range(n)]


def _denied(scope, rl) -> RateLimited:
    with pytest.raises(RateLimited) as info:
        reserve(scope, rl, subject="policy pol-a")
    return info.value


def test_no_rate_limit_or_disabled_is_a_no_op():
    rl = factories.rate_limit("off", ("requests", 1, 60, "fixed-window"))
    rl.enabled = False
    rl.save()
    empty = factories.rate_limit("empty")
    for limit in (None, rl, empty):
        for _ in range(3):
            r = reserve(SCOPE, limit, subject="x")
            r.commit(input_tokens=5, output_tokens=5)
            r.release()
    assert get_redis().keys("relay:rl:*") == []


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_requests_spent_then_refilled(strategy):
    rl = factories.rate_limit("rl", ("requests", 2, 1, strategy))
    _start_of_window(1)
    _spend(SCOPE, rl, 2)
    exc = _denied(SCOPE, rl)
    assert exc.meter == "requests"
    # A 1 s window never asks for more than two windows' wait.
    assert 1 <= exc.retry_after <= 2
    # Retry-After is rounded up, so waiting exactly that long is always enough.
    _wait_out(exc.retry_after + 0.05)
    reserve(SCOPE, rl, subject="policy pol-a")


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_denial_writes_nothing(strategy):
    rl = factories.rate_limit("rl", ("requests", 3, 60, strategy))
    _start_of_window(60, margin_ms=5000)
    _spend(SCOPE, rl, 3)
    r = get_redis()
    before = {key: r.hgetall(key) for key in r.keys("relay:rl:*")}
    for _ in range(5):
        _denied(SCOPE, rl)
    assert {key: r.hgetall(key) for key in r.keys("relay:rl:*")} == before


def test_token_bucket_refills_continuously_and_retry_after_is_time_to_one_token():
    # 2 per 10 s: one token every 5 s.
    rl = factories.rate_limit("rl", ("requests", 2, 10, "token-bucket"))
    _spend(SCOPE, rl, 2)
    assert _denied(SCOPE, rl).retry_after in (4, 5)
    # 4 per 2 s: a token every 0.5 s, not the whole bucket at the end of the window.
    fast = factories.rate_limit("fast", ("requests", 4, 2, "token-bucket"))
    _spend("policy:2", fast, 4)
    assert _denied("policy:2", fast).retry_after == 1
    _wait_out(0.6)
    reserve("policy:2", fast, subject="x")


def test_fixed_window_retry_after_is_the_end_of_the_window():
    rl = factories.rate_limit("rl", ("requests", 1, 60, "fixed-window"))
    elapsed = _start_of_window(60, margin_ms=5000)
    reserve(SCOPE, rl, subject="x")
    expected = math.ceil((60_000 - elapsed) / 1000)
    assert expected - 2 <= _denied(SCOPE, rl).retry_after <= expected


def test_sliding_window_interpolates_the_previous_window():
    # 4 per 10 s spent: the 5th needs the count under 3, i.e. the window to roll
    # and then a quarter of the next window to pass: (10 s - elapsed) + 2.5 s.
    rl = factories.rate_limit("rl", ("requests", 4, 10, "sliding-window"))
    elapsed = _start_of_window(10, margin_ms=2000)
    _spend(SCOPE, rl, 4)
    expected = math.ceil((10_000 - elapsed + 2_500) / 1000)
    assert expected - 2 <= _denied(SCOPE, rl).retry_after <= expected
    # A fixed window would have said at most 10 s.
    assert _denied(SCOPE, rl).retry_after > math.ceil((10_000 - elapsed) / 1000)


def test_message_names_meter_subject_and_wait():
    rl = factories.rate_limit("rl", ("requests", 1, 30, "token-bucket"))
    reserve(SCOPE, rl, subject="policy pol-a")
    exc = _denied(SCOPE, rl)
    n = exc.retry_after
    assert exc.subject == "policy pol-a"
    assert exc.message == f"limit: budget exceeded: requests on policy pol-a retry_after={n}s; try again in {n}s"
    assert str(exc) == exc.message


def test_token_meter_is_checked_at_reserve_and_charged_at_commit():
    rl = factories.rate_limit("rl", ("tokens", 100, 60, "sliding-window"))
    held = _spend(SCOPE, rl, 5)  # nothing is charged before commit
    held[0].commit(input_tokens=40, output_tokens=30)
    reserve(SCOPE, rl, subject="x").release()  # 70 < 100; release charges nothing
    held[1].commit(input_tokens=20, output_tokens=10)  # 100: spent
    exc = _denied(SCOPE, rl)
    assert exc.meter == "tokens"
    assert 1 <= exc.retry_after <= 120
    # Commits of reservations taken earlier still count; usage may overshoot.
    held[2].commit(output_tokens=500)
    assert _denied(SCOPE, rl).meter == "tokens"


def test_input_and_output_meters_charge_their_own_side():
    rl = factories.rate_limit(
        "rl", ("tokens.input", 50, 60, "sliding-window"), ("tokens.output", 50, 60, "sliding-window")
    )
    reserve(SCOPE, rl, subject="x").commit(input_tokens=10, output_tokens=60)
    assert _denied(SCOPE, rl).meter == "tokens.output"
    other = "policy:2"
    reserve(other, rl, subject="x").commit(input_tokens=60, output_tokens=10)
    assert _denied(other, rl).meter == "tokens.input"


def test_token_meter_refills_as_a_sliding_window():
    rl = factories.rate_limit("rl", ("tokens", 10, 1, "sliding-window"))
    reserve(SCOPE, rl, subject="x").commit(input_tokens=10)
    exc = _denied(SCOPE, rl)
    assert 1 <= exc.retry_after <= 2
    _wait_out(exc.retry_after + 0.05)
    reserve(SCOPE, rl, subject="x")


@pytest.mark.parametrize("strategy", ["token-bucket", "fixed-window"])
def test_token_meters_ignore_the_strategy(strategy):
    rl = factories.rate_limit("rl", ("tokens", 10, 10, strategy))
    elapsed = _start_of_window(10, margin_ms=2000)
    # A bucket consumed at reserve would refuse the 11th; token meters only check.
    held = _spend(SCOPE, rl, 11)
    held[0].commit(input_tokens=20)
    # Sliding: 20 tokens decay to under 10 half-way through the next window, past
    # the end of the fixed window (10 s - elapsed).
    retry_after = _denied(SCOPE, rl).retry_after
    assert retry_after >= math.ceil((10_000 - elapsed) / 1000) + 3


def test_commit_and_release_are_idempotent():
    rl = factories.rate_limit("rl", ("tokens", 100, 60, "sliding-window"), ("concurrency", 2, 60, "sliding-window"))
    r = reserve(SCOPE, rl, subject="x")
    r.commit(input_tokens=60)
    r.commit(input_tokens=60)
    r.release()
    # One charge of 60, not 120; one slot dropped, not three (the gauge never goes
    # below zero, so two more requests fit but a third does not).
    a = reserve(SCOPE, rl, subject="x")
    reserve(SCOPE, rl, subject="x")
    assert _denied(SCOPE, rl).meter == "concurrency"
    a.release()
    a.release()
    reserve(SCOPE, rl, subject="x")
    assert _denied(SCOPE, rl).meter == "concurrency"


def test_concurrency_gauge_goes_up_at_reserve_and_down_at_settle():
    rl = factories.rate_limit("rl", ("concurrency", 2, 10, "token-bucket"))
    a, b = _spend(SCOPE, rl, 2)
    exc = _denied(SCOPE, rl)
    assert (exc.meter, exc.retry_after) == ("concurrency", 1)
    a.release()
    c = reserve(SCOPE, rl, subject="x")
    _denied(SCOPE, rl)
    b.commit(input_tokens=1, output_tokens=1)
    c.commit()
    _spend(SCOPE, rl, 2)
    # A crashed holder cannot pin the gauge: it expires after five windows.
    (key,) = get_redis().keys("relay:rl:{policy:1}:*:concurrency")
    assert 40 < get_redis().ttl(key) <= 50


def test_all_rules_or_nothing_and_the_longest_wait_wins():
    rl = factories.rate_limit(
        "rl",
        ("concurrency", 1, 60, "sliding-window"),
        ("requests", 2, 600, "token-bucket"),
    )
    first = reserve(SCOPE, rl, subject="x")
    # Only the gauge is spent: refused by concurrency, and the request rule is not charged.
    for _ in range(3):
        assert _denied(SCOPE, rl).meter == "concurrency"
    first.release()
    second = reserve(SCOPE, rl, subject="x")  # the 2nd request: the bucket is now empty
    exc = _denied(SCOPE, rl)
    # Both rules are spent; the token bucket's 300 s refill outlasts the gauge's 1 s.
    assert exc.meter == "requests"
    assert 290 <= exc.retry_after <= 300
    second.release()
    assert _denied(SCOPE, rl).meter == "requests"


def test_scopes_are_separate_and_share_a_hash_tag():
    rl = factories.rate_limit("rl", ("requests", 1, 60, "fixed-window"), ("tokens", 5, 60, "sliding-window"))
    _start_of_window(60, margin_ms=5000)
    reserve("policy:1", rl, subject="x").commit(output_tokens=1)
    reserve("hostkey:7", rl, subject="x")
    _denied("policy:1", rl)
    keys = set(get_redis().keys("relay:rl:*"))
    rule_ids = list(rl.rules.values_list("id", flat=True))
    assert f"relay:rl:{{policy:1}}:{rule_ids[0]}:requests:fixed-window:60" in keys
    assert f"relay:rl:{{policy:1}}:{rule_ids[1]}:tokens:sliding-window:60" in keys
    assert f"relay:rl:{{hostkey:7}}:{rule_ids[0]}:requests:fixed-window:60" in keys
    for key in keys:
        assert 0 < get_redis().ttl(key) <= 120  # state lives about two windows


def test_rules_are_read_on_every_call():
    rl = factories.rate_limit("rl", ("requests", 100, 60, "sliding-window"))
    reserve(SCOPE, rl, subject="x")
    RateLimitRule.objects.create(rate_limit=rl, meter="requests", amount=1, window_seconds=60, strategy="token-bucket")
    reserve(SCOPE, rl, subject="x")
    _denied(SCOPE, rl)
    rl.rules.filter(amount=1).delete()
    reserve(SCOPE, rl, subject="x")


def test_rate_limited_survives_pickling():
    exc = pickle.loads(pickle.dumps(RateLimited("tokens", "host key k", 7)))
    assert (exc.meter, exc.subject, exc.retry_after) == ("tokens", "host key k", 7)
    assert exc.message.endswith("retry_after=7s; try again in 7s")
