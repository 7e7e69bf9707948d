"""Live first: batch items use only what live traffic leaves of a shared limit.

A host key's provider quota (policies.provider_limits) and tier limit, and a policy's rate limit, are
shared by live requests and batch items. While live traffic is active on one of them — a live request
picked that key, or came through that policy, within the limit's window — a batch item may fill the
limit only up to the policy's `batch_share` of it (default 0.8): the rest stays for live requests.
When no live request came for a window, batch items may use all of it. The marks, in Redis:

    relay:live:{policy:<id>}          the last live request through the policy (ms, server time) and
                                      live traffic's recent requests and tokens there (its rate)
    relay:live:{<key_hash>}           the same for live picks of the host key
    relay:live:{...}:denied           set when a live request met the limit there: batch picks refuse
                                      that policy or key while it lasts (`DENIED_MS`, at most
                                      `DENIED_MAX_MS`), so batch work backs off at once
    relay:live:{<key_hash>}:batch_wait  a provider 429 answered to a batch call: batch picks skip the key
                                      for its Retry-After; live requests may still use it

What a batch pick leaves free is the larger of live's share ((1 - share) of the limit, less what live
traffic already used of it) and what live traffic is expected to need before the limit frees: the
rest of a fixed window at live's recent rate (over `RATE_WINDOW_MS`), or `MARGIN_MS` of it on a limit
that frees continuously. So the batch takes what live leaves, at most `batch_share`. Providers refill
continuously, and so does what is kept: it is never marked spent for live requests (a batch call's
429 benches the key for batch items only), so live requests can use it the moment they come.

Every mark is read and written inside the key pick's one script (policies.keypool): no round trip.

Only where a batch pick would read them (`marks`): a live pick marks its policy when the policy's
`batch_share` is below 1, and a key when some policy with `batch_share` below 1 pools it (a batch pick
through that policy leaves live traffic its part of the key); a batch pick reads them only with a share
below 1. With every share at 1 live first costs nothing. Which keys are marked is read once per catalog
generation (one query, kept with the catalog snapshot).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from decimal import Decimal

import redis

from core import catalog
from core.redis import get_redis

log = logging.getLogger(__name__)

# How long a live mark is kept: the longest window a limit is believed to have (a provider's daily one).
MARK_TTL_MS = 24 * 3600 * 1000
# A live request that met a limit holds batch picks off that policy or key for its wait, within these.
DENIED_MS = 1000
DENIED_MAX_MS = 10_000

# Live traffic's rate on a policy or key: its requests (and tokens) over the last this long (a
# two-bucket sliding count), divided by this long, or by the time since live traffic began if shorter.
RATE_WINDOW_MS = 10_000
# On a limit that frees continuously (sliding window, token bucket), what live traffic is expected to
# need within this long stays free for it beyond the batch's reach.
MARGIN_MS = 1000

# Lua helpers of the key pick. A live mark is a hash: `seen` (ms of the last live request), `since`
# (when this spell of live traffic began), and the sliding count of live requests and tokens.
FN_LUA = f"""
local function live_counts(v, now)
  local idx = math.floor(now / {RATE_WINDOW_MS})
  local stored = tonumber(v[3])
  local cur, prev, tcur, tprev = 0, 0, 0, 0
  if stored == idx then
    cur, prev, tcur, tprev = tonumber(v[4]) or 0, tonumber(v[5]) or 0, tonumber(v[6]) or 0, tonumber(v[7]) or 0
  elseif stored == idx - 1 then
    prev, tprev = tonumber(v[4]) or 0, tonumber(v[6]) or 0
  end
  return idx, cur, prev, tcur, tprev
end

-- nil when live traffic was never seen (or forgotten); else its age (ms since the last live request)
-- and its rate: requests `r` and tokens `t` per ms.
local function live_state(mark_key, now)
  local v = redis.call('HMGET', mark_key, 'seen', 'since', 'idx', 'cur', 'prev', 'tcur', 'tprev')
  local seen = tonumber(v[1])
  if not seen then return nil end
  local idx, cur, prev, tcur, tprev = live_counts(v, now)
  local f = 1 - (now - idx * {RATE_WINDOW_MS}) / {RATE_WINDOW_MS}
  local span = math.max(math.min({RATE_WINDOW_MS}, now - (tonumber(v[2]) or seen)), 1000)
  return {{age = now - seen, r = (cur + prev * f) / span, t = (tcur + tprev * f) / span}}
end

local function live_mark(mark_key, now, tokens)
  local v = redis.call('HMGET', mark_key, 'seen', 'since', 'idx', 'cur', 'prev', 'tcur', 'tprev')
  local idx, cur, prev, tcur, tprev = live_counts(v, now)
  local since = tonumber(v[2])
  local seen = tonumber(v[1])
  if not since or not seen or now - seen > {RATE_WINDOW_MS} then since = now end
  redis.call('HSET', mark_key, 'seen', now, 'since', since, 'idx', idx, 'cur', cur + 1, 'prev', prev,
    'tcur', tcur + tokens, 'tprev', tprev)
  redis.call('PEXPIRE', mark_key, {MARK_TTL_MS})
end

-- What of a limit (`amount` per `window` ms, `left_ms` of the current window left when it is fixed,
-- nil when it frees continuously) a batch pick must leave free while live traffic is active: the
-- larger of live's share ((1 - share) x amount, less what live already used of it) and what live is
-- expected to need before the limit frees (the rest of a fixed window, MARGIN_MS of a continuous one).
local function live_keep(amount, window, left_ms, share, rate)
  local keep
  if left_ms then
    keep = math.max((1 - share) * amount - rate * (window - left_ms), rate * left_ms)
  else
    keep = math.max((1 - share) * amount - rate * window, rate * {MARGIN_MS})
  end
  return math.min(math.max(keep, 0), amount)
end

local function live_denied(denied_key, wait)
  local ms = math.min(math.max(tonumber(wait) or 0, {DENIED_MS}), {DENIED_MAX_MS})
  redis.call('SET', denied_key, 1, 'PX', math.floor(ms))
end

-- ms a batch pick must stay away from a policy or key (0: it may go).
local function batch_held(denied_key)
  local t = redis.call('PTTL', denied_key)
  if t > 0 then return t end
  return 0
end
"""


def mark_key(scope: str) -> str:
    return f"relay:live:{{{scope}}}"


def denied_key(scope: str) -> str:
    return f"{mark_key(scope)}:denied"


def batch_wait_key(key_hash: str) -> str:
    return f"{mark_key(key_hash)}:batch_wait"


def share_of(policy) -> float:
    """The policy's batch share as a number in [0, 1] (1.0 when it has none)."""
    value = getattr(policy, "batch_share", None)
    if value is None:
        return 1.0
    share = float(Decimal(value))
    return min(max(share, 0.0), 1.0)


@dataclass(frozen=True)
class Marks:
    """Where a live pick marks live traffic: its policy (`policy`), and which of the keys it may take."""

    policy: bool
    keys: frozenset  # HostKey ids pooled by a policy with batch_share below 1

    def key(self, host_key) -> bool:
        return host_key.id in self.keys


def marks(policy) -> Marks:
    return Marks(policy=share_of(policy) < 1, keys=shared_keys())


def shared_keys() -> frozenset:
    """The host keys some policy with batch_share below 1 pools: once per catalog generation, kept with the
    snapshot this process holds (the one the request routed with; a pick made with a stale one is refused
    by the generation check and made again with the new one). Without a snapshot (none loaded yet, or
    Redis could not tell the generation) read each time."""
    snap = catalog.peek()
    memo = getattr(snap, "livefirst_keys", None)
    if memo is not None:
        return memo
    from policies.models import PolicyHostKey

    memo = frozenset(PolicyHostKey.objects.filter(policy__batch_share__lt=1).values_list("host_key_id", flat=True))
    if snap.gen is not None:
        snap.livefirst_keys = memo
    return memo


def after_429(key_hash: str, source: str, retry_after: float | None) -> None:
    """A provider 429 on the key: a batch call's makes batch picks skip the key for its Retry-After
    (live requests may still use it: what is kept for them refills); a live request's holds batch
    picks off the key for a short while, so batch work backs off as soon as live traffic meets a limit."""
    ms = max(1000, round((retry_after or 1) * 1000))
    try:
        if source == "batch":
            get_redis().set(batch_wait_key(key_hash), 1, px=min(ms, MARK_TTL_MS))
        else:
            get_redis().set(denied_key(key_hash), 1, px=min(max(ms, DENIED_MS), DENIED_MAX_MS))
    except redis.RedisError:  # a mark never turns an answer into an error
        log.warning("could not mark host key %s after a 429", key_hash, exc_info=True)
