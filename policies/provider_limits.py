"""What a provider says about a host key's remaining quotas, shared by every process through Redis.

Requests: OpenAI answers every request with `x-ratelimit-remaining-requests` and
`x-ratelimit-reset-requests` (a duration such as `1s`, `6m0s` or `20ms`); Anthropic with
`anthropic-ratelimit-requests-remaining` and `anthropic-ratelimit-requests-reset` (an RFC 3339 time).
Tokens: OpenAI's `x-ratelimit-{limit,remaining,reset}-tokens`; Anthropic's
`anthropic-ratelimit-tokens-*`, `-input-tokens-*` and `-output-tokens-*`. The relay keeps the last
word per key and meter,

    relay:quota:{<key_hash>}                 requests left in the provider's window
    relay:quota:{<key_hash>}:<meter>         tokens | input_tokens | output_tokens left
                                             (each expires when the provider says its window resets)
    relay:quota:{<key_hash>}:info            per meter: the window's limit and length as last said (1 h)

and takes from it before each call, in the key pick (policies.keypool): one request, and the
request's worst case in tokens (`usage.tokens.estimate`: the prompt from its size plus its output
limit). When it does not fit, the key is skipped until the window resets, exactly as for its
configured tier limit, so a batch paces itself to the provider's limits instead of learning them
from a stream of 429s. After the call the reservation is settled with the real usage (the unused part
is given back). Without the headers (an OpenAI-compatible server that sends none) nothing is stored
and nothing is skipped.

A count learned from a response can be stale by the requests in flight when it was answered; keeping
the lower of the stored count (after the give-back) and the new one within one window makes the
relay undershoot, never overshoot.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from core.redis import get_redis
from policies import lua
from usage.tokens import Tokens

log = logging.getLogger(__name__)

# The longest window we believe a provider reports (OpenAI's daily request limits reset within a day).
MAX_RESET_S = 24 * 3600

# The meters a provider reports, in the order the key pick passes them (requests first).
METERS = ("requests", "tokens", "input_tokens", "output_tokens")

# Lua functions the key pick runs for the key it is about to choose, in the same round trip
# (policies.keypool). `need` is capped at the window's limit: a request larger than a whole window
# waits for a fresh one rather than forever. A window we have no word on yet starts from the key's
# last known limit (for as long as its window last lasted), so the first burst of a new window never
# exceeds it. `keep` is what must stay left afterwards (live traffic's share: policies.livefirst).
# quota_check returns 0 when `need` fits, else the ms until the window resets.
QUOTA_FN_LUA = """
local function quota_info(info_key, meter)
  local v = redis.call('HMGET', info_key, 'limit:' .. meter, 'window:' .. meter)
  return tonumber(v[1]), tonumber(v[2])
end

local function quota_check(left_key, limit, need, keep)
  local left = redis.call('GET', left_key)
  if not left then
    if limit and keep > 0 and math.min(need, limit) > limit - keep then return 1000 end
    return 0
  end
  if limit then need = math.min(need, limit) end
  if tonumber(left) - need >= keep then return 0 end
  local ttl = redis.call('PTTL', left_key)
  if ttl < 1 then return 1 end
  return ttl
end

-- Returns what was taken (0 when nothing is known of the meter).
local function quota_apply(left_key, limit, window, need, provisional)
  if limit then need = math.min(need, limit) end
  if redis.call('EXISTS', left_key) == 1 then
    redis.call('DECRBY', left_key, need)
    return need
  end
  if limit and limit > 0 then
    redis.call('SET', left_key, limit - need, 'PX', window or provisional)
    return need
  end
  return 0
end
"""

# The settle of a call, as a Lua function (the key pool's success settle runs it in its own script).
# KEYS from k0+1: the 4 meters' left keys, info. ARGV from a0+1: limit TTL s, then per meter:
# remaining ('' if not said), reset ms, limit ('' if not said), give-back (the reservation's unused
# part; negative when the call used more; only where the left key still exists).
# Give back first, then keep the lower of ours and the provider's word within one window, and let
# the window end when the provider says it resets.
SETTLE_FN_LUA = """
local function quota_settle(k0, a0)
  local info = KEYS[k0 + 5]
  for i = 1, 4 do
    local key = KEYS[k0 + i]
    local base = a0 + 1 + (i - 1) * 4
    local back = tonumber(ARGV[base + 4]) or 0
    if back ~= 0 and redis.call('EXISTS', key) == 1 then redis.call('INCRBY', key, back) end
    if ARGV[base + 1] ~= '' then
      local meter = ({'requests', 'tokens', 'input_tokens', 'output_tokens'})[i]
      local reset = tonumber(ARGV[base + 2])
      if ARGV[base + 3] ~= '' then
        redis.call('HSET', info, 'limit:' .. meter, ARGV[base + 3])
        local window = tonumber(redis.call('HGET', info, 'window:' .. meter) or '0')
        if reset > window then redis.call('HSET', info, 'window:' .. meter, reset) end
        redis.call('EXPIRE', info, ARGV[a0 + 1])
      end
      local remaining = tonumber(ARGV[base + 1])
      local left = redis.call('GET', key)
      local window = tonumber(redis.call('HGET', info, 'window:' .. meter) or '0')
      -- An answer from a window that has ended for us (it was in flight across the reset) says nothing
      -- of the window we count in now: the one we count in lasts longer than that answer's by most of one.
      local stale = left and window > 0 and redis.call('PTTL', key) > reset + window / 2
      if not stale then
        if left and tonumber(left) < remaining then remaining = tonumber(left) end
        redis.call('SET', key, remaining, 'PX', reset)
      end
    end
  end
end
"""
_SETTLE_LUA = (
    SETTLE_FN_LUA
    + """
quota_settle(0, 0)
return 1
"""
)
# How long a key's reported limit (and window length) is remembered, and the window assumed until
# the provider's first answer.
LIMIT_TTL_S = 3600
PROVISIONAL_WINDOW_MS = 1000

_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m(?!s))?(?:(\d+(?:\.\d+)?)s)?(?:(\d+(?:\.\d+)?)ms)?")


def keys(key_hash: str) -> list[str]:
    """The left keys of the four meters (`METERS` order), then the info hash."""
    quota = f"relay:quota:{{{key_hash}}}"
    return [quota, f"{quota}:tokens", f"{quota}:input_tokens", f"{quota}:output_tokens", f"{quota}:info"]


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


# Per meter, the header triples (remaining, reset, limit) of each provider.
_HEADERS = {
    "requests": (
        ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests", "x-ratelimit-limit-requests"),
        (
            "anthropic-ratelimit-requests-remaining",
            "anthropic-ratelimit-requests-reset",
            "anthropic-ratelimit-requests-limit",
        ),
    ),
    "tokens": (
        ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens", "x-ratelimit-limit-tokens"),
        (
            "anthropic-ratelimit-tokens-remaining",
            "anthropic-ratelimit-tokens-reset",
            "anthropic-ratelimit-tokens-limit",
        ),
    ),
    "input_tokens": (
        (
            "anthropic-ratelimit-input-tokens-remaining",
            "anthropic-ratelimit-input-tokens-reset",
            "anthropic-ratelimit-input-tokens-limit",
        ),
    ),
    "output_tokens": (
        (
            "anthropic-ratelimit-output-tokens-remaining",
            "anthropic-ratelimit-output-tokens-reset",
            "anthropic-ratelimit-output-tokens-limit",
        ),
    ),
}


def _lower(headers: dict) -> dict:
    return {str(k).lower(): str(v) for k, v in (headers or {}).items()}


def _quota(lower: dict, meter: str) -> tuple[int, float, int | None] | None:
    for remaining_name, reset_name, limit_name in _HEADERS[meter]:
        raw = lower.get(remaining_name, "").strip()
        if not raw.isdigit() or len(raw) > 12:
            continue
        reset = parse_reset(lower.get(reset_name, ""))
        if reset is None:
            continue
        limit = lower.get(limit_name, "").strip()
        return int(raw), reset, int(limit) if limit.isdigit() and len(limit) <= 12 else None
    return None


def quota_from(headers: dict, meter: str = "requests") -> tuple[int, float, int | None] | None:
    """(remaining, seconds until the window resets, the window's limit if said) of one meter, from a response."""
    return _quota(_lower(headers), meter)


@dataclass(frozen=True)
class Held:
    """Tokens the key pick took from a key's learned token quotas, per meter (0: nothing known)."""

    tokens: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def __bool__(self) -> bool:
        return bool(self.tokens or self.input_tokens or self.output_tokens)


NOTHING_HELD = Held()


def settle_args(headers: dict, held: Held = NOTHING_HELD, used: Tokens | None = None) -> list | None:
    """The settle script's arguments: what the provider said, and the give-back of `held` given the
    tokens the call `used` (None: unknown, e.g. the connection broke: nothing is given back). None
    when there is nothing to do (no headers, nothing to give back): no round trip."""
    lower = _lower(headers)
    args, anything = [LIMIT_TTL_S], False
    backs = {"requests": 0}
    if held and used is not None:
        backs.update(
            tokens=held.tokens and held.tokens - (used.input + used.output),
            input_tokens=held.input_tokens and held.input_tokens - used.input,
            output_tokens=held.output_tokens and held.output_tokens - used.output,
        )
    for meter in METERS:
        quota = _quota(lower, meter)
        back = backs.get(meter, 0)
        if quota is None:
            args += ["", 0, "", back]
        else:
            remaining, reset, limit = quota
            args += [remaining, max(1, math.ceil(reset * 1000)), "" if limit is None else limit, back]
        anything = anything or quota is not None or back != 0
    return args if anything else None


def settle(key_hash: str, headers: dict, held: Held = NOTHING_HELD, used: Tokens | None = None) -> None:
    """Remember what the provider said about the key's quotas, and give back the unused part of what
    the pick held (a no-op, with no round trip, when there is neither)."""
    args = settle_args(headers, held, used)
    if args is not None:
        lua.run(_SETTLE_LUA, keys(key_hash), args)


def learn(key_hash: str, headers: dict) -> None:
    """Remember what the provider said about the key's quotas (a no-op when it said nothing)."""
    settle(key_hash, headers)


def forget(key_hash: str) -> None:
    get_redis().delete(*keys(key_hash))
