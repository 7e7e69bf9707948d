"""Rate limits, enforced atomically in Redis so every process shares one budget.

A request takes a `Reservation` before it is sent and settles it afterwards:

- `reserve()` checks every rule of a rate limit in ONE Lua script. If any rule is
  spent nothing is consumed and `RateLimited` carries the longest wait. Otherwise
  `requests` rules consume 1 and `concurrency` gauges go up by 1.
- `commit()` charges the observed tokens to the token meters and drops the gauge;
  `release()` (failure paths) only drops the gauge. Both are idempotent.

Token meters are counted after the response, so the product enforces them as a
sliding window whatever strategy the rule names; so does this module. All clocks
are Redis server time (`TIME` inside the scripts): processes on machines with
skewed clocks still agree on windows.

Keys share the hash tag of the caller's scope, so one script may touch all of
them on a Redis Cluster:

    relay:rl:{<scope>}:<rule id>:<meter>:<strategy>:<window>   requests / token meters
    relay:rl:{<scope>}:<rule id>:concurrency                  the in-flight gauge

Strategy and window are part of the key so that editing a rule starts a fresh
bucket instead of reinterpreting state written under other maths.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import redis

from core.redis import get_redis
from policies import lua
from policies.models import Meter, Strategy

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from policies.models import RateLimit

TOKEN_METERS = frozenset({Meter.TOKENS, Meter.TOKENS_INPUT, Meter.TOKENS_OUTPUT})
# The product keeps bucket state for twice the window and the gauge for five
# windows: long enough to be exact, short enough that a crashed process cannot
# pin a concurrency slot forever.
STATE_TTL_WINDOWS = 2
GAUGE_TTL_WINDOWS = 5
# A spent gauge frees when some request finishes, which no clock predicts.
CONCURRENCY_RETRY_MS = 1000

# Shared helpers of every limit script (and of the key pick, policies.keypool.pick, which
# checks an inbound limit and a key's tier in the same script). Times are ms of Redis server time.
_LUA_COMMON = (
    lua.NOW_MS
    + """
-- Two-bucket sliding window: the current and the previous window's counts,
-- rolled forward to the window that contains `now`.
local function sliding_state(key, now, window)
  local idx = math.floor(now / window)
  local s = redis.call('HMGET', key, 'idx', 'cur', 'prev')
  local stored = tonumber(s[1])
  local cur, prev = 0, 0
  if stored == idx then
    cur, prev = tonumber(s[2]) or 0, tonumber(s[3]) or 0
  elseif stored == idx - 1 then
    prev = tonumber(s[2]) or 0
  end
  return idx, cur, prev, now - idx * window
end

local function sliding_write(key, idx, cur, prev, window)
  redis.call('HSET', key, 'idx', idx, 'cur', cur, 'prev', prev)
  redis.call('PEXPIRE', key, window * %(state_ttl)d)
end

-- Milliseconds until cur + prev*(1 - elapsed/window) falls to `limit`
-- (below it when `strict`). If the current window alone is over the limit,
-- the wait runs past the roll, where the current count starts to decay.
local function sliding_wait(cur, prev, elapsed, window, limit, strict)
  local wait
  if cur > limit or (strict and cur >= limit) then
    wait = (window - elapsed) + window * (1 - limit / cur)
  else
    wait = window * (1 - (limit - cur) / prev) - elapsed
  end
  if strict then wait = wait + 1 end
  return wait
end

-- The rules KEYS[k0+1 .. k0+n] with 4 values each in ARGV from a0+1 (kind, amount,
-- window ms, strategy). Every rule is decided before anything is written, so a denial
-- consumes nothing: returns the worst rule (1-based within the set, 0 when all pass),
-- its wait in ms, and the writes to apply when the caller takes the reservation.
-- Live first (policies.livefirst): with `share` < 1 and live traffic active within a rule's window
-- (`live`: its live_state), the caller (a batch item) must leave free what live_keep says; its wait
-- is then at most until live traffic has been quiet for a window. nil: the whole amount.
local function check_rules(k0, a0, n, now, share, live)
  local apply = {}
  local worst_rule, worst_wait = 0, -1
  for i = 1, n do
    local key = KEYS[k0 + i]
    local base = a0 + (i - 1) * 4
    local kind = ARGV[base + 1]
    local amount = tonumber(ARGV[base + 2])
    local window = tonumber(ARGV[base + 3])
    local strategy = ARGV[base + 4]
    local wait = nil
    local cap = amount
    local held_for_live = share and share < 1 and live and live.age < window
    if held_for_live then
      local rate, left_ms = live.r, nil
      if kind == 'tokens' then rate = live.t end
      if kind == 'concurrency' then
        rate = 0
      elseif strategy == 'fixed-window' and kind ~= 'tokens' then
        left_ms = (math.floor(now / window) + 1) * window - now
      end
      cap = amount - live_keep(amount, window, left_ms, share, rate)
    end

    if kind == 'concurrency' then
      local inflight = tonumber(redis.call('GET', key) or '0')
      if inflight + 1 > cap then
        wait = %(concurrency_retry_ms)d
      else
        apply[#apply + 1] = function()
          redis.call('INCR', key)
          redis.call('PEXPIRE', key, window * %(gauge_ttl)d)
        end
      end

    elseif kind == 'tokens' then
      -- Only checked here; commit charges what the response reports.
      local idx, cur, prev, elapsed = sliding_state(key, now, window)
      if cur + prev * (1 - elapsed / window) >= cap then
        wait = sliding_wait(cur, prev, elapsed, window, cap, true)
      end

    elseif strategy == 'sliding-window' then
      local idx, cur, prev, elapsed = sliding_state(key, now, window)
      if cur + prev * (1 - elapsed / window) + 1 > cap then
        if cap >= 1 then wait = sliding_wait(cur, prev, elapsed, window, cap - 1, false) else wait = window end
      else
        apply[#apply + 1] = function() sliding_write(key, idx, cur + 1, prev, window) end
      end

    elseif strategy == 'fixed-window' then
      local idx = math.floor(now / window)
      local s = redis.call('HMGET', key, 'idx', 'n')
      local n = 0
      if tonumber(s[1]) == idx then n = tonumber(s[2]) or 0 end
      if n + 1 > cap then
        wait = (idx + 1) * window - now
      else
        apply[#apply + 1] = function()
          redis.call('HSET', key, 'idx', idx, 'n', n + 1)
          redis.call('PEXPIRE', key, window * %(state_ttl)d)
        end
      end

    else -- token-bucket: capacity `amount`, refilled continuously at amount/window
      local s = redis.call('HMGET', key, 'tokens', 'ts')
      local tokens = amount
      if s[1] then
        tokens = math.min(amount, tonumber(s[1]) + (now - tonumber(s[2])) * amount / window)
      end
      -- What live traffic keeps stays in the bucket, refilling with the rest: usable by live at any time.
      local usable = tokens - (amount - cap)
      if usable < 1 then
        wait = (1 - usable) * window / amount
      else
        apply[#apply + 1] = function()
          redis.call('HSET', key, 'tokens', tokens - 1, 'ts', now)
          redis.call('PEXPIRE', key, window * %(state_ttl)d)
        end
      end
    end

    if wait and held_for_live then
      -- Not a number (a cap under one request), or past the moment live traffic has been quiet a window.
      if wait ~= wait or wait > window - live.age then wait = window - live.age end
    end
    if wait and wait > worst_wait then
      worst_rule, worst_wait = i, wait
    end
  end
  return worst_rule, worst_wait, apply
end
"""
) % {
    "state_ttl": STATE_TTL_WINDOWS,
    "gauge_ttl": GAUGE_TTL_WINDOWS,
    "concurrency_retry_ms": CONCURRENCY_RETRY_MS,
}

_RESERVE_LUA = (
    _LUA_COMMON
    + """local now = now_ms()
local worst_rule, worst_wait, apply = check_rules(0, 0, #KEYS, now)
if worst_rule > 0 then
  return {0, worst_rule, math.ceil(worst_wait)}
end
for _, fn in ipairs(apply) do fn() end
return {1}
"""
)

# ARGV holds 3 values per key: kind ('tokens' or 'concurrency'), tokens to
# charge, window ms.
# ARGV holds 3 values per key: kind ('tokens' or 'concurrency'), tokens to
# charge, window ms. KEYS from k0+1, ARGV from a0+1 (the key pick's success settle
# puts the breaker's keys first: policies.keypool.settle_success).
_SETTLE_FN_LUA = """
local function settle_keys(k0, a0, n, now)
  for i = 1, n do
    local key = KEYS[k0 + i]
    local base = a0 + (i - 1) * 3
    local kind = ARGV[base + 1]
    if kind == 'concurrency' then
      -- Never below zero: the gauge may have expired under a long request.
      if tonumber(redis.call('GET', key) or '0') > 0 then
        redis.call('DECR', key)
      end
    else
      local charge = tonumber(ARGV[base + 2])
      local window = tonumber(ARGV[base + 3])
      local idx, cur, prev = sliding_state(key, now, window)
      sliding_write(key, idx, cur + charge, prev, window)
    end
  end
end
"""

_SETTLE_LUA = (
    _LUA_COMMON
    + _SETTLE_FN_LUA
    + """
settle_keys(0, 0, #KEYS, now_ms())
return 1
"""
)


class RateLimited(Exception):
    """A rule of the rate limit is spent. Nothing was consumed."""

    def __init__(self, meter: str, subject: str, retry_after: int):
        self.meter = meter
        self.subject = subject
        self.retry_after = retry_after
        self.message = (
            f"limit: budget exceeded: {meter} on {subject} retry_after={retry_after}s; try again in {retry_after}s"
        )
        super().__init__(self.message)

    def __reduce__(self):
        # Rebuilt from its fields, so it survives pickling (e.g. across Celery).
        return type(self), (self.meter, self.subject, self.retry_after)


@dataclass(frozen=True)
class _Held:
    """What a reservation must settle: a token meter to charge or a gauge to drop."""

    key: str
    meter: str
    window_ms: int


class Reservation:
    """The result of `reserve()`. Settle it exactly once: `commit()` after an
    answer with usage, `release()` on any failure path. Later calls do nothing."""

    def __init__(self, held: list[_Held]):
        self._held = held
        self._settled = False

    def commit(self, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
        self._settle(self.charges(input_tokens, output_tokens))

    def release(self) -> None:
        self._settle({})

    def _settle(self, charges: dict) -> None:
        keys, args = self.take_settle(charges)
        if keys:
            lua.run(_SETTLE_LUA, keys, args)

    @staticmethod
    def charges(input_tokens: int, output_tokens: int) -> dict:
        return {
            Meter.TOKENS: input_tokens + output_tokens,
            Meter.TOKENS_INPUT: input_tokens,
            Meter.TOKENS_OUTPUT: output_tokens,
        }

    def take_settle(self, charges: dict) -> tuple[list, list]:
        """The settle's keys and arguments (for `_SETTLE_FN_LUA`); the reservation counts as
        settled from here on. Nothing to do: ([], [])."""
        if self._settled:
            return [], []
        # Marked before the call: a retry after a lost reply must not drop a
        # gauge twice (it would let one request too many through).
        self._settled = True
        keys, args = [], []
        for held in self._held:
            if held.meter == Meter.CONCURRENCY:
                keys.append(held.key)
                args += ["concurrency", 0, held.window_ms]
            elif charges.get(held.meter, 0) > 0:
                keys.append(held.key)
                args += ["tokens", charges[held.meter], held.window_ms]
        return keys, args


def _key(scope: str, rule) -> str:
    if rule.meter == Meter.CONCURRENCY:
        return f"relay:rl:{{{scope}}}:{rule.id}:{rule.meter}"
    strategy = Strategy.SLIDING_WINDOW if rule.meter in TOKEN_METERS else rule.strategy
    return f"relay:rl:{{{scope}}}:{rule.id}:{rule.meter}:{strategy}:{rule.window_seconds}"


def _kind(meter: str) -> str:
    if meter in TOKEN_METERS:
        return "tokens"
    return meter  # "requests" or "concurrency"


# Denials per scope (`policy:<id>`, `hostkey:<id>`) and meter, counted where every process sees them;
# /metrics reads it (relay/metrics.py). A counter that restarts if Redis loses it, like any counter.
DENIALS_KEY = "relay:metrics:ratelimit_denials"


def count_denial(scope: str, meter: str) -> None:
    try:
        get_redis().hincrby(DENIALS_KEY, f"{scope}|{meter}", 1)
    except redis.RedisError:  # a metric never turns a 429 into a 500
        pass


@dataclass(frozen=True)
class Plan:
    """What a reservation under one scope checks: its Redis keys, script arguments, rules."""

    keys: list
    args: list
    rules: list
    subject: str
    scope: str = ""

    def denied(self, rule_index: int, wait_ms: int) -> RateLimited:
        """`rule_index` is 1-based, as the scripts return it. Counted for /metrics."""
        meter = self.rules[rule_index - 1].meter
        count_denial(self.scope, meter)
        return RateLimited(meter, self.subject, max(1, math.ceil(wait_ms / 1000)))

    def reservation(self) -> Reservation:
        return Reservation(
            [
                _Held(key, rule.meter, rule.window_seconds * 1000)
                for key, rule in zip(self.keys, self.rules, strict=True)
                if rule.meter != Meter.REQUESTS
            ]
        )


_NO_PLAN = Plan([], [], [], "")


def plan(scope: str, rate_limit: RateLimit | None, *, subject: str) -> Plan:
    if rate_limit is None or not rate_limit.enabled:
        return _NO_PLAN
    # Rules come from the catalog cache (prefetched; dropped at the next catalog write)
    # or from the database: an operator may edit rules while traffic flows.
    rules = list(rate_limit.rules.all())
    if not rules:
        return _NO_PLAN
    keys, args = [], []
    for rule in rules:
        keys.append(_key(scope, rule))
        args += [_kind(rule.meter), rule.amount, rule.window_seconds * 1000, rule.strategy]
    return Plan(keys, args, rules, subject, scope)


def reserve(scope: str, rate_limit: RateLimit | None, *, subject: str) -> Reservation:
    """Take one request's share of every rule of `rate_limit` under `scope`, or
    raise `RateLimited`. `subject` names the limited party in the message."""
    return reserve_plan(plan(scope, rate_limit, subject=subject))


def reserve_plan(p: Plan) -> Reservation:
    if not p.rules:
        return Reservation([])
    result = lua.run(_RESERVE_LUA, p.keys, p.args)
    if int(result[0]) == 0:
        raise p.denied(int(result[1]), int(result[2]))
    return p.reservation()
