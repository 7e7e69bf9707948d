"""Key selection: the order in which a policy's host keys are tried.

`order()` returns every candidate; the pipeline walks the list, skips keys whose
breaker refuses or whose tier limit is spent, and fails over to the next one.
The cursors live in Redis so every process rotates through the same pool:

    relay:pool_rr:{policy:<id>}               round-robin counter (INCR), TTL 30 days
    relay:pool_lru:{policy:<id>}:<key_hash>   last use in ms of Redis server time, TTL 30 days

The pipeline uses `pick()`: the inbound limit, this order, each key's breaker and tier
limit, the provider's learned request and token quotas (policies.provider_limits), live
first's marks and shares (policies.livefirst) and the LRU mark in ONE script (one round
trip; fail-over costs one more). That
script touches keys under several hash tags (the policy's, each key's breaker, each host
key's limit), so it needs one Redis server, as deployed here, not a Redis Cluster.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from core import catalog
from core.redis import get_redis
from policies import breaker, livefirst, lua, provider_limits, ratelimit
from policies.models import KeySelection, Meter
from usage.tokens import Tokens

log = logging.getLogger(__name__)

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


# --- one round trip per decision -----------------------------------------------------------------

# The whole decision of `pick()` in one script: the catalog generation the caller routed with, the
# inbound limit, the pool's order, and for each candidate in that order its breaker (half-open probe
# included), its tier limit and the provider's learned quotas (policies.provider_limits: one request
# and the request's token estimate), until one is usable; that one is marked used (LRU). Live first
# (policies.livefirst): a live pick marks the policy and the key it takes as live-active (and a limit
# it meets as met by live); a batch pick fills each shared limit only up to the policy's batch share
# while live traffic is active on it, and stays off a policy or key where live met a limit.
#
# Pay only for what is configured: live marks are written only where a batch pick reads them (the
# policy's when its batch_share is below 1, a key's when a policy with batch_share below 1 pools it),
# and a batch pick reads them only with a share below 1. The caller may leave the request's tokens
# unestimated (total -1) where no configured limit meters tokens: a candidate with a learned token
# quota then makes the script answer {4, candidate} before anything is consumed, and the caller
# estimates and decides again.
#
# ARGV: n_in, selection, probe TTL ms, cursor TTL s, m (candidates), source, share, tokens needed
#   (total, input, output; total -1: not estimated), then 4 values per inbound rule, then per
#   candidate: n_tier, whether live marks the key ('1') and 4 values per tier rule; then whether live
#   marks the policy ('1'), the quota's provisional window ms and the catalog generation the caller
#   holds ('' = don't check).
# KEYS: n_in inbound keys, the round-robin cursor, the policy's live mark and live-denied mark, then
#   per candidate: breaker state, breaker probe, LRU mark, the 4 quota keys and the quota info, the
#   key's live mark, live-denied mark and batch wait, n_tier tier keys; last the catalog generation.
# Returns {3, generation in Redis} when the caller's catalog is stale (nothing consumed: it
#   reloads and decides again); {0, rule, wait ms} when the inbound limit is spent (nothing
#   consumed; rule 0: held for live traffic); {1, candidate, position, tokens, input tokens, output
#   tokens taken from the provider's quotas, order...} when a candidate was taken;
#   {2, soonest wait ms or -1, 0, 0, 0, 0, order...} when none was usable; {4, candidate} when the
#   tokens were not estimated and that candidate has a learned token quota (nothing consumed).
_HEAD = 10
_PER_CAND_KEYS = 11
_PICK_LUA = (
    livefirst.FN_LUA
    + ratelimit._LUA_COMMON
    + breaker.ACQUIRE_FN_LUA
    + provider_limits.QUOTA_FN_LUA
    + """
local held_gen = ARGV[#ARGV]
if held_gen ~= '' then
  local gen = redis.call('GET', KEYS[#KEYS])
  if gen ~= held_gen then return {3, gen or ''} end
end
local provisional = tonumber(ARGV[#ARGV - 1])
local policy_marks = ARGV[#ARGV - 2] == '1'
local now = now_ms()
local n_in = tonumber(ARGV[1])
local selection = ARGV[2]
local probe_ttl = ARGV[3]
local cursor_ttl = tonumber(ARGV[4])
local m = tonumber(ARGV[5])
local batch = ARGV[6] == 'batch'
local share = nil
if batch then share = tonumber(ARGV[7]) end
local needs = {1, tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])}
local meters = {'requests', 'tokens', 'input_tokens', 'output_tokens'}
-- Live state matters to a batch pick only when it leaves live traffic a part.
local reads_live = batch and share < 1
local policy_live, policy_denied = KEYS[n_in + 2], KEYS[n_in + 3]
local rr_key = KEYS[n_in + 1]
local cands = {}
do
  local k, a = n_in + 3, 10 + 4 * n_in
  for c = 1, m do
    local nt = tonumber(ARGV[a + 1])
    cands[c] = {
      state = KEYS[k + 1], probe = KEYS[k + 2], lru = KEYS[k + 3],
      quota = {KEYS[k + 4], KEYS[k + 5], KEYS[k + 6], KEYS[k + 7]}, info = KEYS[k + 8],
      live = KEYS[k + 9], denied = KEYS[k + 10], batch_wait = KEYS[k + 11],
      k0 = k + 11, a0 = a + 2, nt = nt, marks = ARGV[a + 2] == '1',
    }
    k = k + 11 + nt
    a = a + 2 + 4 * nt
  end
end
if needs[2] < 0 then
  -- Not estimated: only a learned token quota needs the request's tokens (a configured token limit
  -- made the caller estimate them).
  for c = 1, m do
    local d = cands[c]
    local v = redis.call('HMGET', d.info, 'limit:tokens', 'limit:input_tokens', 'limit:output_tokens')
    if v[1] or v[2] or v[3] or redis.call('EXISTS', d.quota[2], d.quota[3], d.quota[4]) > 0 then return {4, c} end
  end
  needs = {1, 0, 0, 0}
end
local a = 10
if n_in > 0 then
  if batch then
    local held = batch_held(policy_denied)
    if held > 0 then return {0, 0, held} end
  end
  local live = nil
  if reads_live then live = live_state(policy_live, now) end
  local worst, wait, apply = check_rules(0, a, n_in, now, share, live)
  if not batch and policy_marks then live_mark(policy_live, now, needs[2]) end
  if worst > 0 then
    if not batch then live_denied(policy_denied, wait) end
    return {0, worst, math.ceil(wait)}
  end
  for _, fn in ipairs(apply) do fn() end
end

-- The provider's learned quotas of a candidate: 0 and each meter's (limit, window) when the request
-- fits, else the ms until it may. A batch pick leaves live traffic its part (livefirst.live_keep; the
-- provider's window is a fixed one, ending when it said).
local function quotas_check(d, live)
  local infos = {}
  for i = 1, 4 do
    local limit, window = quota_info(d.info, meters[i])
    infos[i] = {limit, window}
    local keep = 0
    local w = window or provisional
    if share and share < 1 and limit and live and live.age < w then
      local left_ms = redis.call('PTTL', d.quota[i])
      if left_ms < 0 then left_ms = w end
      local rate = live.t
      if i == 1 then rate = live.r end
      keep = live_keep(limit, math.max(w, left_ms), left_ms, share, rate)
    end
    if needs[i] > 0 then
      local wait = quota_check(d.quota[i], limit, needs[i], keep)
      if wait > 0 then return wait, infos end
    end
  end
  return 0, infos
end

local order = {}
if selection == 'round-robin' then
  local n = redis.call('INCR', rr_key)
  redis.call('EXPIRE', rr_key, cursor_ttl)
  local start = (n - 1) % m
  for i = 0, m - 1 do order[#order + 1] = ((start + i) % m) + 1 end
elseif selection == 'least-recently-used' then
  local ranked = {}
  for c = 1, m do ranked[c] = {tonumber(redis.call('GET', cands[c].lru) or '-1'), c} end
  -- Never used (-1) first; ties keep the declared order.
  table.sort(ranked, function(x, y)
    if x[1] ~= y[1] then return x[1] < y[1] end
    return x[2] < y[2]
  end)
  for i, r in ipairs(ranked) do order[i] = r[2] end
else
  for c = 1, m do order[c] = c end
end

local soonest = -1
for pos, c in ipairs(order) do
  local d = cands[c]
  local ok, wait = breaker_acquire(d.state, d.probe, probe_ttl, now)
  if ok > 0 then
    local worst, tier_wait, apply = 0, 0, {}
    local live = nil
    if batch then
      -- Live met a limit on this key, or the provider answered a batch call 429: stay off it.
      tier_wait = math.max(batch_held(d.denied), batch_held(d.batch_wait))
      if tier_wait > 0 then worst = -1 end
      if reads_live then live = live_state(d.live, now) end
    end
    if worst == 0 then worst, tier_wait, apply = check_rules(d.k0, d.a0, d.nt, now, share, live) end
    local infos
    if worst == 0 then
      -- The provider said this key's window is spent (or too little is left): don't spend a request
      -- learning it again.
      tier_wait, infos = quotas_check(d, live)
      if tier_wait > 0 then worst = -1 end
    end
    if worst == 0 then
      for _, fn in ipairs(apply) do fn() end
      local res = {1, c, pos}
      for i = 1, 4 do
        local taken = 0
        if needs[i] > 0 then taken = quota_apply(d.quota[i], infos[i][1], infos[i][2], needs[i], provisional) end
        if i > 1 then res[#res + 1] = taken end
      end
      redis.call('SET', d.lru, now, 'EX', cursor_ttl)
      if not batch and d.marks then live_mark(d.live, now, needs[2]) end
      for _, o in ipairs(order) do res[#res + 1] = o end
      return res
    end
    -- The key's own tier or quota is spent: hand back a probe this call took.
    if ok == 2 then redis.call('DEL', d.probe) end
    if not batch then
      -- Live demand counts whether or not it was served: the batch leaves room for it next time.
      if d.marks then live_mark(d.live, now, needs[2]) end
      live_denied(d.denied, tier_wait)
    end
    wait = tier_wait
  end
  if wait >= 0 and (soonest < 0 or wait < soonest) then soonest = wait end
end
local res = {2, math.ceil(soonest), 0, 0, 0, 0}
for _, o in ipairs(order) do res[#res + 1] = o end
return res
"""
)


class Picks:
    """The keys one request may use, in order, each taken with its breaker and tier limit.

    `pick()` makes the first decision: the inbound limit (`inbound`, a Reservation to
    settle) and the first usable key, in ONE Redis round trip. Iterating yields
    `(candidate, tier_reservation)`; a later item (fail-over after a failed call) costs
    one more round trip, made only when asked for, so breaking out of the loop takes
    nothing more. A candidate whose breaker refuses or whose tier is spent is skipped,
    as by the per-call functions above. `held`: the tokens taken from the provider's learned
    quotas of the candidate last yielded (settle them: `provider_limits.settle`).
    `retry_after_ms`: when no key was usable, the soonest a skipped one frees up (None when unknown).
    """

    def __init__(self, policy, candidates: list, max_picks: int, source: str = "live", need=None):
        self._policy = policy
        self._candidates = list(candidates)
        self._max = max_picks
        self._first = None
        self._source = "batch" if source == "batch" else "live"
        self._share = livefirst.share_of(policy)
        # Tokens, or how to estimate them when a limit turns out to meter tokens (`_tokens`).
        self._need = need if callable(need) else (need or Tokens())
        self._marks = livefirst.marks(policy)
        self.inbound = ratelimit.Reservation([])
        self.held = provider_limits.NOTHING_HELD
        self.retry_after_ms: int | None = None

    def _tier_plan(self, cand) -> ratelimit.Plan:
        key = cand.key
        return ratelimit.plan(f"hostkey:{key.id}", key.rate_limit, subject=f"host key {key.name}")

    def _tokens(self, cands: list, plans: list, inbound: ratelimit.Plan | None) -> Tokens | None:
        """The request's tokens where something configured or learned meters them: a token rule of the
        policy's or a key's limit, or a key this process saw a learned token quota on. None otherwise:
        the pick then asks for them only if a candidate's provider quota meters tokens (status 4)."""
        if not callable(self._need):
            return self._need
        rules = [*(inbound.rules if inbound is not None else ()), *(r for p in plans for r in p.rules)]
        if any(r.meter in _TOKEN_METERS for r in rules) or any(c.key_hash in _token_metered for c in cands):
            self._need = self._need()
            return self._need
        return None

    def _decide(self, cands: list, selection: str, inbound: ratelimit.Plan | None, held_gen: str = ""):
        """One round trip (two the first time a key with a learned token quota is seen with tokens not
        estimated). Returns (candidate, tier reservation, tokens held, remaining candidates in order)."""
        policy_id = self._policy.id
        n_in = len(inbound.rules) if inbound is not None else 0
        plans = [self._tier_plan(c) for c in cands]
        keys = list(inbound.keys) if n_in else []
        policy_scope = f"policy:{policy_id}"
        keys += [_rr_key(policy_id), livefirst.mark_key(policy_scope), livefirst.denied_key(policy_scope)]
        need = self._tokens(cands, plans, inbound)
        args = [n_in, selection, breaker.PROBE_TTL_MS, CURSOR_TTL_S, len(cands), self._source, self._share]
        args += [-1, 0, 0] if need is None else [need.input + need.output, need.input, need.output]
        if n_in:
            args += inbound.args
        marks = self._marks
        for cand, p in zip(cands, plans, strict=True):
            h = cand.key_hash
            keys += [*breaker._keys(h), _lru_key(policy_id, h), *provider_limits.keys(h)]
            keys += [livefirst.mark_key(h), livefirst.denied_key(h), livefirst.batch_wait_key(h), *p.keys]
            args += [len(p.rules), "1" if marks.key(cand.key) else "0", *p.args]
        keys.append(catalog.GEN_KEY)
        args += ["1" if marks.policy else "0", provider_limits.PROVISIONAL_WINDOW_MS, held_gen]
        result = lua.run(_PICK_LUA, keys, args)
        status = int(result[0])
        if status == 4:
            # A learned token quota: remembered for this key, estimated, decided again (nothing was consumed).
            if len(_token_metered) >= _MAX_TOKEN_METERED:
                _token_metered.clear()
            _token_metered.add(cands[int(result[1]) - 1].key_hash)
            return self._decide(cands, selection, inbound, held_gen)
        if status == 3:
            raise catalog.Stale(_text(result[1]))
        if status == 0:
            rule, wait = int(result[1]), int(result[2])
            if rule == 0:  # a live request met the policy's limit: batch work backs off
                raise ratelimit.RateLimited(
                    "requests", f"{inbound.subject} (held for live traffic)", max(1, math.ceil(wait / 1000))
                )
            raise inbound.denied(rule, wait)
        order = [cands[int(i) - 1] for i in result[6:]]
        if status == 2:
            wait = int(result[1])
            self.retry_after_ms = wait if wait >= 0 else None
            return None, None, provider_limits.NOTHING_HELD, []
        chosen = int(result[1]) - 1
        position = int(result[2])
        held = provider_limits.Held(int(result[3]), int(result[4]), int(result[5]))
        return cands[chosen], plans[chosen].reservation(), held, order[position:]

    def start(self, inbound: ratelimit.Plan, held_gen: str = "") -> Picks:
        # Even without candidates the script runs: it checks the inbound limit and the catalog generation.
        self._first = self._decide(self._candidates, self._policy.key_selection, inbound, held_gen)
        self.inbound = inbound.reservation() if inbound.rules else ratelimit.Reservation([])
        return self

    def __iter__(self):
        if self._first is None:
            return
        cand, tier, held, rest = self._first
        picked = 0
        while cand is not None:
            self.held = held
            yield cand, tier
            picked += 1
            if picked >= self._max or not rest:
                return
            cand, tier, held, rest = self._decide(rest, KeySelection.PRIORITIZED, None)


# The meters of a configured limit that count tokens: a request's tokens are estimated for them.
_TOKEN_METERS = frozenset({Meter.TOKENS, Meter.TOKENS_INPUT, Meter.TOKENS_OUTPUT})
# Keys this process saw a learned token quota on (the pick's status 4): estimated up front from then on.
_token_metered: set[str] = set()
_MAX_TOKEN_METERED = 10_000


_SUCCESS_LUA = (
    ratelimit._LUA_COMMON
    + ratelimit._SETTLE_FN_LUA
    + provider_limits.SETTLE_FN_LUA
    + """
-- ARGV: n reservation keys, whether the provider's quotas settle too, then the reservations' 3 values
-- each, then the quota settle's values. KEYS: the breaker's 3, the reservations', the quota's 5.
local n = tonumber(ARGV[1])
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
settle_keys(3, 2, n, now_ms())
if ARGV[2] == '1' then quota_settle(3 + n, 2 + 3 * n) end
return 1
"""
)


def settle_success(
    key_hash: str, reservations, *, input_tokens: int = 0, output_tokens: int = 0, quota: list | None = None
) -> None:
    """A call with the key succeeded, in ONE round trip: the key's breaker closes and the
    principals' failure scores clear (as `breaker.record_success`), every reservation commits the
    observed tokens (as `Reservation.commit`; one already settled is left alone), and `quota`
    (`provider_limits.settle_args`: what the provider said, what the pick held back) settles."""
    charges = ratelimit.Reservation.charges(input_tokens, output_tokens)
    keys, args = list(breaker.success_keys(key_hash)), []
    for reservation in reservations:
        k, a = reservation.take_settle(charges)
        keys += k
        args += a
    head = [len(keys) - 3, "1" if quota is not None else "0"]
    if quota is not None:
        keys += provider_limits.keys(key_hash)
        args += quota
    # Nobody waits for its answer: in a batch slot (`lua.deferring`) it travels with the next pick.
    lua.run_later(_SUCCESS_LUA, keys, head + args)


def pick(
    policy,
    candidates: list,
    *,
    max_picks: int,
    catalog_gen: str = "",
    source: str = "live",
    need: Tokens | Callable[[], Tokens] | None = None,
) -> Picks:
    """The inbound limit of `policy` and its first usable key, in one Redis round trip.

    Raises `ratelimit.RateLimited` when the inbound limit is spent (nothing consumed), and
    `catalog.Stale` when `catalog_gen` (the generation the caller routed with; "" skips the
    check) is no longer the one in Redis (nothing consumed either: route again and re-pick).
    `candidates`: objects with `.key` (a HostKey) and `.key_hash`, in declared order. `source`: "live"
    or "batch" (live first: policies.livefirst). `need`: the request's worst case in tokens, taken from
    the keys' learned token quotas (usage.tokens.estimate); a function returning it is called only where a
    token limit of the policy's or a key's, or a key's learned token quota, meters tokens."""
    inbound = ratelimit.plan(f"policy:{policy.id}", policy.rate_limit, subject=f"policy {policy.name}")
    return Picks(policy, candidates, max_picks, source, need).start(inbound, catalog_gen)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
