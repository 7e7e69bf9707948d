"""Key selection: the order in which a policy's host keys are tried.

`order()` returns every candidate; the pipeline walks the list, skips keys whose
breaker refuses or whose tier limit is spent, and fails over to the next one.
The cursors live in Redis so every process rotates through the same pool:

    relay:pool_rr:{policy:<id>}               round-robin counter (INCR), TTL 30 days
    relay:pool_lru:{policy:<id>}:<key_hash>   last use in ms of Redis server time, TTL 30 days
"""

from __future__ import annotations

from policies import lua
from policies.models import KeySelection
from relay.redis import get_redis

CURSOR_TTL_S = 30 * 24 * 3600

# Server time, so the order of uses recorded by different machines is real.
_MARK_USED_LUA = (
    lua.NOW_MS
    + """
local ms = now_ms()
redis.call('SET', KEYS[1], ms, 'EX', ARGV[1])
return ms
"""
)


def _rr_key(policy_id: int) -> str:
    return f"relay:pool_rr:{{policy:{policy_id}}}"


def _lru_key(policy_id: int, key_hash: str) -> str:
    return f"relay:pool_lru:{{policy:{policy_id}}}:{key_hash}"


def order(policy_id: int, selection: str, candidates: list) -> list:
    """`candidates` (objects with `.key_hash`, in the policy's declared order),
    reordered for `selection`."""
    candidates = list(candidates)
    if not candidates or selection == KeySelection.PRIORITIZED:
        return candidates
    client = get_redis()
    if selection == KeySelection.ROUND_ROBIN:
        pipe = client.pipeline()
        pipe.incr(_rr_key(policy_id))
        pipe.expire(_rr_key(policy_id), CURSOR_TTL_S)
        n = pipe.execute()[0]
        start = (n - 1) % len(candidates)
        return candidates[start:] + candidates[:start]
    if selection == KeySelection.LEAST_RECENTLY_USED:
        last_used = client.mget([_lru_key(policy_id, c.key_hash) for c in candidates])
        # Never used (-1) first; sorted() is stable, so ties keep the declared order.
        ranked = sorted(zip(last_used, candidates, strict=True), key=lambda pair: int(pair[0] or -1))
        return [c for _, c in ranked]
    raise ValueError(f"unknown key selection {selection!r}")


def mark_used(policy_id: int, key_hash: str) -> None:
    """Record that the pipeline picked this key (drives least-recently-used)."""
    lua.run(_MARK_USED_LUA, [_lru_key(policy_id, key_hash)], [CURSOR_TTL_S])
