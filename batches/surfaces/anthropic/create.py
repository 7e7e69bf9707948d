"""The Anthropic-compatible batch surface (Message Batches): create. Reads, cancel, delete and results
are in read.py; expiry in batches/lifecycle/stop.py.

Same Batch and Item rows and the same execution path as the other surfaces
(batches/worker/: claim, run, finish, heartbeat; batches/sweeper.py); each request's
`params` is an item whose body goes to `/v1/messages` on an `anthropic` binding,
as a live call would. Unlike the OpenAI surface there is no background
validation and no output file: the requests are checked and stored as items in
the create call (Anthropic answers a malformed batch with a 400), and the
results are read from the items when asked for, streamed as JSONL.

How a batch moves (cancel, expiry, ending) lives in batches/lifecycle/; this
module maps its statuses onto Anthropic's `processing_status`:

    in_progress → in_progress     cancelling → canceling     completed | expired | cancelled → ended

Errors are in Anthropic's envelope: {"type": "error", "error": {"type", "message"}}.
"""

import json
import re
from datetime import timedelta

import uuid6
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from batches import bulk, dispatch, ingest, storage
from batches.errors import invalid_anthropic as invalid
from batches.models import Batch, BatchStatus, Shape, Surface
from batches.provider import jobs, placement
from batches.surfaces import common
from core.auth import Principal
from core.errors import clipped

# Anthropic's rule for a request's custom_id, matched in full (with `$`, "abc\n" passed).
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")
REQUEST_KEYS = {"custom_id", "params"}


# --- create -------------------------------------------------------------------------------------


def create(principal: Principal, submission: ingest.Submission, *, retry_of: Batch | None = None) -> Batch:
    """POST /v1/messages/batches → an `in_progress` batch whose requests are already items.

    Every request is checked first (custom_id, params, duplicates); a bad one is
    a 400 and nothing is stored. The batch waits for capacity and retries
    transient failures like an OpenAI-surface batch, and is billed at the batch
    discount (RELAY_BATCH_DISCOUNT_PERCENT, fixed on the batch). `retry_of`: the
    batch whose failed requests this one re-runs (batches/surfaces/retry.py).
    """
    common.check_access(principal)
    top = submission.top
    unknown = sorted(set(top) - {"requests"})
    if unknown:
        raise invalid(f"{clipped(unknown[0])}: Extra inputs are not permitted")
    if "requests" not in top:
        raise invalid("requests: Field required")
    if not submission.count:
        raise invalid("requests: List should have at least 1 item after validation, not 0")
    max_items = settings.RELAY_BATCH_MAX_ITEMS
    if submission.count > max_items:
        raise invalid(
            f"requests: too many requests: {submission.count}, at most {max_items} per batch (RELAY_BATCH_MAX_ITEMS)"
        )
    batch_id = uuid6.uuid7()
    now = timezone.now()
    writer = storage.input_writer(str(batch_id))
    try:
        with transaction.atomic():
            seen: set[str] = set()
            # Where each request runs (batches/provider/): the batch row is made below, the planner needs
            # only its id and policy now.
            planner = placement.Planner(
                Batch(id=batch_id, surface=Surface.ANTHROPIC, policy_id=principal.policy_id), PATH
            )

            def rows():
                for idx, element in enumerate(submission.elements()):
                    # The element was checked by core.jsonguard when the body was read (batches.ingest).
                    custom_id, params = _request(idx, json.loads(element), seen)
                    data = ingest.dumps(params)
                    yield idx, writer.add(idx, data), custom_id, planner.place(params, len(data))

            bulk.copy_new_items(
                batch_id,
                rows(),
                max_attempts=settings.RELAY_BATCH_MAX_ATTEMPTS,
                stream=not writer.uses_db and not planner.may_query,
            )
            writer.close()
            batch = Batch.objects.create(
                id=batch_id,
                surface=Surface.ANTHROPIC,
                inbound_shape=Shape.ANTHROPIC,  # items route like /v1/messages: an `anthropic` binding
                status=BatchStatus.IN_PROGRESS,
                total_items=submission.count,
                created_at=now,
                in_progress_at=now,
                expires_at=now + timedelta(seconds=settings.RELAY_BATCH_COMPLETION_WINDOW_SECONDS),
                discount_percent=settings.RELAY_BATCH_DISCOUNT_PERCENT,
                # Anthropic's users expect a batch to wait out a busy provider and retry what is transient.
                **common.waiting_and_retrying(),
                retry_of=retry_of,
                **Batch.attribution(principal),
            )
            jobs.hand_off(planner.save())
            if planner.delegated < submission.count:
                transaction.on_commit(dispatch.wake_workers)
    except BaseException:
        writer.discard()
        raise
    return batch


PATH = "/v1/messages"  # what every request of a message batch calls


def _request(idx: int, request, seen: set) -> tuple[str, dict]:
    where = f"requests.{idx}"
    unknown = sorted(set(request) - REQUEST_KEYS)
    if unknown:
        raise invalid(f"{where}.{clipped(unknown[0])}: Extra inputs are not permitted")
    custom_id = request.get("custom_id")
    if custom_id is None:
        raise invalid(f"{where}.custom_id: Field required")
    if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
        raise invalid(f"{where}.custom_id: must be 1 to 64 characters of letters, digits, '_' and '-'")
    if custom_id in seen:
        raise invalid(f"{where}.custom_id: Duplicate custom_id {custom_id!r}; each request needs its own")
    seen.add(custom_id)
    params = request.get("params")
    if params is None:
        raise invalid(f"{where}.params: Field required")
    if not isinstance(params, dict):
        raise invalid(f"{where}.params: Input should be an object (the body of a Messages API request)")
    problem = _params_problem(params)
    if problem:
        raise invalid(f"{where}.params.{problem} (request custom_id {custom_id!r})")
    return custom_id, params


def _params_problem(params: dict) -> str | None:
    """What Anthropic itself refuses when a batch is created: `model`, `max_tokens` and `messages` are
    checked now, so a request missing one is a 400 naming it, not an item that fails later (a missing
    max_tokens reached the provider). The rest of the body is the provider's to judge."""
    model = params.get("model")
    if model is None:
        return "model: Field required"
    if not isinstance(model, str) or not model:
        return "model: Input should be a non-empty string"
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        return "max_tokens: Field required"
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        return "max_tokens: Input should be a valid integer"
    if max_tokens < 1:
        return "max_tokens: Input should be greater than or equal to 1"
    messages = params.get("messages")
    if messages is None:
        return "messages: Field required"
    if not isinstance(messages, list):
        return "messages: Input should be a valid list"
    if not messages:
        return "messages: List should have at least 1 item after validation, not 0"
    return None
