"""What becomes of an item whose attempt did not succeed: finish it, wait for capacity, or retry it.

A busy provider is never a reason to fail an item where the surface's users
expect batches to wait (design §4):

- **wait** — the attempt failed for want of capacity: the policy's inbound
  limit was spent, every host key was benched (breaker open, tier limit or the
  provider's reported quota spent), or the upstream answered 429. The item
  goes back to `available` until the capacity is due (`Retry-After`, the
  limiter's own retry time or the earliest breaker probe; at most an hour) and
  the whole batch pauses until then, so its drain settles at what the limits
  allow instead of storming them. Waiting uses up no attempt.
- **retry** — a transient failure: an upstream 5xx, 408 or 409, a network
  error, an unreachable host. The item goes back to `available` after an
  exponential backoff with full jitter and uses up one attempt; after
  `max_attempts` it ends with its last failure.
- **finish** — anything else (a 4xx, a routing or credential refusal, the
  item's deadline, a cancel), or the batch does not opt in.

The OpenAI surface waits and retries by default; the native surface keeps
the native contract's (decision 0003) fail-at-once default and opts in per batch (`"retry": {...}`).
A window or deadline still ends the item: an OpenAI batch expires at its
window, and no item waits past `RELAY_BATCH_MAX_WAIT_SECONDS` after submit.
"""

import random
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from batches.outcomes import Code

FINISH, RETRY, WAIT = "finish", "retry", "wait"

# Relay-side failure codes that mean "no capacity right now".
_CAPACITY_CODES = frozenset({Code.RATE_LIMIT_EXCEEDED, Code.NO_KEYS})
# Relay-side failure codes that mean "the provider could not be reached or broke off": worth another try.
_TRANSIENT_CODES = frozenset({Code.UPSTREAM_UNREACHABLE, Code.UPSTREAM_UNAVAILABLE, Code.UPSTREAM_ERROR})
_TRANSIENT_STATUSES = frozenset({408, 409})
# When nothing said how long to wait for capacity.
DEFAULT_CAPACITY_WAIT_S = 1.0


@dataclass(frozen=True)
class Decision:
    action: str  # FINISH | RETRY | WAIT
    delay: float = 0.0  # seconds before the item may be claimed again


def classify(code: str, status_code: int | None, retry_after: float | None) -> tuple[str, float | None]:
    """("capacity" | "transient" | "final", seconds to wait when known) for a failed attempt."""
    if status_code == 429:
        return "capacity", retry_after
    if status_code is not None:
        if status_code >= 500 or status_code in _TRANSIENT_STATUSES:
            return "transient", None
        return "final", None
    if code == Code.NO_KEYS and retry_after is None:
        return "final", None  # no key at all (none enabled in the pool): waiting changes nothing
    if code in _CAPACITY_CODES:
        return "capacity", retry_after
    if code in _TRANSIENT_CODES:
        return "transient", None
    return "final", None


def backoff(retry_number: int) -> float:
    """Full jitter: uniform in [0, min(cap, base × 2^(n-1))] (the AWS architecture blog's choice)."""
    base, cap = settings.RELAY_BATCH_RETRY_BASE_SECONDS, settings.RELAY_BATCH_RETRY_MAX_SECONDS
    return random.uniform(0, min(cap, base * 2 ** max(0, retry_number - 1)))


def decide(batch, item, code: str, status_code: int | None, retry_after: float | None) -> Decision:
    """What to do with `item` after an attempt that failed with `code` (and the upstream's status, if any)."""
    kind, wait = classify(code, status_code, retry_after)
    if kind == "final" or _past_max_wait(batch):
        return Decision(FINISH)
    if kind == "capacity":
        if not batch.wait_for_capacity:
            return Decision(FINISH)
        return Decision(WAIT, wait if wait is not None else DEFAULT_CAPACITY_WAIT_S)
    if not batch.retry_transient or item.retries + 1 >= item.max_attempts:
        return Decision(FINISH)
    return Decision(RETRY, backoff(item.retries + 1))


def _past_max_wait(batch) -> bool:
    waited = (timezone.now() - batch.created_at).total_seconds()
    return waited >= settings.RELAY_BATCH_MAX_WAIT_SECONDS
