"""The pipeline: the one code path every upstream call takes, live or batch.

Its stages (gateway.stages, each a public function): resolve the route (the grant, the shape, the
credential re-checked) → admit (a batch record's spend-budget reservation) → pick a key (inbound limit,
live-first, breakers, tier limits, provider quotas: one Redis round trip) → call → settle (breakers,
quotas, price, usage event, budget charge), failing over to the next key between call and settle.

`dispatch()` never writes the usage event itself: a live request records it
right away, a batch item records it in the same transaction that finishes the
item (so it is written exactly once with the item's final state).
"""

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core import catalog, scrub
from core.auth import Principal
from core.errors import RelayError
from gateway import adapters, answers, stages, upstream
from gateway.stages import MAX_KEY_ATTEMPTS, Candidate, key_candidates
from policies import breaker, livefirst, provider_limits
from policies.breaker import Failure
from usage.tokens import Tokens, estimate, parse_usage

log = logging.getLogger(__name__)

# Importable from here as before (the pick stage's candidates are gateway.stages').
__all__ = [
    "MAX_KEY_ATTEMPTS",
    "Call",
    "Candidate",
    "Outcome",
    "dispatch",
    "dispatch_stream",
    "finish_stream",
    "key_candidates",
]
ERROR_BODY_LIMIT = 8 * 1024


@dataclass
class Call:
    path: str  # upstream path, e.g. /v1/chat/completions
    body: dict
    principal: Principal
    source: str  # "live" | "batch"
    request_id: str
    deadline: float  # time.monotonic() value
    inbound_headers: dict = field(default_factory=dict)
    cancel: Callable[[], bool] | None = None
    batch_id: str = ""
    # A batch record's discount (percent): what its spend-budget reservation and settle count (usage.budgets).
    discount_percent: int = 0
    # Batch shape gate: the binding's adapter must equal this (None for live).
    required_adapter: str | None = None
    # The governing policy when the caller has loaded it already (a batch item checks it first).
    policy: object | None = None
    # Fail over to the next key when one answers 5xx or the connection breaks after the request was sent
    # (failures the request itself may have caused: `stages.RETRY_QUIET`). A batch item that retries transient
    # failures itself turns this off: its retry comes after a backoff, and one bad (or slow) request no
    # longer tries every key of the pool in one go. (401/403/429 and connect failures always fail over.)
    failover_on_server_error: bool = True
    # Whether such a failure counts against the key's breaker at all. It never benches the key by itself:
    # it scores the call's principal, and the key opens for everyone only when two or more principals saw
    # such failures lately (policies.breaker.RULES), so one tenant's (or one batch's) requests that the
    # provider refuses or answers too slowly cannot bench a key for the others. A batch item that already
    # failed once and fails again is more likely a request the provider cannot serve than a bad key: it
    # does not even score (nor fail a half-open probe).
    server_error_benches_key: bool = True
    # A live request authenticated from the catalog snapshot its process held (core.authentication):
    # that snapshot, and how to authenticate again with another one when the key pick finds it stale.
    credential_snapshot: object | None = None
    reauthenticate: Callable[[object], Principal] | None = None


@dataclass
class Outcome:
    status: int
    body: bytes
    headers: dict
    origin: str  # "relay" | "upstream"
    error: RelayError | None
    error_kind: str
    event: dict  # fields for usage.services.record_event
    # The call failed for want of capacity (the policy's limit, every key benched or spent, an
    # upstream 429): seconds until there should be some, when known. Batch items wait this long.
    retry_after: float | None = None
    # A streamed call whose provider answered 2xx: the stream, still unread (gateway.streaming reads it).
    stream: "Streamed | None" = None

    @property
    def ok(self) -> bool:
        return self.error is None and 200 <= self.status < 300


@dataclass
class Streamed:
    """What a streamed call holds while its body flows: the upstream stream, the key's tier and the
    inbound reservations (charged the stream's tokens at its end), and what its usage event needs."""

    response: upstream.UpstreamStream
    reservations: tuple
    key_hash: str
    started: float
    pricing: object | None
    adapter: str  # the binding's: which provider's events these are
    path: str  # the upstream path
    settled: bool = False
    # Tokens the pick took from the key's learned token quotas: the unused part goes back at the end.
    quota_held: provider_limits.Held = provider_limits.NOTHING_HELD
    # Who sent the call (breaker.principal_tag): a stream that breaks is scored against it.
    principal: str | None = None
    # The request as the client sent it: its prompt is estimated from it when the stream ends before the
    # provider's usage arrives (finish_stream).
    request_body: dict | None = None


def dispatch(call: Call) -> Outcome:
    return _dispatch_guarded(call, streamed=False)


def dispatch_stream(call: Call) -> Outcome:
    """`dispatch()` for a streamed call: routing, grant, limits, the key pick, breakers and fail-over are
    all decided before the client sees a byte, exactly as for a call answered whole — a key that fails
    before its first byte (no connection, 5xx, 429, 401/403) fails over to the next. On a 2xx the
    outcome carries the open stream (`outcome.stream`); its usage event is complete only once
    `finish_stream()` has been called with what the stream reported. Any other outcome is final, as
    `dispatch()`'s."""
    return _dispatch_guarded(call, streamed=True)


def finish_stream(
    outcome: Outcome, tokens: Tokens, *, failure: str = "", stream_error: str = "", relayed_output: int | None = None
) -> dict:
    """The end of a streamed call (its last byte, a break, or the client hanging up): charge the held
    limits with the tokens the provider reported, and complete the usage event with them. Once per
    stream; returns the event's fields for usage.services.record_event.

    `relayed_output`: None when `tokens` is the provider's final count. Otherwise the stream ended before
    that count arrived, `tokens` is what the provider said so far (Anthropic's opening count, or nothing),
    and this is the output estimated from the text relayed (gateway.streaming): the call is billed an
    estimate (`_estimated`), marked `usage_estimated`, and charged to the limits and budgets like any other.

    `failure`: "" when the stream ended as the provider ended it; an upstream failure kind (network,
    timeout, cancelled) when it broke; "client_gone" when the client hung up. A broken stream is
    scored against its principal on the key's breaker, as a break before a first byte is; a client
    hanging up says nothing about the key."""
    held = outcome.stream
    event = outcome.event
    if held is None or held.settled:
        return event
    held.settled = True
    estimated = relayed_output is not None
    if estimated:
        tokens = _estimated(tokens, relayed_output, held.request_body)
    tier, inbound = held.reservations
    try:
        tier.commit(input_tokens=stages.input_side(tokens), output_tokens=tokens.output)
        inbound.commit(input_tokens=stages.input_side(tokens), output_tokens=tokens.output)
        if failure == "network":
            # A read timeout or a reset mid-stream may be the request's doing (a long generation): scored
            # against its principal, as before a first byte (policies.breaker.RULES).
            breaker.record_failure(held.key_hash, Failure.NETWORK, principal=held.principal)
        elif held.quota_held:
            # What the provider reported is what it counts, however the stream ended.
            used = Tokens(input=stages.input_side(tokens), output=tokens.output)
            provider_limits.settle(held.key_hash, {}, held.quota_held, used)
    except Exception:  # Redis gone at the end of a stream: the event is still recorded
        log.exception("request %s: settling the stream's limits failed", event["request_id"])
    kind, message = "", ""
    if failure in ("client_gone", "cancelled"):  # cancelled: the watchdog saw the client's connection end
        kind, message = "client_canceled", "the client closed the stream before its end"
    elif failure:
        text = answers.TRANSPORT_ERRORS.get(failure, answers.TRANSPORT_ERRORS["network"])[2]
        kind, message = "upstream_stream_broken", f"the stream broke after its first byte: {text}"
    elif stream_error:
        kind, message = "upstream_stream_error", scrub.scrub_text(stream_error, load=False)
    event.update(
        duration_ms=int((time.monotonic() - held.started) * 1000),
        error_kind=kind,
        error_message=message[:500],
        input_tokens=tokens.input,
        output_tokens=tokens.output,
        cache_read_tokens=tokens.cache_read,
        cache_write_tokens=tokens.cache_write,
        usage_estimated=estimated,
    )
    # What the provider reported is billed, however the stream ended; without its count, the estimate.
    event["cost_nano_usd"], event["billed_cost_nano_usd"] = stages.price(held.pricing, tokens)
    return event


def _estimated(reported: Tokens, relayed_output: int, body: dict | None) -> Tokens:
    """What a stream cut before the provider's usage is billed: the provider's own counts where it gave them
    (Anthropic's message_start has the input side), the prompt estimated from the request where it did not
    (usage.tokens.estimate, the size rule reservations use), and at least the output relayed so far. The
    provider bills a cut stream for the prompt it read and what it generated until it saw the caller leave."""
    input_side = stages.input_side(reported)
    prompt = reported.input if input_side else estimate(body if isinstance(body, dict) else {}).input
    return Tokens(
        input=prompt,
        output=max(reported.output, relayed_output),
        cache_read=reported.cache_read,
        cache_write=reported.cache_write,
    )


def _dispatch_guarded(call: Call, *, streamed: bool) -> Outcome:
    started = time.monotonic()
    ctx = {"attempts": 0, "route": None, "host_key": None, "hold": None}
    try:
        # A batch record reserves its worst case on its spend budgets before anything else (none left: a
        # BudgetExceeded, 429 budget_exceeded with retry_after), and settles with its billed cost after.
        ctx["hold"] = stages.admit(call)
        outcome = _dispatch(call, ctx, started, streamed)
    except RelayError as err:
        stages.charge((), hold=ctx["hold"], request_id=call.request_id)
        kind = err.code or "relay_error"
        ctx["retry_after"] = getattr(err, "retry_after", None)
        return _finish(
            call,
            ctx,
            started,
            status=err.status,
            body=json.dumps(err.body()).encode(),
            headers=err.headers,
            origin="relay",
            error=err,
            error_kind=kind,
            event_status=0,
        )
    except BaseException:
        stages.charge((), hold=ctx["hold"], request_id=call.request_id)
        raise
    stages.charge([outcome.event], hold=ctx["hold"], request_id=call.request_id)
    return outcome


def _reserve_after_reroute(call: Call, ctx: dict, picks) -> None:
    """The key pick found the catalog snapshot stale, so the budgets read with it before the call were stale
    too: a budget made or enabled since (in another process) would govern the record without a reservation,
    and its cost would never reach it. Decided again with the current snapshot, before the call; with no room,
    what the pick took is given back and the call is not made."""
    try:
        ctx["hold"] = stages.admit(call)
    except BaseException:
        stages.unpick(picks)
        raise


def _score(call: Call, key_hash: str, failure: Failure, retry_after: float | None = None) -> None:
    """The failure on the key's breaker, scored to the call's principal (quiet for a retried batch item's
    5xx or broken connection: `Call.server_error_benches_key`)."""
    quiet = not call.server_error_benches_key
    stages.score_failure(key_hash, failure, principal=call.principal, retry_after=retry_after, quiet=quiet)


# Catalog writes racing one request: how many times it routes again before it stops checking.
MAX_REROUTES = 3


def _routed_and_picked(call: Call, ctx: dict):
    """Resolve with the catalog snapshot this process holds and pick a key, in one Redis round trip: the
    pick confirms the snapshot's generation (core.catalog). A stale snapshot is replaced and the request
    routed again; a routing error is confirmed against the counter before it stands."""
    snap = catalog.held()
    for attempt in range(MAX_REROUTES + 1):
        stages.recheck_call(call, snap)
        try:
            policy, route, path = stages.resolve_call(call, snap)
        except RelayError:
            fresh = catalog.current()
            if fresh is None or fresh is snap:
                raise
            snap, ctx["rerouted"] = fresh, True
            stages.recheck_call(call, snap)
            policy, route, path = stages.resolve_call(call, snap)
        ctx["route"] = route
        check = snap.gen if snap is not None and attempt < MAX_REROUTES else ""
        try:
            picks = stages.pick(
                policy,
                route,
                source=call.source,
                # Estimated only where a limit or a learned quota meters tokens (policies.keypool).
                need=lambda: estimate(call.body),
                catalog_gen=check,
                request_id=call.request_id,
            )
        except catalog.Stale:
            snap, ctx["rerouted"] = catalog.current(), True
            continue
        return route, path, picks
    raise AssertionError("unreachable: the last attempt does not check the generation")


def _dispatch(call: Call, ctx: dict, started: float, streamed: bool = False) -> Outcome:
    route, path, picks = _routed_and_picked(call, ctx)
    if ctx.get("rerouted") and ctx["hold"] is None and call.source == "batch":
        _reserve_after_reroute(call, ctx, picks)
    payload = stages.payload(route, call.body)

    inbound = picks.inbound
    handed_over = False  # a stream holds the inbound reservation until its end (finish_stream)

    last_response: upstream.UpstreamResponse | None = None
    last_error: upstream.UpstreamError | None = None
    tried_any = False
    waits: list[float] = []  # for each key passed over: seconds until it has capacity again
    try:
        # Keys whose breaker refuses, whose tier is spent or whose provider quota is spent are skipped.
        for cand, tier in picks:
            tried_any = True
            ctx["attempts"] += 1
            ctx["host_key"] = cand.key
            try:
                resp = stages.call(
                    route,
                    path,
                    cand,
                    payload,
                    headers=call.inbound_headers,
                    deadline=call.deadline,
                    cancel=call.cancel,
                    streamed=streamed,
                )
            except upstream.UpstreamError as exc:
                tier.release()
                last_error = exc
                if exc.kind == "unreachable":  # never sent: what the pick took from the provider's quotas goes back
                    provider_limits.settle(cand.key_hash, {}, picks.held, Tokens())
                failure = breaker.transport_failure(exc.kind)
                if failure is None:  # the call's own deadline or cancel, an answer too large: not the key's doing
                    breaker.release_probe(cand.key_hash)
                    raise answers.upstream_error_to_relay(exc, call.request_id) from exc
                # A connect failure benches the key for everyone; a break after sending (a read timeout, a
                # reset) scores this principal only, as a 5xx does (policies.breaker.RULES).
                _score(call, cand.key_hash, failure)
                if failure in stages.RETRY_QUIET and not call.failover_on_server_error:
                    break  # the caller retries later, with backoff
                if exc.read_timeout:
                    # The provider was still generating when the read timed out: the request's own length is the
                    # likely cause, and the next key would bill the operator for the same generation again.
                    break
                continue
            last_response, last_error = resp, None
            adapters.learnable_headers(route.binding, resp.headers)  # what the provider left out of its quota word
            if 200 <= resp.status < 300 and streamed:
                # The key answered: its breaker closes now (a half-open probe is answered before the first
                # byte, not at the stream's end). Its tier and the inbound limit stay held while the stream
                # runs (a concurrency limit counts it) and are charged its tokens at the end, as are the
                # provider's token quotas (what the provider said is learned now).
                breaker.record_success(cand.key_hash)
                provider_limits.learn(cand.key_hash, resp.headers)
                resp = adapters.stream_reader(route.binding, resp)  # as server-sent events (Bedrock's are not)
                handed_over = True
                outcome = _finish(
                    call,
                    ctx,
                    started,
                    status=resp.status,
                    body=b"",
                    headers=answers.content_type(resp, "text/event-stream"),
                    origin="upstream",
                    error=None,
                    error_kind="",
                    event_status=resp.status,
                )
                outcome.stream = Streamed(
                    resp,
                    (tier, inbound),
                    cand.key_hash,
                    started,
                    route.binding.pricing,
                    route.adapter,
                    path,
                    quota_held=picks.held,
                    principal=breaker.principal_tag(call.principal),
                    request_body=call.body,
                )
                return outcome
            if 200 <= resp.status < 300:
                tokens = parse_usage(route.adapter, path, answers.json_or_empty(resp.body))
                # Breaker closed, tier and inbound committed, the provider's word learned and the unused
                # part of the token reservation given back: one Redis round trip.
                stages.settle_success(cand.key_hash, (tier, inbound), tokens, resp.headers, picks.held)
                return _finish(
                    call,
                    ctx,
                    started,
                    status=resp.status,
                    body=resp.body,
                    headers=answers.content_type(resp),
                    origin="upstream",
                    error=None,
                    error_kind="",
                    event_status=resp.status,
                    tokens=tokens,
                )
            tier.release()
            # The provider answered without serving the request: its word is learned and what the pick
            # took from its token quotas goes back (it counts what it says it counts).
            provider_limits.settle(cand.key_hash, resp.headers, picks.held, Tokens())
            failure = answers.classify(resp.status)
            if failure is None:
                # 400/404/422…: the request is at fault, not the key; the key answered fine.
                breaker.record_success(cand.key_hash)
                break
            if failure is Failure.RATE_LIMITED and answers.retry_after(resp) is not None:
                waits.append(answers.retry_after(resp))  # this key's own wait; the soonest of the keys tried counts
            if failure is Failure.RATE_LIMITED:
                # Live first: a batch call's 429 keeps batch items off the key, not live requests (what is kept
                # for them refills), so it opens no breaker; a live request's holds batch work off for a while.
                livefirst.after_429(cand.key_hash, call.source, answers.capped(answers.retry_after(resp)))
            if failure is Failure.RATE_LIMITED and call.source == "batch":
                breaker.release_probe(cand.key_hash)  # batch pacing, not the key, is at stake
            else:
                # A 5xx or 403 is scored against this principal; 401 and long 429s open at once.
                _score(call, cand.key_hash, failure, answers.retry_after(resp))
            if failure is Failure.SERVER and not call.failover_on_server_error:
                break  # the caller retries later, with backoff, rather than spread one failure over every key
    finally:
        if not handed_over:
            inbound.release()  # no-op after a commit

    if last_response is not None:
        # Every key tried answered 429: capacity is back when the soonest of them said.
        ctx["retry_after"] = answers.capped(min(waits)) if last_response.status == 429 and waits else None
        return _finish(
            call,
            ctx,
            started,
            status=last_response.status,
            body=last_response.body[:ERROR_BODY_LIMIT],
            headers={
                **answers.content_type(last_response),
                "X-WR-Upstream-Status": last_response.status,
                **answers.passthrough_retry(last_response),
            },
            origin="upstream",
            error=None,
            error_kind="upstream_error",
            event_status=last_response.status,
            error_message=f"upstream returned {last_response.status}",
        )
    if last_error is not None:
        raise answers.upstream_error_to_relay(last_error, call.request_id)
    if not tried_any:
        if picks.retry_after_ms is not None:  # keys the pick passed over: breaker cooldowns, spent tiers
            waits.append(picks.retry_after_ms / 1000)
        wait = answers.capped(min(waits)) if waits else None
        err = RelayError(
            503,
            "no_keys",
            f"every host key of {route.host.name} is cooling down or rate limited",
            headers={"Retry-After": max(1, math.ceil(wait))} if wait is not None else None,
        )
        err.retry_after = wait
        raise err
    raise RelayError(502, "upstream_unavailable", "no upstream answer")


def _finish(
    call: Call,
    ctx: dict,
    started: float,
    *,
    status: int,
    body: bytes,
    headers: dict,
    origin: str,
    error: RelayError | None,
    error_kind: str,
    event_status: int,
    tokens: Tokens | None = None,
    error_message: str = "",
) -> Outcome:
    route = ctx["route"]
    # No host key leaves (decision 0004): every pool key of the route was decrypted (and remembered) above.
    body, headers = scrub.scrub_bytes(body, load=False), scrub.scrub_headers(headers, load=False)
    key = ctx["host_key"]
    priced = route is not None and error is None
    cost, billed = (
        stages.price(route.binding.pricing, tokens or Tokens(), call.discount_percent) if priced else (None, None)
    )
    event = stages.usage_event(
        request_id=call.request_id,
        attribution={"source": call.source, "batch_id": call.batch_id, **call.principal.usage_attribution()},
        status=event_status,
        duration_ms=int((time.monotonic() - started) * 1000),
        attempts=ctx["attempts"],
        error_kind=error_kind,
        error_message=error.message if error else error_message,
        policy=route.policy.name if route else "",
        binding=route.binding if route else None,
        model=str(call.body.get("model", ""))[:200],
        host_key_id=key.id if key else None,
        tokens=tokens,
        cost=cost,
        billed=billed,
    )
    return Outcome(
        status=status,
        body=body,
        headers=headers,
        origin=origin,
        error=error,
        error_kind=error_kind,
        event=event,
        retry_after=ctx.get("retry_after"),
    )
