"""Circuit breakers per host-key value, shared by every process through Redis.

Breakers are keyed by the hash of the key's value, not its id, so rotating a
host key starts a fresh breaker. The state is one hash per key,

    relay:breaker:{<key_hash>}         state, open_until (ms), step, reason; TTL 24 h
    relay:breaker:{<key_hash>}:probe   held by the single half-open probe (SET NX PX)

and every transition is one Lua script using Redis server time, so processes on
different machines agree on when a cooldown ends.

Cooldowns follow the product: a 401 opens for 60 s, then 300, 900 and 3600 s on
repeats; a 403, a 5xx or a network error after connecting backs off 2 s doubling
to 60 s; a 429 with Retry-After over 5 s opens for exactly Retry-After; a shorter
429 and a connect/DNS failure change nothing. Success closes and resets the step.

When a cooldown ends the breaker is half-open: exactly one caller, across all
processes, gets to probe the key. Its success closes the breaker; its failure
reopens it one step further up the ladder. A failure reported while the breaker
is already open and cooling down (a request that was in flight when it opened)
belongs to the same incident: it may lengthen the cooldown but does not climb the
ladder, so eight concurrent 401s do not jump straight to an hour.
"""

from __future__ import annotations

import enum

from policies import lua
from relay.redis import get_redis

AUTH_LADDER_S = (60, 300, 900, 3600)
BACKOFF_LADDER_S = (2, 4, 8, 16, 32, 60)
# A 429 asking for at most this long is ordinary pacing, not a reason to bench the key.
RATE_LIMIT_SHORT_MAX_S = 5
# A probe that never reports (its process died) frees the key after this long.
PROBE_TTL_MS = 60_000
STATE_TTL_MS = 24 * 3600 * 1000


class Failure(enum.Enum):
    AUTH = "auth"  # upstream 401
    FORBIDDEN = "forbidden"  # upstream 403
    SERVER = "server"  # upstream 5xx
    NETWORK = "network"  # network error after the connection was made
    RATE_LIMITED = "rate_limited"  # upstream 429
    UNREACHABLE = "unreachable"  # connect, DNS or TLS failure: the key is not at fault


_REASONS = {
    Failure.AUTH: "upstream_auth_failed",
    Failure.FORBIDDEN: "upstream_forbidden",
    Failure.SERVER: "upstream_server_error",
    Failure.NETWORK: "upstream_network_error",
    Failure.RATE_LIMITED: "upstream_rate_limited",
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

# KEYS: state, probe. ARGV: reason, fixed cooldown ms ('' to use the ladder),
# state TTL ms, then the ladder in ms.
_FAILURE_LUA = (
    _LUA_NOW
    + """
local now = now_ms()
local s = redis.call('HMGET', KEYS[1], 'state', 'open_until', 'step')
local open_until = tonumber(s[2]) or 0
local step = tonumber(s[3]) or 0
local cooling = s[1] == 'open' and now < open_until

local cooldown
if ARGV[2] ~= '' then
  cooldown = tonumber(ARGV[2])
else
  local rungs = #ARGV - 3
  if cooling then
    step = math.max(step, 1)
  else
    step = step + 1
  end
  step = math.min(step, rungs)
  cooldown = tonumber(ARGV[3 + step])
end

local fields = {'state', 'open', 'step', step}
if not cooling or now + cooldown > open_until then
  open_until = now + cooldown
  fields[#fields + 1] = 'open_until'
  fields[#fields + 1] = open_until
  fields[#fields + 1] = 'reason'
  fields[#fields + 1] = ARGV[1]
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[3]), open_until - now))
redis.call('DEL', KEYS[2])
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


def try_acquire(key_hash: str) -> bool:
    """May this caller send a request with the key now?

    True when closed. When half-open, True for exactly one caller: that caller
    holds the probe and MUST report its outcome with `record_success` or
    `record_failure`; otherwise the key stays benched until the probe expires
    (`PROBE_TTL_MS`).
    """
    return bool(lua.run(_ACQUIRE_LUA, _keys(key_hash), [PROBE_TTL_MS]))


def record_success(key_hash: str) -> None:
    """Close the breaker and reset the ladder; frees the probe."""
    # A closed breaker at step 0 is the same as no record at all.
    get_redis().delete(*_keys(key_hash))


def release_probe(key_hash: str) -> None:
    """Hand back a probe that was acquired but not used (the key's tier limit was
    spent, or the call ended by deadline or cancel, which say nothing about the
    key), so the next caller may probe at once instead of after PROBE_TTL_MS."""
    get_redis().delete(_keys(key_hash)[1])


def record_failure(key_hash: str, failure: Failure, retry_after: float | None = None) -> None:
    """Open (or reopen) the breaker as the failure class dictates.

    `retry_after` is the upstream's Retry-After in seconds; only 429s use it.
    """
    if failure is Failure.UNREACHABLE:
        return
    if failure is Failure.RATE_LIMITED:
        if retry_after is None or retry_after <= RATE_LIMIT_SHORT_MAX_S:
            return
        fixed, ladder = str(round(retry_after * 1000)), ()
    else:
        fixed, ladder = "", AUTH_LADDER_S if failure is Failure.AUTH else BACKOFF_LADDER_S
    args = [_REASONS[failure], fixed, STATE_TTL_MS, *(s * 1000 for s in ladder)]
    lua.run(_FAILURE_LUA, _keys(key_hash), args)


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
