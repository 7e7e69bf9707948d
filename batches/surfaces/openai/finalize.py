"""Finalization of an OpenAI-surface batch: the output and error files, then the final status.

Runs in a Celery task on the control queue (batches.tasks.finalize_openai_batch)
once every item is final. Items are read in pages of 1,000 by index and each
becomes one JSONL line, written straight to the payload store, so memory stays
constant however large the batch. Every record lands exactly once in one of
the two files, in OpenAI's line shape (BatchRequestOutput):

    success                 {"id": "batch_req_…", "custom_id", "response": {"status_code": 200,
                              "request_id", "body": <the upstream's answer>}, "error": null}   → output file
    upstream HTTP error     the same, with the upstream's status and error body               → error file
    relay-side failure      {"id", "custom_id", "response": null, "error": {"code", "message"}} → error file

`request_id` is the item's id, which is also the request_id of its usage event.
A file with no lines is not created: when every record failed, output_file_id
is null. Files, ids and the final status are written in one transaction.
"""

import uuid6
from django.db import transaction
from django.utils import timezone

from batches import retention, storage
from batches.lifecycle import states
from batches.models import PENDING_STATES, Batch, BatchStatus, File, FilePurpose, Item, ItemState, Surface
from batches.outcomes import Code, openai_code
from batches.surfaces import common
from batches.surfaces.openai.files import owner_columns

EXPIRED_MESSAGE = "This request could not be executed before the completion window expired."
CANCELLED_MESSAGE = "This request was cancelled before it completed."


def finalize(batch_id) -> None:
    """finalizing|cancelling (no pending item) → completed | expired | cancelled, with its files."""
    with transaction.atomic():
        states.allow_long_transaction()  # reads every result between page queries, holding the row
        # Another worker finalizing it holds the row: leave it to them.
        batch = states.lock(batch_id, Surface.OPENAI, [BatchStatus.FINALIZING, BatchStatus.CANCELLING])
        if batch is None:
            return
        if Item.objects.filter(batch_id=batch.pk, state__in=PENDING_STATES).exists():
            return  # cancelling: its running items stop at their next heartbeat, and call us again
        output, errors = _ResultFile(batch, "output"), _ResultFile(batch, "error")
        try:
            for line, failed in result_lines(batch):
                (errors if failed else output).write(line)
            output_id, error_id = output.save(), errors.save()
        except BaseException:
            output.discard()
            errors.discard()
            raise
        if batch.expired_at is not None:
            final = BatchStatus.EXPIRED  # expired_at was stamped when the window closed
        elif batch.status == BatchStatus.CANCELLING:
            final = BatchStatus.CANCELLED
        else:
            final = BatchStatus.COMPLETED
        states.move(batch.pk, Surface.OPENAI, final, output_file_id=output_id, error_file_id=error_id)


class _ResultFile:
    """A batch_output file created on its first line, so an empty one never exists."""

    def __init__(self, batch: Batch, kind: str):
        self.batch, self.kind = batch, kind
        self.id = None
        self.writer = None

    def write(self, line: bytes) -> None:
        if self.writer is None:
            self.id = uuid6.uuid7()
            self.writer = storage.file_writer(str(self.id))
        self.writer.write(line)

    def save(self):
        if self.writer is None:
            return None
        ref = self.writer.close()
        b = self.batch
        now = timezone.now()
        File.objects.create(
            created_at=now,
            expires_at=retention.output_expires_at(b, now),
            id=self.id,
            purpose=FilePurpose.BATCH_OUTPUT,
            filename=f"{b.public_id}_{self.kind}.jsonl",
            bytes=self.writer.size,
            ref=ref,
            batch_id=b.id,
            **owner_columns(b.submitter()),
        )
        return self.id

    def discard(self) -> None:
        if self.writer is not None:
            self.writer.discard()


def result_lines(batch: Batch):
    """(JSONL line, is_error) for every item, in input order, one page in memory at a time."""
    for row in common.result_rows(batch):
        obj, failed = _line(batch, row)
        yield common.jsonl(obj), failed


def _line(batch: Batch, row: dict) -> tuple[dict, bool]:
    item_id = row["id"]
    head = {"id": f"batch_req_{item_id.hex}", "custom_id": row["custom_id"]}
    state = row["state"]
    if state == ItemState.COMPLETED:
        try:
            body = common.stored_json(row)
        except (storage.PayloadMissing, ValueError) as exc:
            return {**head, "response": None, "error": {"code": "result_unavailable", "message": str(exc)}}, True
        response = {"status_code": row["status_code"] or 200, "request_id": str(item_id), "body": body}
        return {**head, "response": response, "error": None}, False
    if state == ItemState.CANCELLED:
        if row["error_code"] == Code.BATCH_EXPIRED or batch.expired_at is not None:
            return {**head, "response": None, "error": {"code": "batch_expired", "message": EXPIRED_MESSAGE}}, True
        return {**head, "response": None, "error": {"code": "batch_cancelled", "message": CANCELLED_MESSAGE}}, True
    if row["error_code"] == Code.UPSTREAM_ERROR:
        # The upstream answered with an HTTP error: its status and (bounded) body, as OpenAI shows them.
        response = {
            "status_code": row["status_code"],
            "request_id": str(item_id),
            "body": common.json_or(row["error_body"], lambda text: text),
        }
        return {**head, "response": response, "error": None}, True
    code = openai_code(row["error_code"])
    return {**head, "response": None, "error": {"code": code, "message": common.failure_message(row["error"])}}, True
