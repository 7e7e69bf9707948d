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

from policies import lua
from relay.redis import get_redis

# The longest window we believe a provider reports (OpenAI's daily request limits reset within a day).
MAX_RESET_S = 24 * 3600

# Take one request of a key's learned quota: 0 when a request may go, else the ms until the window
# resets. A window we have no word on yet starts from the key's last known limit, so the first burst
# of a new window never exceeds it. A Lua function, so the key pool's pick script runs it for the key
# it is about to choose, in the same round trip (policies.keypool).
TAKE_FN_LUA = """
local function quota_take(quota_key, limit_key, window_ms)
  local left = redis.call('GET', quota_key)
  if not left then
    local limit = tonumber(redis.call('GET', limit_key))
    if limit and limit > 0 then redis.call('SET', quota_key, limit - 1, 'PX', window_ms) end
    return 0
  end
  if tonumber(left) > 0 then
    redis.call('DECR', quota_key)
    return 0
  end
  local ttl = redis.call('PTTL', quota_key)
  if ttl < 1 then return 1 end
  return ttl
end
"""
# KEYS: quota, limit. ARGV: remaining, reset ms, limit ('' if not sent), limit TTL s.
# Within a window keep the lower count (answers to requests in flight can be stale), and let the
# window end when the provider says it resets.
_LEARN_LUA = """
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4]) end
local left = redis.call('GET', KEYS[1])
local remaining = tonumber(ARGV[1])
if left then
  if remaining < tonumber(left) then left = remaining end
  redis.call('SET', KEYS[1], left, 'PX', ARGV[2])
  return 0
end
redis.call('SET', KEYS[1], remaining, 'PX', ARGV[2])
return 1
"""
# How long a key's reported limit is remembered, and the window assumed until the provider's first answer.
LIMIT_TTL_S = 3600
PROVISIONAL_WINDOW_MS = 1000

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")


def keys(key_hash: str) -> list[str]:
    """The quota and the remembered limit of a key."""
    quota = f"relay:quota:{{{key_hash}}}"
    return [quota, f"{quota}:limit"]


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


_HEADERS = (
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-limit-requests"),
    (
        "anthropic-ratelimit-requests-remaining",
        "anthropic-ratelimit-requests-reset",
        "anthropic-ratelimit-requests-limit",
    ),
)


def quota_from(headers: dict) -> tuple[int, float, int | None] | None:
    """(requests remaining, seconds until the window resets, the window's limit if said) from a response."""
    lower = {str(k).lower(): str(v) for k, v in (headers or {}).items()}
    for remaining_name, reset_name, limit_name in _HEADERS:
        raw = lower.get(remaining_name, "").strip()
        if not raw.isdigit() or len(raw) > 12:
            continue
        reset = parse_reset(lower.get(reset_name, ""))
        if reset is None:
            continue
        limit = lower.get(limit_name, "").strip()
        return int(raw), reset, int(limit) if limit.isdigit() and len(limit) <= 12 else None
    return None


def learn(key_hash: str, headers: dict) -> None:
    """Remember what the provider said about the key's quota (a no-op when it said nothing)."""
    quota = quota_from(headers)
    if quota is None:
        return
    remaining, reset, limit = quota
    args = [remaining, max(1, math.ceil(reset * 1000)), "" if limit is None else limit, LIMIT_TTL_S]
    lua.run(_LEARN_LUA, keys(key_hash), args)


def forget(key_hash: str) -> None:
    get_redis().delete(*keys(key_hash))
