"""Circuit breakers against a real Redis: every transition, both cooldown
ladders, 429 handling and the single half-open probe.

Cooldowns of a minute or more cannot be waited out in a test, so `_cool_down`
moves the recorded end of the cooldown into the past (real Redis, real state);
one test waits out the real 2 s cooldown to show the clock drives it too."""

import threading
import time

import pytest

from core.redis import get_redis
from policies import breaker
from policies.breaker import Failure
from tests.workers import wait_for

pytestmark = pytest.mark.integration  # Redis

KEY = "a1b2c3d4e5f6"
A_TENANT, B_TENANT = "serviceaccount:1", "serviceaccount:2"


def _server_s() -> float:
    sec, usec = get_redis().time()
    return sec + usec / 1e6


def _cool_down(key_hash: str = KEY) -> None:
    get_redis().hset(f"relay:breaker:{{{key_hash}}}", "open_until", 0)


def _cooldown_s(key_hash: str = KEY) -> float:
    return breaker.snapshot(key_hash)["open_until"] - _server_s()


def _probe_fails(failure: Failure, key_hash: str = KEY) -> None:
    _cool_down(key_hash)
    assert breaker.try_acquire(key_hash)
    breaker.record_failure(key_hash, failure)


def test_a_fresh_key_is_closed():
    assert breaker.snapshot(KEY) == {"state": "closed", "open_until": None, "step": 0, "reason": ""}
    assert breaker.try_acquire(KEY)
    assert breaker.try_acquire(KEY)


def test_auth_failure_ladder_60_300_900_3600_capped():
    breaker.record_failure(KEY, Failure.AUTH)
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["step"], snap["reason"]) == ("open", 1, "upstream_auth_failed")
    assert 55 < _cooldown_s() <= 60
    assert not breaker.try_acquire(KEY)
    for step, seconds in [(2, 300), (3, 900), (4, 3600), (4, 3600), (4, 3600)]:
        _probe_fails(Failure.AUTH)
        assert breaker.snapshot(KEY)["step"] == step
        assert seconds - 5 < _cooldown_s() <= seconds


@pytest.mark.parametrize(
    "failure,reason",
    [
        (Failure.FORBIDDEN, "upstream_forbidden"),
        (Failure.SERVER, "upstream_server_error"),
        (Failure.NETWORK, "upstream_network_error"),
        (Failure.UNREACHABLE, "upstream_unreachable"),
    ],
)
def test_backoff_ladder_doubles_from_2_to_60(failure, reason):
    breaker.record_failure(KEY, failure)
    assert breaker.snapshot(KEY)["reason"] == reason
    assert 1 < _cooldown_s() <= 2
    for seconds in [4, 8, 16, 32, 60, 60, 60]:
        _probe_fails(failure)
        assert seconds - 1 < _cooldown_s() <= seconds
        assert breaker.snapshot(KEY)["state"] == "open"


def test_failures_while_open_do_not_climb_the_ladder():
    # Requests in flight when the breaker opened report the same incident.
    for _ in range(8):
        breaker.record_failure(KEY, Failure.AUTH)
    assert breaker.snapshot(KEY)["step"] == 1
    assert 55 < _cooldown_s() <= 60
    # A shorter cooldown of another class does not cut the open one short.
    breaker.record_failure(KEY, Failure.SERVER)
    assert 55 < _cooldown_s() <= 60
    assert breaker.snapshot(KEY)["reason"] == "upstream_auth_failed"


def test_long_429_opens_for_exactly_retry_after():
    breaker.record_failure(KEY, Failure.RATE_LIMITED, retry_after=30)
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["reason"], snap["step"]) == ("open", "upstream_rate_limited", 0)
    assert 29 < _cooldown_s() <= 30
    assert not breaker.try_acquire(KEY)
    # A 429 with a fractional Retry-After just over the threshold still opens.
    breaker.record_failure("other", Failure.RATE_LIMITED, retry_after=5.5)
    assert 5 < _cooldown_s("other") <= 5.5


@pytest.mark.parametrize("retry_after", [None, 0, 1, 5])
def test_short_429_changes_nothing(retry_after):
    breaker.record_failure(KEY, Failure.RATE_LIMITED, retry_after=retry_after)
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.try_acquire(KEY)
    assert get_redis().keys("relay:breaker:*") == []


def test_unreachable_opens_on_the_backoff_ladder_whoever_saw_it():
    # No byte of the request left (refused, connect timeout, DNS, TLS): it cannot be the request's doing.
    assert breaker.record_failure(KEY, Failure.UNREACHABLE, principal=B_TENANT) is True
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["step"], snap["reason"]) == ("open", 1, "upstream_unreachable")
    assert 1 < _cooldown_s() <= 2
    assert not breaker.try_acquire(KEY)
    assert breaker.suspects(KEY) == []  # nobody is blamed: the key is benched for everyone
    _probe_fails(Failure.UNREACHABLE)
    assert breaker.snapshot(KEY)["step"] == 2 and 3 < _cooldown_s() <= 4


def test_success_closes_and_resets_the_step():
    breaker.record_failure(KEY, Failure.AUTH)
    _probe_fails(Failure.AUTH)
    assert breaker.snapshot(KEY)["step"] == 2
    breaker.record_success(KEY)
    assert breaker.snapshot(KEY) == {"state": "closed", "open_until": None, "step": 0, "reason": ""}
    assert breaker.try_acquire(KEY)
    # The ladder starts again from the bottom.
    breaker.record_failure(KEY, Failure.AUTH)
    assert 55 < _cooldown_s() <= 60


def test_half_open_admits_one_probe_until_it_reports():
    breaker.record_failure(KEY, Failure.SERVER)
    _cool_down()
    assert breaker.snapshot(KEY)["state"] == "half_open"
    assert breaker.try_acquire(KEY)
    assert breaker.snapshot(KEY)["state"] == "half_open"
    assert not any(breaker.try_acquire(KEY) for _ in range(5))
    breaker.record_success(KEY)
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert all(breaker.try_acquire(KEY) for _ in range(5))


def test_half_open_failure_reopens_with_the_next_step():
    breaker.record_failure(KEY, Failure.NETWORK)
    _cool_down()
    assert breaker.try_acquire(KEY)
    breaker.record_failure(KEY, Failure.NETWORK)
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["step"]) == ("open", 2)
    assert 3 < _cooldown_s() <= 4
    assert not breaker.try_acquire(KEY)


def test_concurrent_acquirers_get_exactly_one_probe():
    breaker.record_failure(KEY, Failure.SERVER)
    _cool_down()
    barrier = threading.Barrier(8)
    results = []

    def acquire():
        barrier.wait()
        results.append(breaker.try_acquire(KEY))

    threads = [threading.Thread(target=acquire) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False] * 7 + [True]


def test_a_silent_probe_expires_and_another_caller_probes():
    breaker.record_failure(KEY, Failure.SERVER)
    _cool_down()
    assert breaker.try_acquire(KEY)
    probe = f"relay:breaker:{{{KEY}}}:probe"
    assert 55_000 < get_redis().pttl(probe) <= 60_000
    get_redis().pexpire(probe, 50)  # as if the 60 s had passed with no report
    time.sleep(0.1)
    assert breaker.try_acquire(KEY)
    assert not breaker.try_acquire(KEY)


def test_the_real_cooldown_ends_on_the_redis_clock():
    breaker.record_failure(KEY, Failure.SERVER)  # 2 s
    assert not breaker.try_acquire(KEY)
    # Polled: a refused try changes nothing. Open again by 2.1 s, as a single look after 2.1 s would see.
    wait_for(lambda: breaker.try_acquire(KEY), 2.1 + 0.05, interval=0.05, what="the 2 s cooldown to end")


def test_state_is_per_key_hash_and_expires_after_a_day():
    breaker.record_failure(KEY, Failure.AUTH)
    assert breaker.try_acquire("rotated-key-hash")
    assert 86_000 < get_redis().ttl(f"relay:breaker:{{{KEY}}}") <= 86_400


def test_release_probe_lets_the_next_caller_probe_at_once():
    from policies.breaker import release_probe

    key = "release-probe-key"
    breaker.record_failure(key, breaker.Failure.SERVER)
    get_redis().hset(f"relay:breaker:{{{key}}}", "open_until", 0)  # cooldown over
    assert breaker.try_acquire(key) is True
    assert breaker.try_acquire(key) is False  # the probe is held
    release_probe(key)
    assert breaker.try_acquire(key) is True


# --- tenants isolated: failures the request may have caused are scored per principal ---------------


@pytest.mark.parametrize("failure", [Failure.SERVER, Failure.FORBIDDEN, Failure.NETWORK])
def test_one_principals_failures_never_open_the_key(failure):
    for _ in range(10):
        assert breaker.record_failure(KEY, failure, principal=B_TENANT) is False
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.try_acquire(KEY)
    assert breaker.suspects(KEY) == [B_TENANT]


@pytest.mark.parametrize(
    "failure,reason",
    [
        (Failure.SERVER, "upstream_server_error"),
        (Failure.FORBIDDEN, "upstream_forbidden"),
        (Failure.NETWORK, "upstream_network_error"),
    ],
)
def test_a_second_principal_within_the_window_opens_it_for_everyone(failure, reason):
    breaker.record_failure(KEY, failure, principal=B_TENANT)
    assert breaker.record_failure(KEY, failure, principal=A_TENANT) is True
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["step"], snap["reason"]) == ("open", 1, reason)
    assert 1 < _cooldown_s() <= 2
    assert not breaker.try_acquire(KEY)
    assert sorted(breaker.suspects(KEY)) == [A_TENANT, B_TENANT]


def test_a_success_by_anyone_clears_the_scores():
    breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT)
    breaker.record_success(KEY)
    assert breaker.suspects(KEY) == []
    assert breaker.record_failure(KEY, Failure.SERVER, principal=A_TENANT) is False
    assert breaker.snapshot(KEY)["state"] == "closed"


def test_a_score_older_than_the_window_does_not_count():
    breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT)
    suspects_key = f"relay:breaker:{{{KEY}}}:suspects"
    old = _server_s() * 1000 - breaker.SUSPECT_WINDOW_MS - 1000
    get_redis().zadd(suspects_key, {B_TENANT: old})  # as if B's failure were 61 s ago
    assert breaker.record_failure(KEY, Failure.SERVER, principal=A_TENANT) is False
    assert breaker.suspects(KEY) == [A_TENANT]
    assert 0 < get_redis().pttl(suspects_key) <= breaker.SUSPECT_WINDOW_MS


@pytest.mark.parametrize("failure", [Failure.AUTH, Failure.UNREACHABLE])
def test_failures_that_cannot_be_the_requests_open_at_once_whoever_saw_them(failure):
    assert breaker.record_failure(KEY, failure, principal=B_TENANT) is True
    assert breaker.snapshot(KEY)["state"] == "open"


def test_every_failure_class_has_one_rule_and_every_transport_kind_a_class():
    assert set(breaker.RULES) == set(Failure)
    blamed = {f for f, rule in breaker.RULES.items() if rule.blame is breaker.Blame.KEY}
    assert blamed == {Failure.AUTH, Failure.UNREACHABLE, Failure.RATE_LIMITED}
    assert breaker.transport_failure("unreachable") is Failure.UNREACHABLE
    assert breaker.transport_failure("network") is Failure.NETWORK
    assert [breaker.transport_failure(k) for k in ("timeout", "cancelled", "too_large")] == [None] * 3


def test_the_capacity_page_shows_the_table():
    """docs/capacity.md's table of who each failure blames is `RULES`, row by row."""
    from pathlib import Path

    page = (Path(__file__).resolve().parent.parent / "docs" / "capacity.md").read_text()
    rows = {}
    for line in page.splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[1] in {r.reason for r in breaker.RULES.values()}:
            rows[cells[1]] = cells[2]
    whom = {breaker.Blame.KEY: "everyone", breaker.Blame.PRINCIPAL: "the principal"}
    assert rows == {rule.reason: whom[rule.blame] for rule in breaker.RULES.values()}


def test_a_probe_failed_by_one_principal_alone_is_handed_back():
    breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT)
    breaker.record_failure(KEY, Failure.SERVER, principal=A_TENANT)
    get_redis().delete(f"relay:breaker:{{{KEY}}}:suspects")  # both scores aged out
    _cool_down()
    assert breaker.try_acquire(KEY)  # B's request probes
    assert breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT) is False
    assert breaker.snapshot(KEY)["state"] == "half_open"
    assert breaker.try_acquire(KEY)  # the probe went back: another caller asks the question


def test_a_probe_failed_while_two_principals_are_scored_climbs_the_ladder():
    breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT)
    breaker.record_failure(KEY, Failure.SERVER, principal=A_TENANT)
    _cool_down()
    assert breaker.try_acquire(KEY)
    assert breaker.record_failure(KEY, Failure.SERVER, principal=B_TENANT) is True
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["step"]) == ("open", 2)
    assert 3 < _cooldown_s() <= 4
