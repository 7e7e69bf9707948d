"""What a provider says about a host key's remaining request quota, shared by every process through Redis.

OpenAI answers every request with `x-ratelimit-remaining-requests` and
`x-ratelimit-reset-requests` (a duration such as `1s`, `6m0s` or `20ms`);
Anthropic with `anthropic-ratelimit-requests-remaining` and
`anthropic-ratelimit-requests-reset` (an RFC 3339 time). The relay keeps the
last word per key,

    relay:quota:{<key_hash>}   requests left in the provider's window; expires when the window resets

and takes one request from it before each call. When it is spent, the key is
skipped until the window resets, exactly as for its configured tier limit, so
a batch paces itself to the provider's limit instead of learning it from a
stream of 429s. Without the headers (an OpenAI-compatible server that sends
none) nothing is stored and nothing is skipped.

A count learned from a response can be stale by the requests in flight when it
was answered; keeping the lower of the stored and the new count within one
window makes the relay undershoot, never overshoot.
"""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime
from functools import lru_cache

import redis
from redis.commands.core import Script

from relay.redis import get_redis

# The longest window we believe a provider reports (OpenAI's daily request limits reset within a day).
MAX_RESET_S = 24 * 3600

# KEYS: quota. Returns 0 when a request may go, else the milliseconds until the window resets.
_TAKE_LUA = """
local left = redis.call('GET', KEYS[1])
if not left then return 0 end
if tonumber(left) > 0 then
  redis.call('DECR', KEYS[1])
  return 0
end
local ttl = redis.call('PTTL', KEYS[1])
if ttl < 1 then return 1 end
return ttl
"""

# KEYS: quota. ARGV: remaining, reset ms. Within a window keep the lower count; a new window starts fresh.
_LEARN_LUA = """
local left = redis.call('GET', KEYS[1])
local remaining = tonumber(ARGV[1])
if left and redis.call('PTTL', KEYS[1]) > 0 then
  if remaining < tonumber(left) then redis.call('SET', KEYS[1], remaining, 'KEEPTTL') end
  return 0
end
redis.call('SET', KEYS[1], remaining, 'PX', ARGV[2])
return 1
"""

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")


@lru_cache(maxsize=8)
def _script(client: redis.Redis, source: str) -> Script:
    return client.register_script(source)


def _key(key_hash: str) -> str:
    return f"relay:quota:{{{key_hash}}}"


def parse_reset(value: str) -> float | None:
    """Seconds until a window resets, from OpenAI's duration (`1s`, `6m0s`, `20ms`) or an RFC 3339 time."""
    value = (value or "").strip()
    if not value:
        return None
    match = _DURATION.fullmatch(value)
    if match and any(match.groups()):
        h, m, s, ms = (float(g) if g else 0.0 for g in match.groups())
        seconds = h * 3600 + m * 60 + s + ms / 1000
    else:
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - datetime.now(UTC)).total_seconds()
    if not math.isfinite(seconds) or seconds < 0:
        return None
    return min(seconds, MAX_RESET_S)


def quota_from(headers: dict) -> tuple[int, float] | None:
    """(requests remaining, seconds until the window resets) from a provider's response headers."""
    lower = {str(k).lower(): str(v) for k, v in (headers or {}).items()}
    for remaining_name, reset_name in (
        ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
        ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"),
    ):
        raw = lower.get(remaining_name, "").strip()
        if not raw.isdigit():
            continue
        reset = parse_reset(lower.get(reset_name, ""))
        if reset is None:
            continue
        return int(raw), reset
    return None


def take(key_hash: str) -> float:
    """Take one request of the key's learned quota: 0 when it may go, else seconds until the window resets."""
    client = get_redis()
    wait_ms = int(_script(client, _TAKE_LUA)(keys=[_key(key_hash)], client=client))
    return wait_ms / 1000


def learn(key_hash: str, headers: dict) -> None:
    """Remember what the provider said about the key's quota (a no-op when it said nothing)."""
    quota = quota_from(headers)
    if quota is None:
        return
    remaining, reset = quota
    client = get_redis()
    _script(client, _LEARN_LUA)(keys=[_key(key_hash)], args=[remaining, max(1, math.ceil(reset * 1000))], client=client)


def forget(key_hash: str) -> None:
    get_redis().delete(_key(key_hash))
