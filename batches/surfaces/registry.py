"""The batch surfaces, one object each, behind one registry (docs/decisions/0019-surface-objects.md).

A surface is what a client speaks to reach the batch engine (native, OpenAI, Anthropic). Everything that
tells one from another — its id format, its error envelope, its create, how it shows a batch, when a batch
of it is done, how it is cancelled and expired, what a retry of it re-runs, the webhook events it raises —
is one subclass of `BatchSurface`, in the surface's own package (batches/surfaces/<name>/surface.py). The
lifecycle, the sweeper, the views, retry and webhooks look a surface up here and never branch on its name.

A leaf: this module imports only the models and the error envelopes, so the lifecycle (below the surfaces,
docs/decisions/0015-engine-rooms.md) can read it and each surface package (above) can fill it. The
surfaces are installed by the batches app's `ready()` from batches/surfaces/installed.py — the one line a
new surface adds — and `check_complete` refuses to start with a `Surface` choice that has no object.
"""

import logging
import uuid
from collections.abc import Iterator

from django.db.models import Q

from batches.models import Batch, Surface
from core.errors import RelayError

log = logging.getLogger(__name__)


class BatchSurface:
    """One batch surface. A subclass sets `name` and overrides what its surface does differently; the
    defaults are what a surface without that feature does (no expiry, no webhook event, nothing to
    re-dispatch)."""

    name: str = ""  # its `Surface` choice, the `surface` column of its batches
    id_prefix: str = ""  # its public id is prefix + the UUID's hex; "" shows the UUID itself
    access_gated: bool = True  # the credential's policy must grant batch access (Policy.batch_enabled)

    # --- ids ------------------------------------------------------------------------------------

    def public_id(self, pk: uuid.UUID) -> str:
        """The id its clients hold for the row `pk` (as Batch.public_id)."""
        return f"{self.id_prefix}{pk.hex}" if self.id_prefix else str(pk)

    def parse_id(self, text: str) -> uuid.UUID | None:
        """The row id behind one of its ids, matched in full; None for anything else."""
        raise NotImplementedError

    def claims_id(self, text: str) -> bool:
        """Whether an id is in this surface's form, well-formed or not: a route several surfaces share
        answers it in this surface's envelope."""
        return bool(self.id_prefix) and text.startswith(self.id_prefix)

    # --- its API --------------------------------------------------------------------------------

    def error(self, status: int, code: str, message: str) -> RelayError:
        """An error in its own envelope."""
        raise NotImplementedError

    def envelope(self, exc: Exception) -> Exception:
        """An error raised under its routes (a RelayError of the shared parsers or authentication, DRF's own
        APIException) re-shaped into its envelope; anything else as it is."""
        return exc

    def serialize(self, batch: Batch) -> dict:
        """The object its API shows for a batch (the operator's pages show it too)."""
        raise NotImplementedError

    # What its views answer. `base_url` is where the caller reached the surface (…/batches/), for the links an
    # object carries; a body is a dict (JSON) or an iterator of bytes (streamed JSON).

    def find(self, public_id: str, principal) -> Batch:
        """The caller's batch of this surface; its own 404 for anyone else and any other id."""
        raise NotImplementedError

    def answer_page(self, principal, params, base_url: str) -> dict:
        """A page of the caller's batches (GET on its batches route)."""
        raise NotImplementedError

    def answer_created(self, batch: Batch, base_url: str) -> tuple[int, dict]:
        """(status, body) of a create."""
        raise NotImplementedError

    def answer_detail(self, public_id: str, principal, base_url: str) -> dict | Iterator[bytes]:
        raise NotImplementedError

    def answer_cancel(self, public_id: str, principal, base_url: str) -> dict:
        raise NotImplementedError

    def answer_retried(self, retried, base_url: str) -> tuple[int, dict]:
        """(status, body) of a retry (`retried`: batches.surfaces.retry.Retried)."""
        raise NotImplementedError

    # --- the edge (gateway/edge.py `Routes`: what it answers before a view, by path) ----------------

    def edge_error(self, path: str, status: int, code: str, message: str, param: str | None) -> RelayError | None:
        """A refusal of the edge on one of its routes, in its envelope; None for any other path."""
        return None

    def edge_body_limit(self, path: str) -> int | None:
        """The body limit of its routes that have their own; None: the relay's (RELAY_MAX_REQUEST_BYTES)."""
        return None

    def edge_too_large(self, path: str, method: str, limit: int) -> RelayError | None:
        """Its own answer to a body over the limit; None: its envelope's 413."""
        return None

    # --- the lifecycle (its transitions live in batches/lifecycle/stop.py) ------------------------

    # Its batches that may still have to move once no item is pending (the sweeper's net under
    # `all_final`); None: all of them are final.
    unfinished: Q | None = None
    # Its batches whose completion window may still close; None: its batches have no window.
    expirable: Q | None = None

    def all_final(self, batch_id, status: str) -> None:
        """What happens to a batch of it once every item is final."""
        raise NotImplementedError

    def cancel(self, batch: Batch) -> bool:
        """Start cancelling `batch`: False when it had already finished (then it is left as it is)."""
        raise NotImplementedError

    def expire(self, batch_id, now) -> bool:
        """Close a batch's completion window (only for a surface with `expirable`). True if this closed it."""
        raise NotImplementedError

    def redispatch_lost(self, stale) -> int:
        """Re-send the control messages of its batches stuck since before `stale` (their message was lost)."""
        return 0

    def finishes_itself(self, batch_id, status: str, since, stale) -> bool:
        """An unfinished batch of it the sweeper found with no item pending: True when a control task of
        its own ends it (re-sent here when `since`, when it entered `status`, is before `stale`: its message
        was lost); False and the sweeper completes it (stop.complete_if_done)."""
        return False

    # --- re-running what failed (batches/surfaces/retry.py) -------------------------------------------

    not_ended_status: int = 400  # what it answers for a retry its batch's state refuses

    def ended(self, batch: Batch) -> bool:
        raise NotImplementedError

    def still(self, batch: Batch) -> str:
        """How it names a batch that has not ended, for the refusal's message."""
        raise NotImplementedError

    def expired_by_batch(self, batch: Batch) -> bool:
        """Whether every stopped record of this batch was stopped by its expiry."""
        return False

    def retry_element(self, parent: Batch, custom_id: str, body: bytes) -> bytes:
        """One element of the retry's `requests`, from a stored body."""
        raise NotImplementedError

    def retry_top(self, parent: Batch, count: int) -> dict:
        """The retry body's other keys."""
        raise NotImplementedError

    def create(self, principal, submission, *, retry_of: Batch | None = None, idempotency_key: str = "") -> Batch:
        """Its create service."""
        raise NotImplementedError

    def removed_message(self, batch: Batch) -> str:
        """Why a batch whose records retention removed cannot be retried, and where its failures are told."""
        return f"The records of batch {batch.public_id} were removed by retention."

    def nothing_to_retry_message(self, batch: Batch) -> str:
        return f"Batch {batch.public_id} has no failed or expired records: nothing to retry."

    # --- webhooks (batches/webhooks/events.py) ------------------------------------------------------

    events: dict[str, str] = {}  # a final status → the event type it raises
    sample_events: tuple[str, ...] = ()  # the types whose test event shows one of its batches

    def event_data(self, batch_id: uuid.UUID) -> dict:
        return {"id": self.public_id(batch_id)}

    def event_waits_for_batch(self, status: str) -> bool:
        """Whether the event of this final status is sent only once the batch is done (completed_at)."""
        return False


_SURFACES: dict[str, BatchSurface] = {}


def register(surface: BatchSurface) -> None:
    """Install a surface (batches/surfaces/installed.py). Installing the same surface again is a no-op;
    another object under a name already taken is a mistake."""
    if surface.name not in Surface.values:
        raise ValueError(f"surface {surface.name!r} is not a Surface choice (batches/models.py)")
    current = _SURFACES.get(surface.name)
    if current is not None and type(current) is not type(surface):
        raise ValueError(f"surface {surface.name!r} is already {type(current).__name__}")
    _SURFACES[surface.name] = surface


def check_complete() -> None:
    """Every `Surface` choice has its object: a batch row of a surface nobody installed would fail later,
    in the middle of a sweep."""
    missing = sorted(set(Surface.values) - set(_SURFACES))
    if missing:
        raise RuntimeError(f"batch surfaces without an object: {', '.join(missing)} (batches/surfaces/installed.py)")


def get(name: str) -> BatchSurface:
    return _SURFACES[name]


def all_surfaces() -> Iterator[BatchSurface]:
    """The surfaces in their `Surface` order."""
    return (_SURFACES[name] for name in Surface.values if name in _SURFACES)


def find_id(text: str) -> uuid.UUID | None:
    """The row id behind any id a client of any surface holds (the admin's search)."""
    for surface in all_surfaces():
        pk = surface.parse_id(text.strip())
        if pk is not None:
            return pk
    return None


def as_shown(batch: Batch) -> dict:
    """The batch as its own surface's API shows it."""
    return get(batch.surface).serialize(batch)
