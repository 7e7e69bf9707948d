"""Running one claimed item: its credential and policy checked, its input read, the pipeline called
(an OpenAI record with tool calling runs the tool loop), and its result written: a final state with
its usage events and attempt in one statement, or back to `available` to wait or retry
(batches/retrying.py)."""

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from django.conf import settings
from django.db import connection
from django.utils import timezone

from batches import outcomes, retrying, storage
from batches.lifecycle import finish, sql, stop
from batches.models import Attempt, Batch, Item, ItemState, Shape, Surface
from batches.outcomes import Code
from batches.tools import config as tools_config
from batches.tools.loop import run_tool_loop
from batches.worker import waits
from batches.worker.bookkeeper import FinalWrite, Heartbeat
from core import auth, catalog, jsonguard
from core.errors import RelayError
from gateway import pipeline
from policies import selectors as policy_selectors
from usage.services import event_row

log = logging.getLogger(__name__)

SHAPE_PATH = {
    Shape.OPENAI: "/v1/chat/completions",
    Shape.OPENAI_RESPONSES: "/v1/responses",
    Shape.ANTHROPIC: "/v1/messages",
}

_batch_cache: dict = {}


def batch_of(batch_id) -> Batch:
    """The batch of an item. Only fields fixed at submit are read through this
    cache (attribution, shape, endpoint, policy id, discount); state and the
    cancel flag are always read from the database."""
    batch = _batch_cache.get(batch_id)
    if batch is None:
        if len(_batch_cache) >= 256:
            _batch_cache.clear()
        batch = _batch_cache[batch_id] = Batch.objects.get(pk=batch_id)
    return batch


def run_item(item: Item, *, check_done: bool = True, hand_over=None) -> Future | None:
    """Run one claimed item: to a final state, or back to `available` to wait or retry (batches/retrying.py).
    Never raises for item-level failures. `check_done=False`: a final state does not check the batch's
    completion; the caller does (the drain, with a later claim). `hand_over`: where the final write runs
    (the drain's `_hand_over()`); its future is returned. Without it the write is made here, before
    returning."""
    started_at, started = timezone.now(), time.monotonic()
    batch = batch_of(item.batch_id)
    principal = auth.Principal.from_dict(batch.principal)
    deadline = started + settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
    with Heartbeat(item) as hb:
        run = _execute(batch, item, principal, deadline, hb)
    run.started_at = started_at
    outcome = run.outcome

    def end(state: str, **fields) -> Future | None:
        def finish_with(result_ref: str | None) -> bool:
            if result_ref is not None:
                fields["result_ref"] = result_ref
            return _finish(item, state, run=run, check_done=check_done, **fields)

        result = (str(batch.id), str(item.pk), outcome.body) if state == ItemState.COMPLETED else None
        write = FinalWrite(finish_with, result)
        if hand_over is not None:
            write.pairs_with_claim = not check_done  # the bookkeeper may send it with the next claim (_run_pair)
            return hand_over(write)
        write()
        return None

    if hb.stop_reason == "lease_lost":
        log.warning("item %s lost its lease; dropping this attempt's result", item.pk)
        return None
    if hb.stop_reason == "cancelled":
        # Its batch was cancelled or its window closed: this may be the batch's last running record, whose
        # end finalizes the batch. Checked as soon as this write commits, not by this slot's claim after
        # next (which, with every slot busy on long records, comes a whole record later).
        check_done = True
        if run.failure or (outcome and not outcome.ok):
            return end(ItemState.CANCELLED, code=Code.BATCH_CANCELLED, error=stop.CANCELLED_ERROR)
    if run.failure is not None:
        code, error, error_body = run.code, run.failure, ""
    elif outcome.ok:
        return end(ItemState.COMPLETED)
    elif outcome.origin == "upstream":
        code, error = Code.UPSTREAM_ERROR, f"batch item: upstream status {outcome.status}"
        error_body = outcome.body[: pipeline.ERROR_BODY_LIMIT].decode("utf-8", errors="replace")
    else:
        code = outcomes.normalize(outcome.error_kind)
        error = f"batch item: {outcome.error.message}" if outcome.error else "batch item: failed"
        error_body = ""
    status = outcome.status if outcome is not None and outcome.origin == "upstream" else None
    hint = run.wait if run.wait is not None else retrying.wait_hint(outcome)
    decision = retrying.decide(batch, item, code, status, hint)
    if decision.action == retrying.FINISH:
        return end(ItemState.DISCARDED, code=code, error=error, error_body=error_body)
    not_before = timezone.now() + timezone.timedelta(seconds=decision.delay)
    # A wait decided before any provider was called (the policy's own limit, every key benched) is no attempt.
    # (Made here, not handed over: a release is rare, and it schedules a wake-up through the broker.)
    attempt = _attempt(item, run, decision.action, code=code, error=error, error_body=error_body)
    waiting = decision.scope if decision.action == retrying.WAIT else ""
    route = _waiting_route(batch, run) if waiting == retrying.ROUTE else None
    if waiting == retrying.ROUTE and route is None:
        waiting = retrying.BATCH  # every record of the batch goes to that host: the batch waits
    released = finish.release_item(
        item,
        not_before,
        attempt.save if attempt is not None else nothing,
        counts=decision.action == retrying.RETRY,
        # Only a wait every record shares pauses the batch (its policy's limit, its budget, the one host all
        # its records go to); a host's wait in a batch of several holds that host's records (worker/waits.py).
        pause_batch=waiting == retrying.BATCH,
    )
    if released and route is not None:
        _hold_route(batch, item, route, not_before)
    return None


def _waiting_route(batch: Batch, run: "_Run"):
    """(host, policy, snapshot) of a wait for a host's keys, when the batch also has records bound elsewhere;
    None when it concerns the whole batch (all its records go to that host) or cannot be told apart."""
    host = run.host or (run.outcome.event.get("host") if run.outcome is not None else "")
    if not host or not batch.policy_id:
        return None
    snapshot = catalog.held()
    policy = policy_selectors.policy(batch.policy_id, snapshot)
    if policy is None:
        return None
    try:
        if waits.only_host(batch.id, host, policy, snapshot):
            return None
    except Exception:  # the inputs could not be read: wait as a batch, as before holds by host existed
        log.warning("batch %s: could not tell the hosts of its records", batch.id, exc_info=True)
        return None
    return host, policy, snapshot


def _hold_route(batch: Batch, item: Item, route, until) -> None:
    """A wait for the keys of the record's host: remembered for every record bound there, and held by the
    batch's next ones (waits.py)."""
    host, policy, snapshot = route
    waits.remember(batch.policy_id, host, until)
    try:
        waits.hold_route(item, host, until, policy, snapshot)
    except Exception:  # a shortcut only: each record claimed meanwhile learns the wait by itself
        log.warning("batch %s: could not hold the records bound for host %s", batch.id, host, exc_info=True)


def nothing() -> None:
    pass


@dataclass
class _Run:
    """What executing an item came to.

    `failure`/`code`: the item failed (a message and its code from batches.outcomes).
    `events`: the usage events of every model invocation when there were
    several (tool calling); None means "the outcome's own event, if any".
    """

    outcome: pipeline.Outcome | None = None
    failure: str | None = None
    code: str = ""
    events: list[dict] | None = None
    started_at: object = None  # when the attempt began (set by run_item)
    wait: float | None = None  # seconds until the record's host has capacity, when known before the call
    host: str = ""  # the host whose wait it met before the call


class _CredentialGone(RelayError):
    """The item's credential stopped working (found when the key pick had the catalog reloaded)."""

    def __init__(self, exc: RelayError):
        super().__init__(exc.status, Code.CREDENTIAL_INVALID, exc.message)


def _recheck(principal, snapshot):
    """The pipeline's re-check of the credential with a newer catalog (`Call.reauthenticate`)."""
    try:
        auth.recheck(principal, snapshot)
    except RelayError as exc:
        raise _CredentialGone(exc) from exc
    return principal


def _credential_gone(message: str) -> _Run:
    return _Run(failure=f"batch: credential no longer valid: {message}", code=Code.CREDENTIAL_INVALID)


def _policy_gone() -> _Run:
    return _Run(failure="batch: policy_unavailable", code=Code.POLICY_UNAVAILABLE)


def _execute(batch: Batch, item: Item, principal, deadline: float, hb: Heartbeat) -> _Run:
    # The credential and the policy are checked against the catalog this process holds, without a round
    # trip: the key pick confirms its generation, and when it is stale the pipeline routes again with the
    # current catalog and re-checks the credential (`_recheck`); what that finds fails the item as these
    # checks would have (`_unless_gone`). Measured: the per-item read of the generation was ~0.5 ms of a
    # slot's time between two upstream calls.
    snapshot = catalog.held()
    try:
        auth.recheck(principal, snapshot)
    except RelayError as exc:  # AuthError, or the token's project is gone
        return _credential_gone(exc.message)
    policy = policy_selectors.policy(batch.policy_id, snapshot) if batch.policy_id else None
    if policy is None or not policy.enabled:
        return _policy_gone()
    try:
        # A ValueError: NUL, surrogates, depth (decision 0009).
        body = jsonguard.loads(storage.read_input(item.input_ref))
    except storage.PayloadMissing as exc:
        return _Run(failure=f"batch: load input: {exc}", code=Code.INVALID_ITEM)
    except ValueError as exc:
        return _Run(failure=f"batch: load input: stored item is not JSON: {exc}", code=Code.INVALID_ITEM)
    if not isinstance(body, dict):
        return _Run(failure="batch: parse model: item is not a JSON object", code=Code.INVALID_ITEM)
    if body.get("stream") is True:
        return _Run(
            failure="batch: stream is not supported in batch items; the response is stored whole (unset stream)",
            code=Code.STREAMING_UNSUPPORTED,
        )
    # A batch that waits for capacity (a batch that does not still meets the provider, and fails as it answers).
    waited = _host_wait(policy, body, snapshot) if batch.wait_for_capacity else None
    if waited is not None:
        return waited
    path = batch.endpoint or SHAPE_PATH[batch.inbound_shape]  # an OpenAI batch calls its endpoint

    def invoke(model_body: dict, round_no: int) -> pipeline.Outcome:
        return pipeline.dispatch(
            pipeline.Call(
                path=path,
                body=model_body,
                principal=principal,
                source="batch",
                # One usage event per model invocation: the item's id, then id:1, id:2 … per tool round.
                request_id=str(item.pk) if round_no == 0 else f"{item.pk}:{round_no}",
                deadline=deadline,
                cancel=hb.should_stop,
                batch_id=str(batch.id),
                discount_percent=batch.discount_percent,
                # Native items must match their shape's adapter (decision 0003); an OpenAI or Anthropic record
                # routes as the live call to its endpoint would (gateway.adapters.PATH_ADAPTER).
                required_adapter=batch.inbound_shape if batch.surface == Surface.NATIVE else None,
                policy=policy,
                failover_on_server_error=not batch.retry_transient,
                server_error_benches_key=item.retries == 0,
                credential_snapshot=snapshot,
                reauthenticate=lambda snap: _recheck(principal, snap),
            )
        )

    if batch.surface == Surface.OPENAI:
        return _unless_gone(_execute_openai_record(body, item, path, invoke, deadline, hb))
    return _unless_gone(_checked(invoke(body, 0)))


def _host_wait(policy, body: dict, snapshot) -> _Run | None:
    """The record's host is known to be out of capacity (another record met the wait: waits.py): it waits
    too, without a key pick, a provider call or an attempt."""
    host = waits.host_of(policy, body, snapshot)
    until = waits.waiting_until(policy.id, host)
    if until is None:
        return None
    seconds = (until - timezone.now()).total_seconds()
    if seconds <= 0:
        return None
    return _Run(
        failure=f"batch: every host key of {host} is out of capacity for {seconds:.1f}s",
        code=Code.NO_KEYS,
        wait=seconds,
        host=host,
    )


def _unless_gone(run: _Run) -> _Run:
    """The credential or the policy found gone by the pipeline's re-route (see `_execute`): failed as
    the checks before the call fail it. The call was never made (the pick consumed nothing)."""
    error = run.outcome.error if run.outcome is not None else None
    if isinstance(error, _CredentialGone):
        return _credential_gone(error.message)
    if error is not None and error.code in ("no_policy", "policy_disabled"):
        return _policy_gone()
    return run


def _execute_openai_record(body: dict, item: Item, path: str, invoke, deadline: float, hb: Heartbeat) -> _Run:
    """An OpenAI record: the relay-owned `openrelay` key never reaches the model;
    a chat record with `openrelay.tool_config` runs the tool loop (decision 0013)."""
    try:
        model_body, tool_config = tools_config.extract(body)
    except tools_config.ToolError as exc:  # validation catches these first; re-checked for safety
        return _Run(failure=f"batch: {exc.code}: {exc.message}", code=outcomes.normalize(exc.code))
    if tool_config is None or path != "/v1/chat/completions":
        return _checked(invoke(model_body, 0))
    result = run_tool_loop(body, tool_config, item.custom_id, invoke, deadline=deadline, cancel=hb.should_stop)
    events = [o.event for o in result.invocations]
    if result.error is not None:
        return _Run(
            outcome=None,
            failure=f"batch: {result.error.code}: {result.error.message}",
            code=outcomes.normalize(result.error.code),
            events=events,
        )
    run = _checked(result.outcome)
    run.events = events
    return run


def _checked(outcome: pipeline.Outcome) -> _Run:
    if outcome.error is not None and outcome.error.code == "timeout":
        limit = settings.RELAY_BATCH_ITEM_DEADLINE_SECONDS
        return _Run(outcome=outcome, failure=f"batch: item ran longer than {limit:g} seconds", code=Code.TIMEOUT)
    return _Run(outcome=outcome)


def _finish(
    item: Item, state: str, *, run: _Run, code: str = "", error: str = "", check_done: bool = True, **fields
) -> bool:
    """The item's final write and its usage event(s), in one transaction, fenced on the claim."""
    outcome = run.outcome
    batch = batch_of(item.batch_id)

    attempt = _attempt_fields(
        item, run, "finish", code=code, error=error, error_body=fields.get("error_body", ""), always=True
    )

    events = run.events if run.events is not None else ([outcome.event] if outcome is not None else [])
    if not events:
        events = [event_without_dispatch(batch, item.pk, code, error)]
    else:
        # Priced by the pipeline's settle stage (gateway.stages.price): the cost, and billed less the batch's
        # discount (Call.discount_percent).
        events = [dict(event) for event in events]
        last = events[-1]
        if code and not last.get("error_kind"):
            # The item failed after its last invocation answered (a tool failure, say).
            last["error_kind"] = code
            last["error_message"] = error[:500]
    # One statement: the fenced finish, the attempt row and the usage event(s), committed together.
    rows = [sql.fields_row(Attempt, attempt), *(event_row(connection, **event) for event in events)]
    return finish.finish_item_at_once(
        item,
        state,
        rows,
        status_code=outcome.status if outcome is not None and outcome.origin == "upstream" else None,
        error=error[:1000],
        error_code=code,
        check_done=check_done,
        **fields,
    )


def _attempt(item: Item, run: _Run, decision: str, *, code: str, error: str, error_body: str = "", always=False):
    """The Attempt row of this claim; None for one that never reached a provider, unless `always`."""
    fields = _attempt_fields(item, run, decision, code=code, error=error, error_body=error_body, always=always)
    return Attempt(**fields) if fields is not None else None


def _attempt_fields(item: Item, run: _Run, decision: str, *, code: str, error: str, error_body: str, always=False):
    """`_attempt`'s field values (no model instance: the finish writes them as a row of its statement)."""
    event = run.outcome.event if run.outcome is not None else None
    if event is None and run.events:
        event = run.events[-1]
    reached = event is not None and (event.get("host_key_id") is not None or event.get("status"))
    if not reached and not always:
        return None
    now = timezone.now()
    started = run.started_at or now
    status = run.outcome.status if run.outcome is not None and run.outcome.origin == "upstream" else None
    return {
        "item_id": item.pk,
        "number": item.attempt,
        "started_at": started,
        "finished_at": now,
        "duration_ms": max(0, int((now - started).total_seconds() * 1000)),
        "outcome": code or "completed",
        "decision": decision,
        "status_code": status,
        "host_key_id": event.get("host_key_id") if event else None,
        "error": error[:1000],
        "error_body": error_body,
    }


def event_without_dispatch(batch: Batch, item_id, code: str, error: str) -> dict:
    """The usage event of an item that failed before reaching the pipeline."""
    return {
        **batch.event_attribution(),
        "request_id": str(item_id),
        "status": 0,
        "error_kind": code,
        "error_message": error[:500],
    }
