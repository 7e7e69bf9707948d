"""Items at a provider (`delegated`, batches/provider/): their moves out of that state, each fenced on the item
still being delegated to the job that moves it, so a job's results read twice (a restart mid-way) or a job
stopped twice write nothing twice.

    delegated ──results──▶ completed | discarded | cancelled
        └──back to the relay's workers (auto mode, a changed catalog)──▶ available
"""

import logging

from django.db import connection
from django.utils import timezone

from batches.lifecycle.states import St
from batches.models import Item
from batches.outcomes import Code

log = logging.getLogger(__name__)

# Every column a record's result sets (the same for every outcome, so one statement serves a chunk).
RESULT_COLUMNS = ("state", "result_ref", "status_code", "error", "error_body", "error_code", "placement")
_FINAL_OR_BACK = {St.COMPLETED, St.DISCARDED, St.CANCELLED, St.AVAILABLE}

_RESULTS_SQL = """
UPDATE batches_item AS i SET state = v.state, result_ref = v.result_ref, status_code = v.status_code,
       error = v.error, error_body = v.error_body, error_code = v.error_code::relay_error_code,
       placement = v.placement,
       finished_at = CASE WHEN v.state = 'available' THEN NULL ELSE %s END,
       provider_job_id = CASE WHEN v.state = 'available' THEN NULL ELSE i.provider_job_id END
FROM (VALUES {values}) AS v(id, state, result_ref, status_code, error, error_body, error_code, placement)
WHERE i.id = v.id AND i.state = 'delegated' AND i.provider_job_id = %s
RETURNING i.id
"""
_ROW = "(%s::uuid, %s, %s, %s::integer, %s, %s, %s, %s)"


def write_results(job_id, rows: list[tuple]) -> list:
    """Move items of `job_id` to their results: rows of (item id, *RESULT_COLUMNS). Returns the ids moved (an
    item no longer delegated to the job is left alone). One statement on PostgreSQL."""
    if not rows:
        return []
    if any(row[1] not in _FINAL_OR_BACK for row in rows):
        raise ValueError("a delegated item moves to a final state or back to available")
    now = timezone.now()
    if connection.vendor == "postgresql":
        params = [now]
        for row in rows:
            params += row
        params.append(job_id)
        with connection.cursor() as cursor:
            cursor.execute(_RESULTS_SQL.format(values=", ".join([_ROW] * len(rows))), params)
            return [r[0] for r in cursor.fetchall()]
    moved = []
    for item_id, *values in rows:  # SQLite (embedded mode): one fenced UPDATE per item
        fields = dict(zip(RESULT_COLUMNS, values, strict=True))
        back = fields["state"] == St.AVAILABLE
        fields.update(finished_at=None if back else now, **({"provider_job": None} if back else {}))
        if Item.objects.filter(pk=item_id, state=St.DELEGATED, provider_job_id=job_id).update(**fields):
            moved.append(item_id)
    return moved


def back_to_relay(job_id, note: str) -> int:
    """delegated → available for the relay's workers, with the note saying why (`Item.placement`)."""
    return Item.objects.filter(provider_job_id=job_id, state=St.DELEGATED).update(
        state=St.AVAILABLE, provider_job=None, placement=note
    )


def not_sent(batch_id, job_ids: list, note: str) -> int:
    """delegated → available, before any job was saved: the records placed in jobs that will not be opened (too
    few for their API), with the note saying why."""
    return Item.objects.filter(batch_id=batch_id, provider_job_id__in=job_ids, state=St.DELEGATED).update(
        state=St.AVAILABLE, provider_job_id=None, placement=note
    )


def stop_all(job_id, code: str, error: str) -> int:
    """delegated → cancelled (cancel or expiry), as a batch's pending items end."""
    return Item.objects.filter(provider_job_id=job_id, state=St.DELEGATED).update(
        state=St.CANCELLED, finished_at=timezone.now(), error=error, error_code=code
    )


def fail_all(job_id, code: str, error: str, status: int | None, body: str) -> list:
    """delegated → discarded with `code` (the job failed as a whole). Returns the ids; call in a transaction."""
    ids = list(
        Item.objects.filter(provider_job_id=job_id, state=St.DELEGATED).select_for_update().values_list("id", flat=True)
    )
    Item.objects.filter(pk__in=ids, state=St.DELEGATED).update(
        state=St.DISCARDED,
        finished_at=timezone.now(),
        error=error[:1000],
        error_code=code or Code.RELAY_ERROR,
        status_code=status,
        error_body=body,
    )
    return ids
