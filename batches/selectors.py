"""Batch reads: ownership, progress and results (streamed)."""

import json
from collections.abc import Iterator

from django.db.models import Count

from batches import storage
from batches.models import Batch, Item, ItemState
from relay.auth import Principal
from relay.errors import RelayError


def batch_for_owner(batch_id: str, principal: Principal) -> Batch:
    """The batch if this caller submitted it; 404 otherwise, so existence is not leaked."""
    batch = None
    try:
        batch = Batch.objects.filter(pk=batch_id, owner_hash=principal.owner_hash).first()
    except Exception:  # a malformed id is simply not found
        batch = None
    if batch is None:
        raise RelayError(404, "", "batch not found")
    return batch


def counts(batch: Batch) -> dict:
    rows = Item.objects.filter(batch=batch).values_list("state").annotate(n=Count("id")).order_by()
    return {state: n for state, n in rows}


def status_view(batch: Batch) -> dict:
    return {
        "ID": str(batch.id),
        "RelayKeyHash": batch.owner_hash,
        "PolicyID": str(batch.policy_id or ""),
        "InboundShape": batch.inbound_shape,
        "Status": batch.status,
        "TotalItems": batch.total_items,
        "CreatedAt": _iso(batch.created_at),
        "CompletedAt": _iso(batch.completed_at),
        "ProjectID": str(batch.project_id or ""),
        "TeamID": str(batch.team_id or ""),
        "PrincipalKind": batch.principal_kind,
        "PrincipalID": str(batch.principal_id),
        "CredentialKind": batch.credential_kind,
        "CredentialID": batch.credential_id,
        "counts": counts(batch),
        "items": [
            {"idx": idx, "state": state}
            for idx, state in Item.objects.filter(batch=batch)
            .order_by("idx")
            .values_list("idx", "state")
            .iterator(chunk_size=5000)
        ],
    }


def iter_results_json(batch: Batch) -> Iterator[bytes]:
    """`{"results": [...]}` in item order, one item at a time: constant memory for any size."""
    yield b'{"results":['
    first = True
    rows = (
        Item.objects.filter(batch=batch)
        .order_by("idx")
        .values_list("idx", "state", "result_ref", "error", "error_body", "status_code")
        .iterator(chunk_size=1000)
    )
    for idx, state, result_ref, error, error_body, status_code in rows:
        parts = [b'{"idx":', str(idx).encode(), b',"state":', json.dumps(state).encode()]
        if state == ItemState.COMPLETED and result_ref:
            try:
                body = storage.read(result_ref)
                json.loads(body)  # only valid JSON is spliced in verbatim
                parts += [b',"response":', body]
            except (storage.PayloadMissing, ValueError) as exc:
                parts += [b',"error":', json.dumps(f"batch: load result: {exc}").encode()]
        elif error:
            parts += [b',"error":', json.dumps(error).encode()]
            if status_code:
                parts += [b',"status_code":', str(status_code).encode()]
            if error_body:
                parts += [b',"error_body":', _error_body_json(error_body)]
        parts.append(b"}")
        yield (b"" if first else b",") + b"".join(parts)
        first = False
    yield b"]}"


def _error_body_json(text: str) -> bytes:
    """The upstream's error body as JSON when it is JSON, else as a string."""
    try:
        return json.dumps(json.loads(text)).encode()
    except ValueError:
        return json.dumps(text).encode()


def _iso(dt):
    return dt.isoformat().replace("+00:00", "Z") if dt else None
