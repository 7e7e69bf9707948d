"""Background validation of an OpenAI-surface batch: its input file's records become items.

Runs once per batch in a Celery task on the control queue
(batches.tasks.validate_openai_batch). The input file is streamed line by line
(one line in memory at a time) and each record is checked:

- structural problems fail the whole batch (`failed`, with OpenAI's
  `errors.data[{code, message, param, line}]`, line numbers 1-based) and store
  nothing: a line that is not a JSON object, a missing/duplicate/non-string
  custom_id, a method other than POST, a url other than the batch's endpoint,
  a body that is not an object, more records than RELAY_BATCH_MAX_ITEMS, an
  empty or unreadable file;
- record-level problems fail only that record (stored as a discarded item, so
  it appears in the error file): `"stream": true` and a bare top-level
  `tool_config` (code tool_config_moved).

Otherwise every record is stored as an item (its body in the payload store,
untouched) in one transaction and the batch moves to `in_progress`.
"""

from dataclasses import dataclass, field

import uuid6
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from batches import bulk, dispatch, ingest, storage
from batches.lifecycle import states, stop
from batches.models import Batch, BatchStatus, File, Item, ItemState, Surface
from batches.provider import jobs, placement
from batches.tools import config as tools_config
from core import jsonguard
from core.errors import quoted
from usage.models import UsageEvent

# Report at most this many problems; a file broken on every line says so soon enough.
MAX_ERRORS = 100
CUSTOM_ID_MAX = Item._meta.get_field("custom_id").max_length
_FLUSH = 2000


class _Rejected(Exception):
    def __init__(self, errors: list[dict]):
        super().__init__(errors)
        self.errors = errors


@dataclass
class _Ingest:
    records: int = 0
    available: int = 0
    model: str = ""
    errors: list[dict] = field(default_factory=list)
    jobs: list = field(default_factory=list)  # provider jobs opened for the delegated records


def _error(code: str, message: str, *, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


def validate(batch_id) -> None:
    """validating → in_progress (items stored) or failed (errors); a no-op for any other status."""
    with transaction.atomic():
        states.allow_long_transaction()  # file work between statements, holding the batch's row
        # Another worker validating it (a re-sent message) holds the row: leave it to them.
        batch = states.lock(batch_id, Surface.OPENAI, [BatchStatus.VALIDATING])
        if batch is None:
            return
        source = File.objects.filter(pk=batch.input_file_id, owner_hash=batch.owner_hash).first()
        if source is None:
            gone = "The input file was deleted before the batch was validated."
            _fail(batch, [_error("file_not_found", gone, param="input_file_id")])
            return
        writer = storage.input_writer(str(batch.id))
        try:
            with transaction.atomic():  # a savepoint: a rejected file leaves no item behind
                result = _ingest(batch, source, writer)
                if result.errors:
                    raise _Rejected(result.errors)
            writer.close()
        except _Rejected as exc:
            writer.discard()
            _fail(batch, exc.errors)
            return
        except BaseException:
            writer.discard()
            raise
        states.move(
            batch.pk,
            Surface.OPENAI,
            BatchStatus.IN_PROGRESS,
            total_items=result.records,
            model=result.model or batch.model,
        )
        if result.available:
            transaction.on_commit(dispatch.wake_workers)
        jobs.hand_off(result.jobs)
    if not result.available and not result.jobs:
        stop.complete_if_done(batch_id)  # every record failed validation: straight to finalizing


def _fail(batch: Batch, errors: list[dict]) -> None:
    states.move(batch.pk, Surface.OPENAI, BatchStatus.FAILED, errors=errors, total_items=0)


def _ingest(batch: Batch, source: File, writer) -> _Ingest:
    result = _Ingest()
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    seen: dict[str, int] = {}  # custom_id → line; bounded by max_items × CUSTOM_ID_MAX
    items: list[dict] = []
    events: list[UsageEvent] = []
    now = timezone.now()
    planner = placement.Planner(batch, batch.endpoint)  # where each record runs (batches/provider/)

    def flush():
        bulk.insert_items(items)
        UsageEvent.objects.bulk_create(events, ignore_conflicts=True)
        items.clear()
        events.clear()

    try:
        for line, raw in storage.iter_lines(source.ref, max_line=ingest.body_limit()):
            if not raw.strip():
                continue  # blank lines (a trailing newline, CRLF files) are not records
            if result.records >= max_items:
                result.errors.append(
                    _error(
                        "too_many_requests",
                        f"The input file has more than {max_items} requests (RELAY_BATCH_MAX_ITEMS).",
                        line=line,
                    )
                )
                break
            record, problem = _check(raw, line, batch.endpoint, seen)
            result.records += 1
            if problem is not None:
                result.errors.append(problem)
                if len(result.errors) >= MAX_ERRORS:
                    break
                continue
            if result.errors:
                continue  # the batch fails: keep checking, store nothing
            body = record["body"]
            if not result.model and isinstance(body.get("model"), str):
                result.model = body["model"][:200]
            idx = result.records - 1
            failure = _record_failure(body, batch.endpoint)
            data = ingest.dumps(body)
            # A new row is inserted in its first state: available (or delegated to a provider job), or
            # discarded for a record refused here.
            item = {
                "id": uuid6.uuid7(),
                "batch_id": batch.id,
                "idx": idx,
                "state": ItemState.AVAILABLE if failure is None else ItemState.DISCARDED,
                "custom_id": record["custom_id"],
                "input_ref": writer.add(idx, data),
                "max_attempts": batch.max_attempts,
            }
            place = planner.place(body, len(data)) if failure is None else None
            if place is not None:
                item["state"], item["provider_job_id"], item["placement"] = place.state, place.job_id, place.note
            if failure is None and item["state"] == ItemState.AVAILABLE:
                result.available += 1
            elif failure is not None:
                item["error_code"], item["error"] = failure
                item["finished_at"] = now
                events.append(_rejected_event(batch, item, body))
            items.append(item)
            if len(items) >= _FLUSH:
                flush()
    except storage.LineTooLong as exc:
        result.errors.append(
            _error("line_too_long", f"Line {exc.line} is longer than {exc.limit} bytes.", line=exc.line)
        )
    except storage.PayloadMissing as exc:
        result.errors.append(
            _error("file_unreadable", f"The input file could not be read: {exc}", param="input_file_id")
        )
    if not result.records and not result.errors:
        result.errors.append(_error("empty_file", "The input file has no requests.", param="input_file_id"))
    if not result.errors and items:
        flush()
    if not result.errors:
        result.jobs = planner.save()
    return result


def _check(raw: bytes, line: int, endpoint: str, seen: dict) -> tuple[dict | None, dict | None]:
    """(record, None) when the line is a well-formed record, else (None, error)."""
    try:
        record = jsonguard.loads(raw)  # NUL, lone surrogates, depth, non-finite numbers: decision 0009
    except jsonguard.JSONGuardError as exc:
        if exc.code == "invalid_json":
            return None, _error("invalid_json_line", f"Line {line} is not valid JSON: {exc}", line=line)
        return None, _error(exc.code, f"Line {line}: {exc.message}.", line=line, param=exc.path or None)
    if not isinstance(record, dict):
        return None, _error("invalid_request", f"Line {line} must be a JSON object (a request record).", line=line)
    custom_id = record.get("custom_id")
    if custom_id is None:
        return None, _error(
            "missing_required_parameter", "Missing required parameter: 'custom_id'.", line=line, param="custom_id"
        )
    if not isinstance(custom_id, str) or not custom_id:
        return None, _error(
            "invalid_custom_id", "'custom_id' must be a non-empty string.", line=line, param="custom_id"
        )
    if len(custom_id) > CUSTOM_ID_MAX:
        return None, _error(
            "invalid_custom_id", f"'custom_id' is longer than {CUSTOM_ID_MAX} characters.", line=line, param="custom_id"
        )
    if custom_id in seen:
        return None, _error(
            "duplicate_custom_id",
            f"The custom_id {quoted(custom_id)} is already used on line {seen[custom_id]}; "
            "custom_id must be unique in a batch.",
            line=line,
            param="custom_id",
        )
    seen[custom_id] = line
    method = record.get("method")
    if method != "POST":
        return None, _error(
            "invalid_method",
            f"Invalid 'method': {quoted(method)}. Only 'POST' is supported.",
            line=line,
            param="method",
        )
    url = record.get("url")
    if url != endpoint:
        return None, _error(
            "mismatched_url",
            f"The 'url' {quoted(url)} does not match the batch's endpoint {endpoint!r}; every record must call it.",
            line=line,
            param="url",
        )
    if not isinstance(record.get("body"), dict):
        return None, _error("invalid_body", "'body' must be a JSON object (the request body).", line=line, param="body")
    return record, None


def _record_failure(body: dict, endpoint: str) -> tuple[str, str] | None:
    """(code, message) when this one record cannot run; the rest of the batch is unaffected."""
    if body.get("stream") is True:
        return "streaming_unsupported", 'Streaming is not supported in batches: remove "stream": true from the body.'
    try:
        _, tool_config = tools_config.extract(body)  # tool_config_moved / invalid_tool_config
    except tools_config.ToolError as exc:
        return exc.code, exc.message
    if tool_config is not None and endpoint != "/v1/chat/completions":
        return (
            tools_config.INVALID_TOOL_CONFIG,
            f"openrelay.tool_config is only for /v1/chat/completions records, not {endpoint}.",
        )
    return None


def _rejected_event(batch: Batch, item: dict, body: dict) -> UsageEvent:
    """One usage event per item, also for records that never reached the pipeline (as on the native surface)."""
    model = body.get("model")
    return UsageEvent(
        **batch.event_attribution(),
        request_id=str(item["id"]),
        status=0,
        error_kind=item["error_code"],
        error_message=item["error"][:500],
        model=model[:200] if isinstance(model, str) else "",
    )
