"""What becomes of an item whose attempt did not succeed: finish it, wait for capacity, or retry it.

A busy provider is never a reason to fail an item where the surface's users
expect batches to wait (design §4):

- **wait** — the attempt failed for want of capacity: the policy's inbound
  limit was spent, every host key of the record's host was benched (breaker
  open, tier limit or the provider's reported quota spent), the upstream
  answered 429, or a spend budget of the batch is spent. The item goes back to
  `available` until the capacity is due (`Retry-After`, the limiter's own retry
  time, the earliest breaker probe, the budget's period end; at most an hour)
  and is not claimed again before. Waiting uses up no attempt.
- **retry** — a transient failure: an upstream 5xx, 408 or 409, a network
  error, an unreachable host. The item goes back to `available` after an
  exponential backoff with full jitter and uses up one attempt; after
  `max_attempts` it ends with its last failure.
- **finish** — anything else (a 4xx, a routing or credential refusal, the
  item's deadline, a cancel), or the batch does not opt in.

What a wait holds (`Decision.scope`, docs/batch-waiting.md): a host's keys
(`ROUTE`: no usable key, an upstream 429) hold only the records bound for that
host (batches/worker/waits.py; the whole batch when all its records go there);
the policy's own inbound limit and a spent budget concern every record of the
batch (`BATCH`: the batch waits too).

The OpenAI and Anthropic surfaces wait and retry by default; the native
surface keeps the native contract's (decision 0003) fail-at-once default and
opts in per batch (`"retry": {...}`): a spent budget fails its items with
`budget_exceeded` unless the batch opted in to waiting. A window or deadline
still ends the item: an OpenAI batch expires at its window, and no item waits
past `RELAY_BATCH_MAX_WAIT_SECONDS` after submit.
"""

import logging
import random
from dataclasses import dataclass

from django.conf import settings
from django.utils import timezone

from batches.outcomes import Code
from core.retry_after import parse_retry_after

log = logging.getLogger(__name__)

FINISH, RETRY, WAIT = "finish", "retry", "wait"
# What a wait holds: the records bound for one host (its keys are all benched or answered 429), or the
# whole batch (the policy's inbound limit, a spend budget: every record of the batch counts against them).
ROUTE, BATCH = "route", "batch"

# Relay-side failure codes that mean "no capacity right now".
_CAPACITY_CODES = frozenset({Code.RATE_LIMIT_EXCEEDED, Code.NO_KEYS, Code.BUDGET_EXCEEDED})
# Capacity every record of the batch shares (its policy, its principal's budgets).
_BATCH_WIDE_CODES = frozenset({Code.RATE_LIMIT_EXCEEDED, Code.BUDGET_EXCEEDED})
# Relay-side failure codes that mean "the provider could not be reached or broke off": worth another try.
_TRANSIENT_CODES = frozenset({Code.UPSTREAM_UNREACHABLE, Code.UPSTREAM_UNAVAILABLE, Code.UPSTREAM_ERROR})
_TRANSIENT_STATUSES = frozenset({408, 409})
# When nothing said how long to wait for capacity.
DEFAULT_CAPACITY_WAIT_S = 1.0
# A spent budget frees up when its period ends (up to a month away) or when an operator raises it: a batch
# waiting on one looks again at least this often, so a raised budget is seen within a minute.
BUDGET_RECHECK_S = 60.0


@dataclass(frozen=True)
class Decision:
    action: str  # FINISH | RETRY | WAIT
    delay: float = 0.0  # seconds before the item may be claimed again
    scope: str = ""  # for a WAIT: ROUTE or BATCH


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
    if code == Code.BUDGET_EXCEEDED:
        return "capacity", min(retry_after, BUDGET_RECHECK_S) if retry_after is not None else BUDGET_RECHECK_S
    if code in _CAPACITY_CODES:
        return "capacity", retry_after
    if code in _TRANSIENT_CODES:
        return "transient", None
    return "final", None


def wait_scope(code: str, status_code: int | None) -> str:
    """What a capacity wait holds: BATCH for the policy's own limit and a spent budget, else ROUTE (the
    keys of the record's host: none usable, or every one tried answered 429)."""
    if status_code is None and code in _BATCH_WIDE_CODES:
        return BATCH
    return ROUTE


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
        delay = wait if wait is not None else DEFAULT_CAPACITY_WAIT_S
        return Decision(WAIT, delay, wait_scope(code, status_code))
    if not batch.retry_transient or item.retries + 1 >= item.max_attempts:
        return Decision(FINISH)
    return Decision(RETRY, backoff(item.retries + 1))


def wait_hint(outcome) -> float | None:
    """Seconds until capacity, as the pipeline's outcome says: its `retry_after`, else the Retry-After header of
    the relay's own refusal (a spent budget's answer carries only the header)."""
    if outcome is None:
        return None
    if outcome.retry_after is not None:
        return outcome.retry_after
    error = outcome.error
    headers = getattr(error, "headers", None) if error is not None else None
    if not headers:
        return None
    value = next((v for k, v in headers.items() if str(k).lower() == "retry-after"), None)
    return parse_retry_after(str(value)) if value is not None else None


def _past_max_wait(batch) -> bool:
    waited = (timezone.now() - batch.created_at).total_seconds()
    return waited >= settings.RELAY_BATCH_MAX_WAIT_SECONDS
