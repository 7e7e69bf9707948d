"""Circuit breakers per host-key value, shared by every process through Redis.

Breakers are keyed by the hash of the key's value, not its id, so rotating a
host key starts a fresh breaker. The state is one hash per key,

    relay:breaker:{<key_hash>}         state, open_until (ms), step, reason; TTL 24 h
    relay:breaker:{<key_hash>}:probe   held by the single half-open probe (SET NX PX)
    relay:breaker:{<key_hash>}:suspects  principals whose requests the key failed lately
                                       (sorted set: principal -> ms of its last such failure)

and every transition is one Lua script using Redis server time, so processes on
different machines agree on when a cooldown ends.

Tenants are isolated. Every failure class has one line in `RULES` (the one table: live calls, batch
items and provider jobs all score through `record_failure`), which says whom it blames:

- `Blame.PRINCIPAL`: the failure can be the request's doing (a 5xx or a 403 for a prompt the provider
  cannot serve; a read timeout, a reset or a cut answer after the request was sent, for a generation
  that runs long). It is scored against the principal that sent it, and the key's breaker opens for
  everyone only once two or more distinct principals saw one within `SUSPECT_WINDOW_MS`. A success by
  anyone clears the scores. So one tenant whose requests the provider refuses, or answers too slowly,
  never benches a key the others need, however often it tries.
- `Blame.KEY`: the failure cannot be the request's doing (a 401 on the key's credential; a connection
  refused, timed out connecting, a DNS or TLS failure, before any byte of the request left; a long
  429). It opens the key at once, whoever saw it.

A failure reported without a principal (an operator, a test) counts as everyone's.

Cooldowns follow the product: a 401 opens for 60 s, then 300, 900 and 3600 s on repeats; a 403, a
5xx, a network failure after sending or a connect failure backs off 2 s doubling to 60 s; a 429 with
Retry-After over 5 s opens for exactly Retry-After; a shorter 429 changes nothing. Success closes and
resets the step.

When a cooldown ends the breaker is half-open: exactly one caller, across all
processes, gets to probe the key. Its success closes the breaker; its failure
reopens it one step further up the ladder. A failure reported while the breaker
is already open and cooling down (a request that was in flight when it opened)
belongs to the same incident: it may lengthen the cooldown but does not climb the
ladder, so eight concurrent 401s do not jump straight to an hour.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from core.redis import get_redis
from policies import lua

log = logging.getLogger(__name__)

AUTH_LADDER_S = (60, 300, 900, 3600)
BACKOFF_LADDER_S = (2, 4, 8, 16, 32, 60)
# A 429 asking for at most this long is ordinary pacing, not a reason to bench the key.
RATE_LIMIT_SHORT_MAX_S = 5
# Two principals' 5xx/403 failures within this long open the key for everyone (the top of the
# backoff ladder: an incident the breaker would still be backing off from).
SUSPECT_WINDOW_MS = BACKOFF_LADDER_S[-1] * 1000
# A probe that never reports (its process died) frees the key after this long.
PROBE_TTL_MS = 60_000
STATE_TTL_MS = 24 * 3600 * 1000


class Failure(enum.Enum):
    AUTH = "auth"  # upstream 401
    FORBIDDEN = "forbidden"  # upstream 403
    SERVER = "server"  # upstream 5xx
    NETWORK = "network"  # the connection broke after the request was sent: read timeout, reset, cut answer
    RATE_LIMITED = "rate_limited"  # upstream 429
    UNREACHABLE = "unreachable"  # no connection: refused, connect timeout, DNS or TLS failure


class Blame(enum.Enum):
    KEY = "key"  # cannot be the request's doing: the key is benched for everyone at once
    PRINCIPAL = "principal"  # may be the request's doing: scored against the principal that sent it


@dataclass(frozen=True)
class Rule:
    blame: Blame
    reason: str  # the breaker's `reason` while it is open
    ladder: tuple[int, ...]  # cooldowns in seconds, one rung per repeat (a long 429 uses its Retry-After)


# The one classification of failures, for every caller of `record_failure` (live calls, streams, batch
# items, provider jobs). docs/capacity.md shows it with the reasons; tests/test_breaker.py checks they agree.
RULES: dict[Failure, Rule] = {
    # The provider refused the key's credential itself.
    Failure.AUTH: Rule(Blame.KEY, "upstream_auth_failed", AUTH_LADDER_S),
    # No byte of the request left: the host, or the way to it, is down for every caller.
    Failure.UNREACHABLE: Rule(Blame.KEY, "upstream_unreachable", BACKOFF_LADDER_S),
    # The key's quota is spent for every caller until Retry-After (only a long one opens: record_failure).
    Failure.RATE_LIMITED: Rule(Blame.KEY, "upstream_rate_limited", ()),
    # A request the provider cannot serve (a prompt, a model option) answers 5xx every time.
    Failure.SERVER: Rule(Blame.PRINCIPAL, "upstream_server_error", BACKOFF_LADDER_S),
    # A request's content or model can be refused while the key is fine.
    Failure.FORBIDDEN: Rule(Blame.PRINCIPAL, "upstream_forbidden", BACKOFF_LADDER_S),
    # A long generation outlives the read timeout; a request can make the provider drop the connection.
    Failure.NETWORK: Rule(Blame.PRINCIPAL, "upstream_network_error", BACKOFF_LADDER_S),
}

# A call that got no HTTP answer (gateway.upstream.UpstreamError.kind) as a failure class. None: it says
# nothing about the key and scores nobody (the caller's own deadline or cancel; an answer over the
# relay's size limit), and a half-open probe it held is handed back.
TRANSPORT: dict[str, Failure | None] = {
    "unreachable": Failure.UNREACHABLE,
    "network": Failure.NETWORK,
    "timeout": None,
    "cancelled": None,
    "too_large": None,
}

_LUA_NOW = lua.NOW_MS

# The half-open decision as a Lua function, also used by the key pick (policies.keypool.pick).
# Returns 1 (closed: go), 2 (half-open: go, holding the probe) or 0 (refused), and when
# refused the ms until the cooldown ends (-1: another caller holds the probe).
ACQUIRE_FN_LUA = """
local function breaker_acquire(state_key, probe_key, probe_ttl, now)
  local s = redis.call('HMGET', state_key, 'state', 'open_until')
  local state = s[1]
  if not state or state == 'closed' then return 1, 0 end
  if state == 'open' then
    local until_ms = tonumber(s[2])
    if now < until_ms then return 0, until_ms - now end
    redis.call('HSET', state_key, 'state', 'half_open')
  end
  if redis.call('SET', probe_key, '1', 'NX', 'PX', probe_ttl) then return 2, 0 end
  -- Another caller holds the half-open probe: its answer is due within one request; look again then.
  return 0, 1000
end
"""

# KEYS: state, probe. ARGV: probe TTL ms. Returns 1 when the caller may use the key.
_ACQUIRE_LUA = (
    _LUA_NOW
    + ACQUIRE_FN_LUA
    + """
local ok = breaker_acquire(KEYS[1], KEYS[2], ARGV[1], now_ms())
if ok > 0 then return 1 end
return 0
"""
)

# Open (or reopen) a breaker: a fixed cooldown (ms, '' to use the ladder) or the next rung of
# `ladder` (ms). A failure while the breaker is open and cooling down is the same incident: it may
# lengthen the cooldown but does not climb the ladder. Any report frees the probe.
_OPEN_FN_LUA = """
local function breaker_open(state_key, probe_key, reason, fixed, state_ttl, ladder, now)
  local s = redis.call('HMGET', state_key, 'state', 'open_until', 'step')
  local open_until = tonumber(s[2]) or 0
  local step = tonumber(s[3]) or 0
  local cooling = s[1] == 'open' and now < open_until
  local cooldown
  if fixed ~= '' then
    cooldown = tonumber(fixed)
  else
    if cooling then step = math.max(step, 1) else step = step + 1 end
    step = math.min(step, #ladder)
    cooldown = tonumber(ladder[step])
  end
  local fields = {'state', 'open', 'step', step}
  if not cooling or now + cooldown > open_until then
    open_until = now + cooldown
    fields[#fields + 1] = 'open_until'
    fields[#fields + 1] = open_until
    fields[#fields + 1] = 'reason'
    fields[#fields + 1] = reason
  end
  redis.call('HSET', state_key, unpack(fields))
  redis.call('PEXPIRE', state_key, math.max(tonumber(state_ttl), open_until - now))
  redis.call('DEL', probe_key)
end
"""

# KEYS: state, probe. ARGV: reason, fixed cooldown ms ('' to use the ladder),
# state TTL ms, then the ladder in ms.
_FAILURE_LUA = (
    _LUA_NOW
    + _OPEN_FN_LUA
    + """
breaker_open(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3], {unpack(ARGV, 4)}, now_ms())
return 1
"""
)

# A failure that may be the request's rather than the key's, scored against the principal that saw
# it. KEYS: state, probe, suspects. ARGV: principal, window ms, reason, state TTL ms, ladder in ms.
# Returns 1 when the breaker opened (two or more principals within the window), else 0.
_SCORE_LUA = (
    _LUA_NOW
    + _OPEN_FN_LUA
    + """
local now = now_ms()
local window = tonumber(ARGV[2])
redis.call('ZADD', KEYS[3], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
redis.call('PEXPIRE', KEYS[3], window)
if redis.call('ZCARD', KEYS[3]) < 2 then
  -- One principal's failures judge its requests, not the key: a probe it held goes back, so the
  -- next caller (maybe another tenant) answers the question instead.
  redis.call('DEL', KEYS[2])
  return 0
end
breaker_open(KEYS[1], KEYS[2], ARGV[3], '', ARGV[4], {unpack(ARGV, 5)}, now)
return 1
"""
)

# KEYS: state. Returns the stored fields and the server's now (ms).
_SNAPSHOT_LUA = (
    _LUA_NOW
    + """
local s = redis.call('HMGET', KEYS[1], 'state', 'open_until', 'step', 'reason')
return {s[1] or 'closed', s[2] or '', s[3] or '0', s[4] or '', tostring(now_ms())}
"""
)


def _keys(key_hash: str) -> list[str]:
    state = f"relay:breaker:{{{key_hash}}}"
    return [state, f"{state}:probe"]


def success_keys(key_hash: str) -> list[str]:
    """What a success deletes: the state, the probe and the principals' scores."""
    return [*_keys(key_hash), f"relay:breaker:{{{key_hash}}}:suspects"]


def try_acquire(key_hash: str) -> bool:
    """May this caller send a request with the key now?

    True when closed. When half-open, True for exactly one caller: that caller
    holds the probe and MUST report its outcome with `record_success` or
    `record_failure`; otherwise the key stays benched until the probe expires
    (`PROBE_TTL_MS`).
    """
    return bool(lua.run(_ACQUIRE_LUA, _keys(key_hash), [PROBE_TTL_MS]))


def record_success(key_hash: str) -> None:
    """Close the breaker, reset the ladder and clear the principals' scores; frees the probe."""
    # A closed breaker at step 0 is the same as no record at all.
    get_redis().delete(*success_keys(key_hash))


def release_probe(key_hash: str) -> None:
    """Hand back a probe that was acquired but not used (the key's tier limit was
    spent, or the call ended by deadline or cancel, which say nothing about the
    key), so the next caller may probe at once instead of after PROBE_TTL_MS."""
    get_redis().delete(_keys(key_hash)[1])


# Failures that may be the request's fault rather than the key's: scored per principal.
SCORED = frozenset(f for f, rule in RULES.items() if rule.blame is Blame.PRINCIPAL)


def transport_failure(kind: str) -> Failure | None:
    """The failure class of an UpstreamError kind (`TRANSPORT`); an unknown kind is a broken connection."""
    return TRANSPORT.get(kind, Failure.NETWORK)


def record_failure(
    key_hash: str, failure: Failure, retry_after: float | None = None, *, principal: str | None = None
) -> bool:
    """Open (or reopen) the breaker as `RULES` dictates for the failure class. Returns whether it opened.

    `retry_after` is the upstream's Retry-After in seconds; only 429s use it. `principal`
    (`principal_tag()`) is who saw the failure: a failure the request may have caused (`Blame.PRINCIPAL`)
    opens the key only when another principal saw one too within `SUSPECT_WINDOW_MS`. None: nobody in
    particular, it opens at once.
    """
    rule = RULES[failure]
    if rule.blame is Blame.PRINCIPAL and principal is not None:
        args = [principal, SUSPECT_WINDOW_MS, rule.reason, STATE_TTL_MS, *(s * 1000 for s in rule.ladder)]
        return bool(lua.run(_SCORE_LUA, success_keys(key_hash), args))
    if failure is Failure.RATE_LIMITED:
        if retry_after is None or retry_after <= RATE_LIMIT_SHORT_MAX_S:
            return False
        fixed = str(round(retry_after * 1000))
    else:
        fixed = ""
    args = [rule.reason, fixed, STATE_TTL_MS, *(s * 1000 for s in rule.ladder)]
    lua.run(_FAILURE_LUA, _keys(key_hash), args)
    return True


def principal_tag(principal) -> str:
    """The tenant identity a failure is scored against (core.auth.Principal)."""
    return f"{principal.principal_kind}:{principal.principal_id}"


def suspects(key_hash: str) -> list[str]:
    """The principals whose requests the key failed within the window, oldest first (for operators, tests)."""
    r = get_redis()
    sec, usec = r.time()
    since = sec * 1000 + usec // 1000 - SUSPECT_WINDOW_MS
    return [
        m.decode() if isinstance(m, bytes) else m for m in r.zrangebyscore(success_keys(key_hash)[2], since, "+inf")
    ]


def snapshot(key_hash: str) -> dict:
    """The breaker as the next `try_acquire` would see it: an open breaker whose
    cooldown is over reads as half-open. `open_until` is epoch seconds."""
    state, open_until, step, reason, now = lua.run(_SNAPSHOT_LUA, _keys(key_hash)[:1], [])
    until = float(open_until) if open_until else None
    if state == "open" and until is not None and int(now) >= until:
        state = "half_open"
    return {
        "state": state,
        "open_until": until / 1000 if until is not None else None,
        "step": int(step),
        "reason": reason,
    }
