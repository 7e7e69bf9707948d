"""keypool.pick: the inbound limit, the pool's order, each key's breaker and tier limit
and the LRU mark decided in ONE Redis round trip, with the semantics of the per-call
functions (breaker.try_acquire, ratelimit.reserve, keypool.order / mark_used)."""

from dataclasses import dataclass

import pytest
import redis

from core.redis import get_redis
from policies import breaker, keypool, ratelimit
from policies.breaker import Failure
from tests import factories


@dataclass(frozen=True)
class Cand:
    key: object
    key_hash: str


@pytest.fixture
def pool(catalog):
    keys = [k for k in catalog.keys if k.host.name == "openai"]
    return catalog.policy, [Cand(k, f"h{i}") for i, k in enumerate(keys)]


@pytest.fixture
def round_trips(monkeypatch):
    # Scripts already loaded, as in a running relay: the very first call of a script on a
    # server costs a SCRIPT LOAD (redis-py's NOSCRIPT fallback), once per server.
    for source in (keypool._PICK_LUA, keypool._SUCCESS_LUA):
        get_redis().script_load(source)
    calls = []
    original = redis.Redis.execute_command

    def counting(self, *args, **kwargs):
        calls.append(args[0])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(redis.Redis, "execute_command", counting)
    return calls


def names(picks):
    return [c.key.name for c, _ in picks]


def test_first_key_in_one_round_trip(pool, round_trips):
    policy, cands = pool
    picks = keypool.pick(policy, cands, max_picks=3)
    assert len(round_trips) == 1
    cand, tier = next(iter(picks))
    assert cand.key.name == "openai-0"
    assert len(round_trips) == 1  # the first pick was made by pick() itself
    assert get_redis().get(f"relay:pool_lru:{{policy:{policy.id}}}:h0") is not None


def test_fail_over_walks_the_order_and_stops_at_max(pool):
    policy, cands = pool
    assert names(keypool.pick(policy, cands, max_picks=3)) == ["openai-0", "openai-1", "openai-2"]
    assert names(keypool.pick(policy, cands, max_picks=2)) == ["openai-0", "openai-1"]


def test_round_robin_and_lru(pool):
    policy, cands = pool
    policy.key_selection = "round-robin"
    firsts = [next(iter(keypool.pick(policy, cands, max_picks=1)))[0].key.name for _ in range(4)]
    assert firsts == ["openai-0", "openai-1", "openai-2", "openai-0"]
    policy.key_selection = "least-recently-used"
    get_redis().flushdb()
    firsts = [next(iter(keypool.pick(policy, cands, max_picks=1)))[0].key.name for _ in range(4)]
    assert firsts == ["openai-0", "openai-1", "openai-2", "openai-0"]


def test_open_breaker_is_skipped_and_half_open_gives_one_probe(pool):
    policy, cands = pool
    breaker.record_failure("h0", Failure.AUTH)
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-1"]
    # Cooldown over: half-open, exactly one caller gets the probe.
    get_redis().hset("relay:breaker:{h0}", "open_until", 0)
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-0"]
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-1"]
    breaker.record_success("h0")
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-0"]


def test_spent_tier_skips_the_key_and_hands_back_its_probe(pool):
    policy, cands = pool
    rl = factories.rate_limit("tier", ("requests", 1, 60, "sliding-window"))
    cands[0].key.rate_limit = rl
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-0"]
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-1"]
    # Half-open key whose tier is spent: its probe is handed back, not held for a minute.
    breaker.record_failure("h0", Failure.SERVER)
    get_redis().hset("relay:breaker:{h0}", "open_until", 0)
    assert names(keypool.pick(policy, cands, max_picks=1)) == ["openai-1"]
    assert not get_redis().exists("relay:breaker:{h0}:probe")


def test_inbound_limit_spent_consumes_nothing(pool):
    policy, cands = pool
    policy.rate_limit = factories.rate_limit("in", ("requests", 1, 60, "sliding-window"))
    cands[0].key.rate_limit = factories.rate_limit("tier", ("requests", 5, 60, "sliding-window"))
    first = keypool.pick(policy, cands, max_picks=1)
    first.inbound.release()
    with pytest.raises(ratelimit.RateLimited) as info:
        keypool.pick(policy, cands, max_picks=1)
    assert info.value.meter == "requests" and info.value.subject == f"policy {policy.name}"
    # The tier was charged once (by the first pick), not by the refused one: 4 of 5 left.
    for _ in range(4):
        ratelimit.reserve(f"hostkey:{cands[0].key.id}", cands[0].key.rate_limit, subject="x")
    with pytest.raises(ratelimit.RateLimited):
        ratelimit.reserve(f"hostkey:{cands[0].key.id}", cands[0].key.rate_limit, subject="x")


def test_concurrency_gauge_is_held_by_the_reservations(pool):
    policy, cands = pool
    policy.rate_limit = factories.rate_limit("gauge", ("concurrency", 1, 60, "sliding-window"))
    picks = keypool.pick(policy, cands, max_picks=1)
    with pytest.raises(ratelimit.RateLimited):
        keypool.pick(policy, cands, max_picks=1)
    picks.inbound.release()
    keypool.pick(policy, cands, max_picks=1).inbound.release()


def test_nothing_usable_reports_the_soonest_wait(pool):
    policy, cands = pool
    for c in cands:
        breaker.record_failure(c.key_hash, Failure.SERVER)  # 2 s cooldowns
    picks = keypool.pick(policy, cands, max_picks=3)
    assert list(picks) == []
    assert 0 < picks.retry_after_ms <= 2000


def test_success_closes_the_breaker_and_commits_both_in_one_round_trip(pool, round_trips):
    policy, cands = pool
    policy.rate_limit = factories.rate_limit(
        "in", ("concurrency", 1, 60, "sliding-window"), ("tokens", 100, 60, "sliding-window")
    )
    cands[0].key.rate_limit = factories.rate_limit("tier", ("tokens", 100, 60, "sliding-window"))
    breaker.record_failure("h0", Failure.SERVER)
    get_redis().hset("relay:breaker:{h0}", "open_until", 0)  # half-open: this pick holds the probe
    picks = keypool.pick(policy, cands, max_picks=1)
    cand, tier = next(iter(picks))
    assert cand.key_hash == "h0"
    round_trips.clear()
    keypool.settle_success("h0", (tier, picks.inbound), input_tokens=60, output_tokens=40)
    assert len(round_trips) == 1
    assert breaker.snapshot("h0")["state"] == "closed"
    assert not get_redis().exists("relay:breaker:{h0}:probe")
    # Both token meters were charged 100 (spent), and the gauge went back down.
    with pytest.raises(ratelimit.RateLimited) as info:
        keypool.pick(policy, cands, max_picks=1)
    assert info.value.meter == "tokens"
    with pytest.raises(ratelimit.RateLimited):
        ratelimit.reserve(f"hostkey:{cands[0].key.id}", cands[0].key.rate_limit, subject="x")
    # Settled once: a later commit or release does nothing.
    picks.inbound.release()
    tier.commit(input_tokens=5)
