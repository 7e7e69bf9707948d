"""Key selection: the order in which a policy's host keys are tried.

`order()` returns every candidate; the pipeline walks the list, skips keys whose
breaker refuses or whose tier limit is spent, and fails over to the next one.
The cursors live in Redis so every process rotates through the same pool:

    relay:pool_rr:{policy:<id>}               round-robin counter (INCR), TTL 30 days
    relay:pool_lru:{policy:<id>}:<key_hash>   last use in ms of Redis server time, TTL 30 days

The pipeline uses `pick()`: the inbound limit, this order, each key's breaker and tier
limit and the LRU mark in ONE script (one round trip; fail-over costs one more). That
script touches keys under several hash tags (the policy's, each key's breaker, each host
key's limit), so it needs one Redis server, as deployed here, not a Redis Cluster.
"""

from __future__ import annotations

from policies import breaker, lua, provider_limits, ratelimit
from policies.models import KeySelection
from relay import catalog
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


# --- one round trip per decision -----------------------------------------------------------------

# The whole decision of `pick()` in one script: the catalog generation the caller routed
# with, the inbound limit, the pool's order, and for each candidate in that order its breaker
# (half-open probe included), its tier limit and the provider's learned quota
# (policies.provider_limits), until one is usable; that one is marked used (LRU).
#
# ARGV: n_in, selection, probe TTL ms, cursor TTL s, m (candidates), then 4 values per
#   inbound rule, then per candidate: n_tier and 4 values per tier rule; then the quota's
#   provisional window ms and the catalog generation the caller holds ('' = don't check).
# KEYS: n_in inbound keys, the round-robin cursor, then per candidate: breaker state,
#   breaker probe, LRU mark, quota, quota limit, n_tier tier keys; last the catalog generation.
# Returns {3, generation in Redis} when the caller's catalog is stale (nothing consumed: it
#   reloads and decides again); {0, rule, wait ms} when the inbound limit is spent (nothing
#   consumed); {1, candidate, position, order...} when a candidate was taken;
#   {2, soonest wait ms or -1, 0, order...} when none was usable.
_PICK_LUA = (
    ratelimit._LUA_COMMON
    + breaker.ACQUIRE_FN_LUA
    + provider_limits.TAKE_FN_LUA
    + """
local held_gen = ARGV[#ARGV]
if held_gen ~= '' then
  local gen = redis.call('GET', KEYS[#KEYS])
  if gen ~= held_gen then return {3, gen or ''} end
end
local quota_window = ARGV[#ARGV - 1]
local now = now_ms()
local n_in = tonumber(ARGV[1])
local selection = ARGV[2]
local probe_ttl = ARGV[3]
local cursor_ttl = tonumber(ARGV[4])
local m = tonumber(ARGV[5])
local a = 5
if n_in > 0 then
  local worst, wait, apply = check_rules(0, a, n_in, now)
  if worst > 0 then return {0, worst, math.ceil(wait)} end
  for _, fn in ipairs(apply) do fn() end
end
a = a + 4 * n_in
local rr_key = KEYS[n_in + 1]
local cands = {}
local k = n_in + 1
for c = 1, m do
  local nt = tonumber(ARGV[a + 1])
  cands[c] = {
    state = KEYS[k + 1], probe = KEYS[k + 2], lru = KEYS[k + 3], quota = KEYS[k + 4], quota_limit = KEYS[k + 5],
    k0 = k + 5, a0 = a + 1, nt = nt,
  }
  k = k + 5 + nt
  a = a + 1 + 4 * nt
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
    local worst, tier_wait, apply = check_rules(d.k0, d.a0, d.nt, now)
    if worst == 0 then
      -- The provider said this key's window is spent: don't spend a request learning it again.
      tier_wait = quota_take(d.quota, d.quota_limit, quota_window)
      if tier_wait > 0 then worst = -1 end
    end
    if worst == 0 then
      for _, fn in ipairs(apply) do fn() end
      redis.call('SET', d.lru, now, 'EX', cursor_ttl)
      local res = {1, c, pos}
      for _, o in ipairs(order) do res[#res + 1] = o end
      return res
    end
    -- The key's own tier or quota is spent: hand back a probe this call took.
    if ok == 2 then redis.call('DEL', d.probe) end
    wait = tier_wait
  end
  if wait >= 0 and (soonest < 0 or wait < soonest) then soonest = wait end
end
local res = {2, math.ceil(soonest), 0}
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
    as by the per-call functions above. `retry_after_ms`: when no key was usable, the
    soonest a skipped one frees up (None when unknown).
    """

    def __init__(self, policy, candidates: list, max_picks: int):
        self._policy = policy
        self._candidates = list(candidates)
        self._max = max_picks
        self._first = None
        self.inbound = ratelimit.Reservation([])
        self.retry_after_ms: int | None = None

    def _tier_plan(self, cand) -> ratelimit.Plan:
        key = cand.key
        return ratelimit.plan(f"hostkey:{key.id}", key.rate_limit, subject=f"host key {key.name}")

    def _decide(self, cands: list, selection: str, inbound: ratelimit.Plan | None, held_gen: str = ""):
        """One round trip. Returns (candidate, tier reservation, remaining candidates in order)."""
        policy_id = self._policy.id
        n_in = len(inbound.rules) if inbound is not None else 0
        plans = [self._tier_plan(c) for c in cands]
        keys = list(inbound.keys) if n_in else []
        keys.append(_rr_key(policy_id))
        args = [n_in, selection, breaker.PROBE_TTL_MS, CURSOR_TTL_S, len(cands)]
        if n_in:
            args += inbound.args
        for cand, p in zip(cands, plans, strict=True):
            keys += [*breaker._keys(cand.key_hash), _lru_key(policy_id, cand.key_hash)]
            keys += [*provider_limits.keys(cand.key_hash), *p.keys]
            args += [len(p.rules), *p.args]
        keys.append(catalog.GEN_KEY)
        args += [provider_limits.PROVISIONAL_WINDOW_MS, held_gen]
        result = lua.run(_PICK_LUA, keys, args)
        status = int(result[0])
        if status == 3:
            raise catalog.Stale(_text(result[1]))
        if status == 0:
            raise inbound.denied(int(result[1]), int(result[2]))
        order = [cands[int(i) - 1] for i in result[3:]]
        if status == 2:
            wait = int(result[1])
            self.retry_after_ms = wait if wait >= 0 else None
            return None, None, []
        chosen = int(result[1]) - 1
        position = int(result[2])
        return cands[chosen], plans[chosen].reservation(), order[position:]

    def start(self, inbound: ratelimit.Plan, held_gen: str = "") -> Picks:
        # Even without candidates the script runs: it checks the inbound limit and the catalog generation.
        self._first = self._decide(self._candidates, self._policy.key_selection, inbound, held_gen)
        self.inbound = inbound.reservation() if inbound.rules else ratelimit.Reservation([])
        return self

    def __iter__(self):
        if self._first is None:
            return
        cand, tier, rest = self._first
        picked = 0
        while cand is not None:
            yield cand, tier
            picked += 1
            if picked >= self._max or not rest:
                return
            cand, tier, rest = self._decide(rest, KeySelection.PRIORITIZED, None)


_SUCCESS_LUA = (
    ratelimit._LUA_COMMON
    + ratelimit._SETTLE_FN_LUA
    + """
redis.call('DEL', KEYS[1], KEYS[2])
settle_keys(2, 0, #KEYS - 2, now_ms())
return 1
"""
)


def settle_success(key_hash: str, reservations, *, input_tokens: int = 0, output_tokens: int = 0) -> None:
    """A call with the key succeeded, in ONE round trip: the key's breaker closes (as
    `breaker.record_success`) and every reservation commits the observed tokens (as
    `Reservation.commit`; one already settled is left alone)."""
    charges = ratelimit.Reservation.charges(input_tokens, output_tokens)
    keys, args = list(breaker._keys(key_hash)), []
    for reservation in reservations:
        k, a = reservation.take_settle(charges)
        keys += k
        args += a
    # Nobody waits for its answer: in a batch slot (`lua.deferring`) it travels with the next pick.
    lua.run_later(_SUCCESS_LUA, keys, args)


def pick(policy, candidates: list, *, max_picks: int, catalog_gen: str = "") -> Picks:
    """The inbound limit of `policy` and its first usable key, in one Redis round trip.

    Raises `ratelimit.RateLimited` when the inbound limit is spent (nothing consumed), and
    `catalog.Stale` when `catalog_gen` (the generation the caller routed with; "" skips the
    check) is no longer the one in Redis (nothing consumed either: route again and re-pick).
    `candidates`: objects with `.key` (a HostKey) and `.key_hash`, in declared order."""
    inbound = ratelimit.plan(f"policy:{policy.id}", policy.rate_limit, subject=f"policy {policy.name}")
    return Picks(policy, candidates, max_picks).start(inbound, catalog_gen)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")
