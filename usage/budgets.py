"""Spend budgets: at most so many USD of billed cost per UTC day or month, per project, team, service
account or policy (docs/budgets.md).

The account of one budget for one period is a `BudgetPeriod` row (spent, reserved), created on first use
(INSERT … ON CONFLICT DO NOTHING). It is only ever changed by single UPDATE statements, so concurrent
spenders are serialized by the database's row lock:

- a batch record **reserves** its worst case with `UPDATE … SET reserved = reserved + w WHERE id = … AND
  spent + reserved + w <= limit` (PostgreSQL re-checks the WHERE on the row it waited for), so reservations
  never take a budget past its limit; the real cost then replaces the reservation (`settle`). The worst case
  is a bound on the record's tokens (usage.tokens.worst_case), so what the records in flight spend stays
  within what they reserved, however many slots reserve at once;
- a live request is **checked** before its call (anything left?) and **charged** after it, so requests in
  flight together may overshoot by their own cost (the issue allows it).

Each reservation is also a `BudgetHold` row with an expiry: a process that dies between reserve and settle
leaves a hold that `reclaim_expired()` gives back (called when a reservation or check finds no room, and
by whoever runs it periodically). A hold outlives any record's deadline (HOLD_TTL), so a live one is
never reclaimed.

Which budgets apply is read on every live request, so the enabled budgets are cached per process and
dropped with the catalog snapshot: budget writes bump the catalog generation (usage.apps), and a process
with no budget at all pays no query for them.
"""

import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, connection, transaction
from django.db.models import F, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from core import catalog
from core.errors import RelayError
from usage.models import SCOPE_KINDS, Budget, BudgetHold, BudgetPeriod, Period, UsageEvent
from usage.pricing import cost_nano_usd, discounted
from usage.tokens import Tokens

log = logging.getLogger(__name__)

NANOS_PER_USD = 1_000_000_000
# A batch record that waits for its budget looks again after at most this long (a raised budget is seen).
BATCH_RECHECK_S = 60.0
# The period rows this process has found, by (budget id, period start): at most this many kept.
_MAX_PERIOD_IDS = 10_000


def hold_ttl() -> timedelta:
    """How long a reservation lives unsettled: well past any record's deadline."""
    return timedelta(seconds=getattr(settings, "RELAY_BATCH_ITEM_DEADLINE_SECONDS", 300) * 2 + 300)


# --- periods --------------------------------------------------------------------------------------


def period_bounds(period: str, now: datetime | None = None) -> tuple[datetime, datetime]:
    """[start, end) of the period containing `now`: the UTC day, or the UTC month from the 1st."""
    now = (now or timezone.now()).astimezone(UTC)
    if period == Period.DAY:
        start = now.replace(hour=0, minute=0, second=0, microsecond=0)
        return start, start + timedelta(days=1)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = start.replace(year=start.year + 1, month=1) if start.month == 12 else start.replace(month=start.month + 1)
    return start, end


# --- money as text --------------------------------------------------------------------------------


def usd_text(nanos: int) -> str:
    """Nano-USD as an exact decimal string with at least two decimals: 100000000000 -> "100.00"."""
    value = Decimal(nanos) / NANOS_PER_USD
    text = format(value.normalize(), "f")
    whole, _, frac = text.partition(".")
    return f"{whole}.{frac.ljust(2, '0')}"


def parse_usd(value) -> int:
    """A USD amount ("100.00", 100, 2.5) as integer nano-USD; ValueError with a clear message if it is not."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float, Decimal)):
        raise ValueError('usd must be an amount in USD such as "100.00"')
    try:
        amount = Decimal(str(value).strip())
    except ArithmeticError:
        raise ValueError(f'usd must be an amount in USD such as "100.00", got {str(value)[:40]!r}') from None
    if not amount.is_finite() or amount < 0:
        raise ValueError(f"usd must not be negative, got {str(value)[:40]!r}")
    nanos = amount * NANOS_PER_USD
    if nanos != nanos.to_integral_value():
        raise ValueError("usd has more precision than 1 nano-USD (9 decimals)")
    if nanos >= 2**63:
        raise ValueError("usd is too large")
    return int(nanos)


# --- the error ------------------------------------------------------------------------------------


class BudgetExceeded(RelayError):
    """A budget governing the caller has nothing left this period: 429 `budget_exceeded` on a live route
    (a RelayError, so it answers in each route's envelope). `retry_after` (seconds) is what a waiting batch
    record waits before it looks again; the Retry-After header says when the period rolls over."""

    def __init__(self, budget: Budget, period_ends_at: datetime, now: datetime | None = None):
        self.budget_name = budget.name
        self.period_ends_at = period_ends_at
        kind, _ = budget.scope
        scope = f"{kind.replace('_', ' ')} {scope_name(budget)}"
        ends = period_ends_at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = (
            f"budget {budget.name} ({scope}: ${usd_text(budget.usd_nanos)} per {budget.period}) is spent "
            f"for this period; it renews at {ends}"
        )
        seconds = max(1, int((period_ends_at - (now or timezone.now())).total_seconds() + 0.999))
        super().__init__(429, "budget_exceeded", message, headers={"Retry-After": seconds})
        self.retry_after = float(min(seconds, BATCH_RECHECK_S))


def scope_name(budget: Budget) -> str:
    kind, _ = budget.scope
    target = getattr(budget, kind)
    if kind == "service_account":
        return f"{target.project.name}/{target.name}"
    return target.name


# --- which budgets apply --------------------------------------------------------------------------


class _Index:
    def __init__(self, budgets: list[Budget]):
        self.by_scope: dict[tuple[str, int], list[Budget]] = {}
        for budget in budgets:
            self.by_scope.setdefault(budget.scope, []).append(budget)


_cache: tuple[object, _Index] | None = None


def _index(fresh: bool = False) -> _Index:
    """The enabled budgets, cached with the catalog snapshot this process holds (no query while nothing was
    written). `fresh`: with the snapshot current in Redis (one round trip), for a batch record's reservation."""
    global _cache
    snap = catalog.current() if fresh else catalog.held()
    cached = _cache
    if snap is not None and cached is not None and cached[0] is snap:
        return cached[1]
    index = _Index(
        list(
            Budget.objects.filter(enabled=True).select_related("project", "team", "service_account__project", "policy")
        )
    )
    if snap is not None:
        _cache = (snap, index)
    return index


def _policy_id(principal, policy) -> int | None:
    if policy is None:
        return principal.policy_id
    return policy if isinstance(policy, int) else getattr(policy, "id", None)


def _scopes(project_id, team_id, principal_kind, principal_id, policy_id) -> list[tuple[str, int]]:
    scopes = [("project", project_id), ("team", team_id), ("policy", policy_id)]
    if principal_kind == "serviceaccount":
        scopes.append(("service_account", principal_id))
    return [(kind, value) for kind, value in scopes if value is not None]


def _for_scopes(scopes, fresh: bool = False) -> list[Budget]:
    index = _index(fresh)
    if not index.by_scope:
        return []
    found = []
    for scope in scopes:
        found.extend(index.by_scope.get(scope, ()))
    return sorted(found, key=lambda b: b.id)


def applicable(principal, policy, *, fresh: bool = False) -> list[Budget]:
    """The enabled budgets governing this caller: its project's, its team's, its service account's and its
    governing policy's (`policy`: a Policy, its id, or None for the principal's own), in id order."""
    return _for_scopes(
        _scopes(
            principal.project_id,
            principal.team_id,
            principal.principal_kind,
            principal.principal_id,
            _policy_id(principal, policy),
        ),
        fresh,
    )


# --- the period rows ------------------------------------------------------------------------------

_period_ids: dict[tuple[int, datetime], int] = {}
_period_lock = threading.Lock()


def _scope_filter(budget: Budget) -> dict:
    kind, value = budget.scope
    if kind == "service_account":
        return {"principal_kind": "serviceaccount", "principal_id": value}
    return {f"{kind}_id": value}


def _baseline(budget: Budget, start: datetime, end: datetime) -> int:
    """What the scope had already spent this period when the budget was made (for the period it was made in;
    later periods start at 0: every cost since is charged as it happens)."""
    if not start <= budget.created_at < end:
        return 0
    total = UsageEvent.objects.filter(ts__gte=start, ts__lt=budget.created_at, **_scope_filter(budget)).aggregate(
        total=Sum(Coalesce("billed_cost_nano_usd", "cost_nano_usd"))
    )["total"]
    return int(total or 0)


def _period_id(budget: Budget, now: datetime) -> int | None:
    """The id of the budget's row for the period containing `now`, made on first use; None when the budget
    is gone (deleted since this process cached it: its costs have nowhere to go)."""
    start, end = period_bounds(budget.period, now)
    key = (budget.id, start)
    found = _period_ids.get(key)
    if found is not None:
        return found
    found = BudgetPeriod.objects.filter(budget_id=budget.id, period_start=start).values_list("id", flat=True).first()
    if found is None:
        if not Budget.objects.filter(pk=budget.id).exists():
            return None  # (its foreign key is checked only at commit: asked first, not left to fail later)
        row = BudgetPeriod(budget_id=budget.id, period_start=start, spent_nanos=_baseline(budget, start, end))
        try:
            with transaction.atomic():  # a savepoint: a caller's own transaction survives a deleted budget
                BudgetPeriod.objects.bulk_create([row], ignore_conflicts=True)  # the first of racing makers wins
        except IntegrityError:
            return None
        found = (
            BudgetPeriod.objects.filter(budget_id=budget.id, period_start=start).values_list("id", flat=True).first()
        )
        if found is None:
            return None
    with _period_lock:
        if len(_period_ids) >= _MAX_PERIOD_IDS:
            _period_ids.clear()
        _period_ids[key] = found
    return found


def _forget_period(budget: Budget, now: datetime) -> None:
    _period_ids.pop((budget.id, period_bounds(budget.period, now)[0]), None)


def _add(deltas: dict[int, list[int]]) -> None:
    """Apply {period id: [spent delta, reserved delta]} in period-id order (one lock order for everyone)."""
    for pid in sorted(deltas):
        spent, reserved = deltas[pid]
        if spent or reserved:
            BudgetPeriod.objects.filter(pk=pid).update(
                spent_nanos=F("spent_nanos") + spent, reserved_nanos=F("reserved_nanos") + reserved
            )


# --- live requests --------------------------------------------------------------------------------


def check(principal, policy) -> None:
    """Raise BudgetExceeded when a budget governing the caller has nothing left this period (a live
    request's pre-check: spent plus what batch records hold reaches the limit)."""
    budgets = applicable(principal, policy)
    if budgets:
        _check(budgets)


def _check(budgets: list[Budget], *, reclaimed: bool = False) -> None:
    now = timezone.now()
    ids = {pid: b for b in budgets if (pid := _period_id(b, now)) is not None}
    rows = BudgetPeriod.objects.filter(pk__in=list(ids)).values_list("id", "spent_nanos", "reserved_nanos")
    found = {pid: (spent, reserved) for pid, spent, reserved in rows}
    for pid, budget in ids.items():
        if pid not in found:  # the budget was deleted since this process cached it
            _forget_period(budget, now)
            continue
        spent, reserved = found[pid]
        if spent + reserved >= budget.usd_nanos:
            if reserved and not reclaimed and reclaim_expired(period_ids=[pid]):
                return _check(budgets, reclaimed=True)
            raise BudgetExceeded(budget, period_bounds(budget.period, now)[1], now)


def charge(principal, policy, billed_nanos: int | None) -> None:
    """Add a live request's billed cost to every budget governing the caller (after its call)."""
    if not billed_nanos:
        return
    budgets = applicable(principal, policy)
    if budgets:
        _charge(budgets, billed_nanos)


def charge_event(event: dict) -> None:
    """`charge` for a usage event's fields (what the live views hold once a request is answered): its
    billed cost (the batch discount's, else the cost) to the budgets of its attribution."""
    billed = event.get("billed_cost_nano_usd")
    if billed is None:
        billed = event.get("cost_nano_usd")
    if not billed:
        return
    scopes = _scopes(
        event.get("project_id"),
        event.get("team_id"),
        event.get("principal_kind"),
        event.get("principal_id"),
        event.get("policy_id"),
    )
    budgets = _for_scopes(scopes)
    if budgets:
        _charge(budgets, billed)


def _charge(budgets: list[Budget], nanos: int, deltas: dict | None = None) -> None:
    now = timezone.now()
    deltas = deltas if deltas is not None else {}
    for budget in budgets:
        pid = _period_id(budget, now)
        if pid is not None:
            deltas.setdefault(pid, [0, 0])[0] += nanos
    if len(deltas) == 1:
        _add(deltas)  # one statement: no transaction round trips on a live request's path
        return
    with transaction.atomic():
        _add(deltas)


# --- batch records --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hold:
    """What `reserve` took: one hold row per budget, and the budgets, charged at `settle`."""

    parts: tuple[tuple[int, int, int], ...]  # (hold id, period id, nanos)
    budgets: tuple[Budget, ...]


class _NoRoom(Exception):
    def __init__(self, budget: Budget, period_id: int):
        super().__init__(budget.name)
        self.budget, self.period_id = budget, period_id


_RESERVE_SQL: list[str] = []


def _reserve_sql() -> str:
    # The limit is read in the statement itself (a raised budget counts at once); the WHERE is re-checked
    # by PostgreSQL on the row version a waiting UPDATE finally gets, so two spenders never both fit.
    if not _RESERVE_SQL:
        qn = connection.ops.quote_name
        period_t, budget_t = qn(BudgetPeriod._meta.db_table), qn(Budget._meta.db_table)
        _RESERVE_SQL.append(
            f"UPDATE {period_t} SET reserved_nanos = reserved_nanos + %s "
            f"WHERE id = %s AND spent_nanos + reserved_nanos < "
            f"(SELECT usd_nanos FROM {budget_t} WHERE id = %s) AND spent_nanos + reserved_nanos + %s <= "
            f"(SELECT usd_nanos FROM {budget_t} WHERE id = %s)"
        )
    return _RESERVE_SQL[0]


def reserve(principal, policy, worst_nanos: int | None) -> Hold | None:
    """Reserve a batch record's worst case on every budget governing the caller, all or none. Raises
    BudgetExceeded when one has no room for it; None when no budget applies. An unknown worst case (an
    unpriced model) reserves 0, which still needs something left."""
    budgets = applicable(principal, policy, fresh=True)
    if not budgets:
        return None
    worst = max(0, int(worst_nanos or 0))
    reclaimed = False
    for _ in range(3):
        now = timezone.now()
        # Found (or made) outside the transaction: a row is made once, for every spender.
        ids = [(b, pid) for b in budgets if (pid := _period_id(b, now)) is not None]
        if not ids:
            return None  # every budget was deleted meanwhile
        try:
            return _reserve_all(ids, worst, now)
        except _NoRoom as exc:
            full = exc.budget
            if not BudgetPeriod.objects.filter(pk=exc.period_id).exists():
                _forget_period(full, now)  # gone (a deleted budget, a rolled-back creation): find it again
                continue
            if not reclaimed and reclaim_expired(period_ids=[exc.period_id]):
                reclaimed = True
                continue
            break
    raise BudgetExceeded(full, period_bounds(full.period, now)[1], now)


def _reserve_all(ids: list[tuple[Budget, int]], worst: int, now: datetime) -> Hold:
    expires_at = now + hold_ttl()
    with transaction.atomic():
        for budget, pid in sorted(ids, key=lambda pair: pair[1]):
            with connection.cursor() as cursor:
                cursor.execute(_reserve_sql(), [worst, pid, budget.id, worst, budget.id])
                if cursor.rowcount != 1:
                    raise _NoRoom(budget, pid)  # rolls back this call's other reservations
        # One INSERT for every budget's hold (PostgreSQL and SQLite 3.35+ hand the ids back).
        holds = BudgetHold.objects.bulk_create(
            [BudgetHold(period_id=pid, nanos=worst, expires_at=expires_at) for _, pid in ids]
        )
    parts = tuple((hold.id, hold.period_id, worst) for hold in holds)
    return Hold(parts=parts, budgets=tuple(b for b, _ in ids))


def settle(hold: Hold | None, billed_nanos: int | None) -> None:
    """The real cost replaces the reservation (None or 0: the reservation is only released). A hold that
    expired and was reclaimed meanwhile is not released twice; its cost is still charged."""
    if hold is None:
        return
    now = timezone.now()
    deltas: dict[int, list[int]] = {}
    if billed_nanos:
        # Charged to the period the cost was incurred in (where the usage event's time falls); the rows are
        # found (or made) before the transaction, like every caller's.
        for budget in hold.budgets:
            pid = _period_id(budget, now)
            if pid is not None:
                deltas.setdefault(pid, [0, 0])[0] += billed_nanos
    with transaction.atomic():
        # The holds still there (one reclaimed meanwhile is gone, and is not released twice): one DELETE.
        ids = [part[0] for part in hold.parts]
        qn = connection.ops.quote_name
        marks = ", ".join(["%s"] * len(ids))
        with connection.cursor() as cursor:
            cursor.execute(f"DELETE FROM {qn(BudgetHold._meta.db_table)} WHERE id IN ({marks}) RETURNING id", ids)
            released = {row[0] for row in cursor.fetchall()}
        for hold_id, pid, nanos in hold.parts:
            if hold_id in released:
                deltas.setdefault(pid, [0, 0])[1] -= nanos
        _add(deltas)


def reclaim_expired(*, period_ids: list[int] | None = None, now: datetime | None = None) -> int:
    """Give back the reservations whose holder never settled them (it died): holds past their expiry.
    Returns how many were reclaimed. Safe to run from several processes at once."""
    now = now or timezone.now()
    with transaction.atomic():
        holds = BudgetHold.objects.filter(expires_at__lte=now)
        if period_ids is not None:
            holds = holds.filter(period_id__in=period_ids)
        if connection.features.has_select_for_update_skip_locked:
            holds = holds.select_for_update(skip_locked=True)
        rows = list(holds.order_by("id").values_list("id", "period_id", "nanos")[:1000])
        if not rows:
            return 0
        deleted = BudgetHold.objects.filter(pk__in=[r[0] for r in rows]).delete()[0]
        deltas: dict[int, list[int]] = {}
        for _, pid, nanos in rows:
            deltas.setdefault(pid, [0, 0])[1] -= nanos
        _add(deltas)
    log.warning("reclaimed %d expired budget reservation(s)", deleted)
    return deleted


def worst_case_nanos(pricing, tokens, *, batch_discount_percent: int = 0) -> int | None:
    """A request's most possible billed cost: its pricing × its worst case in tokens (usage.tokens.worst_case),
    less the batch discount. None when it is unpriced. Its input is priced at the dearer of the input and
    cache-write rates: a prompt that writes the provider's cache is billed at the latter (Anthropic's is
    1.25 or 2 times the input rate)."""
    cost = cost_nano_usd(pricing, tokens)
    if cost is None:
        return None
    if (
        pricing is not None
        and tokens.input
        and (pricing.cache_write_nanos_per_mtok or 0) > (pricing.input_nanos_per_mtok or 0)
    ):
        as_writes = cost_nano_usd(pricing, Tokens(output=tokens.output, cache_write=tokens.input))
        cost = max(cost, as_writes or 0)
    return discounted(cost, batch_discount_percent) if batch_discount_percent else cost


# --- what is left, for the API, the admin and /metrics -------------------------------------------


@dataclass(frozen=True)
class Standing:
    budget: Budget
    period_start: datetime
    period_ends_at: datetime
    spent_nanos: int
    reserved_nanos: int

    @property
    def left_nanos(self) -> int:
        return max(0, self.budget.usd_nanos - self.spent_nanos - self.reserved_nanos)


def standings(budgets: list[Budget], now: datetime | None = None) -> list[Standing]:
    """Each budget's current period (two queries however many; a period not used yet: the baseline)."""
    now = now or timezone.now()
    bounds = {b.id: period_bounds(b.period, now) for b in budgets}
    rows = {}
    if budgets:
        starts = {start for start, _ in bounds.values()}
        for budget_id, start, spent, reserved in BudgetPeriod.objects.filter(
            budget_id__in=list(bounds), period_start__in=starts
        ).values_list("budget_id", "period_start", "spent_nanos", "reserved_nanos"):
            rows[(budget_id, start)] = (spent, reserved)
    result = []
    for budget in budgets:
        start, end = bounds[budget.id]
        spent, reserved = rows.get((budget.id, start)) or (_baseline(budget, start, end), 0)
        result.append(Standing(budget, start, end, spent, reserved))
    return result


def settle_quietly(hold: Hold | None, billed: int | None, request_id: str) -> None:
    """`settle` after a call whose answer stands whatever happens here: a settle that fails leaves the hold
    to expire and be reclaimed (`reclaim_expired`), never the call failed."""
    if hold is None:
        return
    try:
        settle(hold, billed)
    except Exception:
        log.exception("request %s: its spend-budget reservation could not be settled", request_id)


def metric_rows() -> list[tuple[dict, float, float, float]]:
    """(labels, spent USD, reserved USD, limit USD) of each enabled budget's current period, for /metrics."""
    budgets = list(
        Budget.objects.filter(enabled=True).select_related("project", "team", "service_account__project", "policy")
    )
    rows = []
    for s in standings(budgets):
        kind, _ = s.budget.scope
        labels = {"budget": s.budget.name, "scope": kind, "scope_name": scope_name(s.budget), "period": s.budget.period}
        rows.append(
            (
                labels,
                s.spent_nanos / NANOS_PER_USD,
                s.reserved_nanos / NANOS_PER_USD,
                s.budget.usd_nanos / NANOS_PER_USD,
            )
        )
    return rows


__all__ = [
    "SCOPE_KINDS",
    "BudgetExceeded",
    "Hold",
    "applicable",
    "charge",
    "charge_event",
    "check",
    "metric_rows",
    "period_bounds",
    "reclaim_expired",
    "settle_quietly",
    "reserve",
    "settle",
    "standings",
    "worst_case_nanos",
]
