"""The native surface's reads: a batch (its owner's only), its progress and its results, streamed in
constant memory however large the batch."""

import json
import re
import uuid
from collections.abc import Iterator

from django.db import connection

from batches import storage
from batches.models import Attempt, Batch, Item, ItemState, Surface
from batches.outcomes import Code
from batches.surfaces import common
from core.auth import Principal
from core.errors import RelayError

# A native batch's id as the API hands it out (str(uuid)), matched in full: no braces, urn: prefix,
# whitespace or trailing newline, which uuid.UUID() would take.
_NATIVE_ID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def parse_native_id(value: str) -> uuid.UUID | None:
    return uuid.UUID(value) if isinstance(value, str) and _NATIVE_ID.fullmatch(value) else None


def batch_for_owner(batch_id: str, principal: Principal) -> Batch:
    """The native batch if this caller submitted it; 404 otherwise, so existence is not leaked.

    Ids belong to a surface: a native batch is addressed by its UUID, an
    OpenAI-surface batch only by its batch_<hex> id (openai_batch_for_owner).
    """
    pk = parse_native_id(batch_id)
    qs = common.with_retried_by(common.owned(principal, Surface.NATIVE).filter(pk=pk))
    batch = qs.first() if pk is not None else None
    if batch is None:
        raise RelayError(404, "", "batch not found")
    return batch


def status_head(batch: Batch) -> dict:
    """The spec's status object without its `items` list."""
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
        "counts": common.counts(batch),
        # The batch's opt-in to waiting and retrying, as submitted; null keeps the native contract's
        # fail-at-once (decision 0003).
        "retry": (
            {"max_attempts": batch.max_attempts, "wait_for_capacity": batch.wait_for_capacity}
            if batch.retry_transient or batch.wait_for_capacity
            else None
        ),
        # Re-run what failed (batches/surfaces/retry.py): the batch this one re-runs, and its own retries.
        "retry_of": batch.retry_of_public_id,
        "retried_by": common.retried_by(batch),
    }


def iter_status_json(batch: Batch) -> Iterator[bytes]:
    """The spec's status object; its `items` list (one entry per item, 50,000 at most)
    is streamed in chunks so polling a large batch costs constant memory."""
    head = status_head(batch)
    yield json.dumps(head)[:-1].encode() + b', "items": ['
    # Raw rows from a server-side cursor, 5,000 a time: no ORM row handling per item.
    item = Item._meta
    sql = f'SELECT "idx", "state" FROM "{item.db_table}" WHERE "{item.get_field("batch").column}" = %s'
    first = True
    for rows in _pages(sql, '"idx"', batch, 5000):
        text = ", ".join([f'{{"idx": {idx}, "state": "{state}"}}' for idx, state in rows])
        yield (text if first else ", " + text).encode()
        first = False
    yield b"]}"


def _pages(sql: str, idx: str, batch: Batch, size: int) -> Iterator[list]:
    """Pages of `size` rows of `sql` (a SELECT over one batch's items, `idx` its first column, named `idx` in
    the statement) in idx order, in constant memory: from a server-side cursor, or, behind a transaction
    pooler (which hands each transaction another server connection, so no cursor outlives one), by
    keyset: each page a statement of its own starting after the last idx seen."""
    batch_pk = Batch._meta.pk.get_db_prep_value(batch.pk, connection)
    if not connection.settings_dict.get("DISABLE_SERVER_SIDE_CURSORS"):
        with connection.chunked_cursor() as cursor:
            cursor.execute(f"{sql} ORDER BY {idx}", [batch_pk])
            while rows := cursor.fetchmany(size):
                yield rows
        return
    after = -1
    while True:
        with connection.cursor() as cursor:
            cursor.execute(f"{sql} AND {idx} > %s ORDER BY {idx} LIMIT %s", [batch_pk, after, size])
            rows = cursor.fetchall()
        if rows:
            yield rows
        if len(rows) < size:  # a short page is the last: no statement to learn that the next is empty
            return
        after = rows[-1][0]


# Rows fetched from the server-side cursor at a time, and the size of each chunk handed to the server.
RESULTS_ROWS = 2000
WRITE_CHUNK = 256 * 1024
_DECODER = json.JSONDecoder()


def iter_results_json(batch: Batch) -> Iterator[bytes]:
    """`{"results": [...]}` in item order, in constant memory for any size.

    Raw rows from a server-side cursor (no model instances), the stored bodies
    of each page read at once (storage.read_many), and output handed on in
    WRITE_CHUNK pieces rather than one write per item.
    """
    item, attempt = Item._meta, Attempt._meta
    sql = (
        f'SELECT i."idx", i."state", i."result_ref", i."error", i."error_body", i."status_code", i."error_code", '
        # `attempts`: the tries that went past the relay's own checks (sent to a provider, or lost with their
        # worker), as the item's usage event counts them: an item refused by the policy's own rate limit
        # shows 0, not the one history row its final state wrote.
        f'(SELECT COUNT(*) FROM "{attempt.db_table}" a WHERE a."{attempt.get_field("item").column}" = i."id" '
        "AND (a.host_key_id IS NOT NULL OR a.status_code IS NOT NULL OR a.outcome = 'worker_lost')) "
        f'FROM "{item.db_table}" i WHERE i."{item.get_field("batch").column}" = %s'
    )
    out = [b'{"results":[']
    size, first = 0, True
    completed = ItemState.COMPLETED
    for rows in _pages(sql, 'i."idx"', batch, RESULTS_ROWS):
        refs = [row[2] for row in rows if row[1] == completed and row[2]]
        bodies = iter(storage.read_many(refs)) if refs else iter(())
        for idx, state, result_ref, error, error_body, status_code, error_code, n_attempts in rows:
            piece = (
                (b'{"idx":' if first else b',{"idx":')
                + str(idx).encode()
                + b',"state":'
                + (_STATES.get(state) or json.dumps(state).encode())
            )
            first = False
            if state == completed and result_ref:
                body = next(bodies)
                if isinstance(body, storage.PayloadMissing):
                    piece += b',"error":' + json.dumps(f"batch: load result: {body}").encode()
                elif _is_json(body):  # only valid JSON is spliced in verbatim
                    piece += b',"response":' + body
                else:
                    piece += b',"error":' + json.dumps(f"batch: load result: {_json_error(body)}").encode()
            elif error:
                if _is_transport_failure(error_code, status_code):
                    error = f"{error_code}: {common.failure_message(error)}"
                piece += b',"error":' + json.dumps(error).encode()
                if status_code:
                    piece += b',"status_code":' + str(status_code).encode()
                if error_body:
                    piece += b',"error_body":' + _error_body_json(error_body)
            if n_attempts:
                # Tries that reached a provider (retries and 429 waits included); each is in the attempt history.
                piece += b',"attempts":' + str(n_attempts).encode()
            out.append(piece + b"}")
            size += len(piece)
            if size >= WRITE_CHUNK:
                yield b"".join(out)
                out, size = [], 0
    out.append(b"]}")
    yield b"".join(out)


_STATES = {state: json.dumps(state).encode() for state in ItemState.values}


def _is_transport_failure(code: str, status_code: int | None) -> bool:
    """No HTTP answer came (the provider unreachable, the connection broken after sending): its text starts
    with its code, as the OpenAI and Anthropic surfaces carry the code beside it (`upstream_unreachable: …`),
    so a native client tells the causes apart without parsing sentences. An answer the provider gave keeps
    the spec's `batch item: upstream status N`."""
    return code == Code.UPSTREAM_UNREACHABLE or (code == Code.UPSTREAM_ERROR and not status_code)


def _is_json(body: bytes) -> bool:
    """Whether `body` is one JSON document (what json.loads accepts), checked the fast way first."""
    try:
        text = body.decode()
        _, end = _DECODER.raw_decode(text)
        if end == len(text):
            return True
    except (UnicodeDecodeError, ValueError):
        pass
    try:  # leading/trailing whitespace, another encoding, …: json.loads decides, as before
        json.loads(body)
    except ValueError:
        return False
    return True


def _json_error(body: bytes) -> str:
    try:
        json.loads(body)
    except ValueError as exc:
        return str(exc)
    return "not JSON"


def _error_body_json(text: str) -> bytes:
    """The upstream's error body as JSON when it is JSON, else as a string."""
    try:
        return json.dumps(json.loads(text)).encode()
    except ValueError:
        return json.dumps(text).encode()


def _iso(dt):
    return dt.isoformat().replace("+00:00", "Z") if dt else None


# --- the OpenAI surface -------------------------------------------------------------------
