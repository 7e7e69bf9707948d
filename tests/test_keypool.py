"""Key selection against a real Redis: prioritized, round-robin and
least-recently-used orders."""

import time
from dataclasses import dataclass

import pytest

from core.redis import get_redis
from policies import keypool

pytestmark = pytest.mark.integration  # Redis


@dataclass(frozen=True)
class Cand:
    key_hash: str


A, B, C = Cand("aaa"), Cand("bbb"), Cand("ccc")
POOL = [A, B, C]


def _hashes(cands):
    return [c.key_hash for c in cands]


def test_prioritized_is_the_declared_order_every_time():
    for _ in range(3):
        assert keypool.order(1, "prioritized", POOL) == POOL
    assert get_redis().keys("*") == []


def test_round_robin_rotates_one_step_per_call():
    orders = [_hashes(keypool.order(1, "round-robin", POOL)) for _ in range(4)]
    assert orders == [
        ["aaa", "bbb", "ccc"],
        ["bbb", "ccc", "aaa"],
        ["ccc", "aaa", "bbb"],
        ["aaa", "bbb", "ccc"],
    ]
    assert 29 * 86400 < get_redis().ttl("relay:pool_rr:{policy:1}") <= 30 * 86400


def test_round_robin_cursor_is_per_policy():
    keypool.order(1, "round-robin", POOL)
    assert keypool.order(2, "round-robin", POOL) == POOL
    assert _hashes(keypool.order(1, "round-robin", POOL)) == ["bbb", "ccc", "aaa"]


def test_least_recently_used_prefers_never_used_then_oldest():
    assert keypool.order(1, "least-recently-used", POOL) == POOL
    keypool.mark_used(1, "aaa")
    assert _hashes(keypool.order(1, "least-recently-used", POOL)) == ["bbb", "ccc", "aaa"]
    time.sleep(0.005)
    keypool.mark_used(1, "ccc")
    time.sleep(0.005)
    keypool.mark_used(1, "bbb")
    assert _hashes(keypool.order(1, "least-recently-used", POOL)) == ["aaa", "ccc", "bbb"]
    # Another policy's pool has its own history.
    assert keypool.order(2, "least-recently-used", POOL) == POOL
    assert 29 * 86400 < get_redis().ttl("relay:pool_lru:{policy:1}:aaa") <= 30 * 86400


def test_least_recently_used_ties_keep_the_declared_order():
    r = get_redis()
    for cand in POOL:
        r.set(f"relay:pool_lru:{{policy:1}}:{cand.key_hash}", 1000)
    assert keypool.order(1, "least-recently-used", POOL) == POOL


@pytest.mark.parametrize("selection", ["prioritized", "round-robin", "least-recently-used"])
def test_every_candidate_is_returned_once(selection):
    for _ in range(4):
        assert sorted(_hashes(keypool.order(1, selection, POOL))) == ["aaa", "bbb", "ccc"]
    assert keypool.order(1, selection, []) == []


def test_unknown_selection_is_an_error():
    with pytest.raises(ValueError, match="unknown key selection"):
        keypool.order(1, "random", POOL)
