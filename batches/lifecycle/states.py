"""Batch and item states: the transition tables, the named groups, and the two primitives every
state change is made with (`move`, `lock`). Every change of `Batch.status` or `Item.state` is made by
a module of this package; other modules ask them (inserting new rows aside: a batch is created in its
first status, items in `available`, or `discarded` for a record validation refused).

Relay-native batch (decision 0003)::

    queued ──first claim──▶ running ──last item final──▶ completed
       └──────────┴──cancel──▶ cancelled (completed_at once its last running item stops)

OpenAI-surface batch (decision 0005)::

    validating ──▶ in_progress ──▶ finalizing ──▶ completed | expired
        │  └──▶ failed               ▲
        ├──────────┴──window closed──┘
        └──────────┴──cancel──▶ cancelling ──▶ cancelled

Anthropic-surface batch (Message Batches)::

    in_progress ──last item final──▶ completed | expired   (expired once the window closed: expired_at)
        └──cancel──▶ cancelling ──last item final──▶ cancelled

Item::

    available ──claim──▶ running ──finish──▶ completed | discarded | cancelled
        │                   └──lease expired / wait / retry──▶ available
        └──cancel / expiry──▶ cancelled
    delegated ──provider job's results──▶ completed | discarded | cancelled   (batches/provider/)
        └──back to the relay (auto mode)──▶ available

A move is one conditional UPDATE whose WHERE names the statuses the table
allows it from, so two processes racing for the same move cannot both make
it, and a move the table does not allow is refused before it reaches SQL.


The per-surface status sets and the claimable statuses are defined in batches/models.py, where the
database's constraints are built from them (docs/decisions/0015-engine-rooms.md); the tables here are
checked against them when this module loads.
"""

from collections.abc import Callable, Iterable

from django.db import connection, transaction
from django.db.models import Q
from django.utils import timezone

from batches.models import (
    ANTHROPIC_STATUS_STAMP,
    ANTHROPIC_STATUSES,
    CLAIMABLE_STATUSES,
    NATIVE_STATUSES,
    OPENAI_STATUS_STAMP,
    OPENAI_STATUSES,
    Batch,
    BatchStatus,
    ItemState,
    Surface,
)

S, St = BatchStatus, ItemState

# --- the transition tables ----------------------------------------------------------------------

NATIVE_TRANSITIONS: dict[str, frozenset] = {
    S.QUEUED: frozenset({S.RUNNING, S.COMPLETED, S.CANCELLED}),
    S.RUNNING: frozenset({S.COMPLETED, S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.CANCELLED: frozenset(),
}
OPENAI_TRANSITIONS: dict[str, frozenset] = {
    S.VALIDATING: frozenset({S.IN_PROGRESS, S.FAILED, S.CANCELLING, S.FINALIZING}),
    S.IN_PROGRESS: frozenset({S.FINALIZING, S.CANCELLING}),
    S.FINALIZING: frozenset({S.COMPLETED, S.EXPIRED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}
# No validation or finalizing step: items are stored at create and results are read from them.
ANTHROPIC_TRANSITIONS: dict[str, frozenset] = {
    S.IN_PROGRESS: frozenset({S.COMPLETED, S.EXPIRED, S.CANCELLING}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.COMPLETED: frozenset(),
    S.EXPIRED: frozenset(),
    S.CANCELLED: frozenset(),
}
TRANSITIONS = {
    Surface.NATIVE: NATIVE_TRANSITIONS,
    Surface.OPENAI: OPENAI_TRANSITIONS,
    Surface.ANTHROPIC: ANTHROPIC_TRANSITIONS,
}

ITEM_TRANSITIONS: dict[str, frozenset] = {
    St.AVAILABLE: frozenset({St.RUNNING, St.CANCELLED}),
    St.RUNNING: frozenset({St.AVAILABLE, St.COMPLETED, St.DISCARDED, St.CANCELLED}),
    # At the provider (batches/provider/): its results end it, or (auto mode) it comes back to the relay.
    St.DELEGATED: frozenset({St.AVAILABLE, St.COMPLETED, St.DISCARDED, St.CANCELLED}),
    St.COMPLETED: frozenset(),
    St.DISCARDED: frozenset(),
    St.CANCELLED: frozenset(),
}

# --- named groups -------------------------------------------------------------------------------

# Statuses with work still to come, per surface (a native batch that is `cancelled`
# may still have running items; it is done once completed_at is set).
OPEN = {
    Surface.NATIVE: (S.QUEUED, S.RUNNING),
    Surface.OPENAI: (S.VALIDATING, S.IN_PROGRESS, S.FINALIZING, S.CANCELLING),
    Surface.ANTHROPIC: (S.IN_PROGRESS, S.CANCELLING),
}
TERMINAL = (S.COMPLETED, S.CANCELLED, S.FAILED, S.EXPIRED)
# Batches whose available items a worker may claim (a validating OpenAI batch has no
# items yet; a cancelling or finalizing one starts no new work). Defined in models,
# where an index condition needs it.
CLAIMABLE = CLAIMABLE_STATUSES

# OpenAI batches that cancel or expiry may still stop.
OPENAI_STOPPABLE = (S.VALIDATING, S.IN_PROGRESS)
NATIVE_STAMP = {S.COMPLETED: "completed_at"}
STAMPS = {Surface.NATIVE: NATIVE_STAMP, Surface.OPENAI: OPENAI_STATUS_STAMP, Surface.ANTHROPIC: ANTHROPIC_STATUS_STAMP}
# Anthropic's processing_status of each status: `ended` once every request has a result.
ANTHROPIC_PROCESSING_STATUS = {
    S.IN_PROGRESS: "in_progress",
    S.CANCELLING: "canceling",
    S.COMPLETED: "ended",
    S.EXPIRED: "ended",
    S.CANCELLED: "ended",
}
ANTHROPIC_ENDED = (S.COMPLETED, S.EXPIRED, S.CANCELLED)

# The claimable statuses as SQL (the claim's and the wake-ups' raw statements).
CLAIMABLE_SQL = ", ".join(f"'{s}'" for s in CLAIMABLE)

# The tables cover exactly the statuses the database allows per surface (batches/models.py).
_ALLOWED = {Surface.NATIVE: NATIVE_STATUSES, Surface.OPENAI: OPENAI_STATUSES, Surface.ANTHROPIC: ANTHROPIC_STATUSES}
assert all(set(TRANSITIONS[surface]) == set(statuses) for surface, statuses in _ALLOWED.items())


class IllegalTransition(Exception):
    """A move the transition table does not allow (a programming error, never a client's)."""


def sources(surface: str, to: str, frm: Iterable[str] | None = None) -> list[str]:
    """The statuses a batch of `surface` may move to `to` from (limited to `frm` when given)."""
    allowed = [s for s, targets in TRANSITIONS[surface].items() if to in targets]
    if frm is not None:
        wanted = set(frm)
        allowed = [s for s in allowed if s in wanted]
    if not allowed:
        raise IllegalTransition(f"{surface} batch: no move to {to!r} from {sorted(frm) if frm else 'anywhere'}")
    return allowed


def move(batch_id, surface: str, to: str, *, frm: Iterable[str] | None = None, **fields) -> bool:
    """Move a batch to `to` if it is in a status the table allows (and `frm` names). True if it moved.

    The status's timestamp is stamped unless the caller passes it (OpenAI:
    in_progress_at, finalizing_at, …; native: completed_at; Anthropic: cancelling_at, completed_at).
    A move into a final status runs the end hooks (`on_end`) inside its transaction.
    """
    allowed = sources(surface, to, frm)
    stamp = STAMPS[surface].get(to)
    if stamp and stamp not in fields:
        fields[stamp] = timezone.now()
    rows = Batch.objects.filter(pk=batch_id, surface=surface, status__in=allowed)
    if to not in TERMINAL or not END_HOOKS:
        return rows.update(status=to, **fields) > 0
    # What the end hooks will write is looked up first (one statement): when nothing is (no webhook endpoint
    # subscribed), the move stays one statement. Otherwise their writes commit with the move or not at all (no
    # savepoint of its own inside a caller's transaction; a transaction of its own outside one).
    writers = [writer for hook in END_HOOKS if (writer := hook(batch_id, surface, to)) is not None]
    if not writers:
        return rows.update(status=to, **fields) > 0
    with transaction.atomic(savepoint=False):
        if not rows.update(status=to, **fields):
            return False
        for write in writers:
            write()
    return True


# Called as hook(batch_id, surface, status) before every move into a final status: None when it has nothing
# to write, else a function run inside the move's transaction: writes that must commit with a batch's end or
# not at all (the webhook outbox, batches/webhooks/outbox.py). Registered at start-up by the app that needs
# it (its AppConfig.ready), so this module imports none of them.
END_HOOKS: list[Callable[[object, str, str], Callable[[], None] | None]] = []


def on_end(hook: Callable[[object, str, str], Callable[[], None] | None]) -> None:
    """Register `hook` for every final move (once, however often it is registered)."""
    if hook not in END_HOOKS:
        END_HOOKS.append(hook)


# Validation and finalization do file work between statements while they hold their batch's row:
# the session-wide idle-in-transaction timeout (meant for a frozen process) would kill a large one.
LONG_TRANSACTION_IDLE_MS = 10 * 60 * 1000


def allow_long_transaction() -> None:
    """Inside a control job's transaction: let it idle between statements for up to 10 minutes."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"SET LOCAL idle_in_transaction_session_timeout = {LONG_TRANSACTION_IDLE_MS}")


def lock(batch_id, surface: str, statuses: Iterable[str]) -> Batch | None:
    """The batch, row-locked, if it is in one of `statuses`; None if not, or if another process holds it.

    Call inside a transaction. SKIP LOCKED: control work never waits on a row
    another process holds; the holder is doing the same job, or the next sweep retries.
    """
    qs = Batch.objects.filter(pk=batch_id, surface=surface, status__in=list(statuses))
    if connection.vendor == "postgresql":
        qs = qs.select_for_update(skip_locked=True)
    return qs.first()


def due(now) -> Q:
    """Rows (items or batches) whose `not_before` has passed: a claim may take them."""
    return Q(not_before__isnull=True) | Q(not_before__lte=now)
