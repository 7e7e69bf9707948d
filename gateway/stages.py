"""The pipeline's stages, each a public function: resolve → admit → pick → call → settle.

Every upstream call takes them, whoever makes it: a live request and a relay-run batch record through
`gateway.pipeline.dispatch` (which runs them with fail-over between keys), a provider batch job through
batches.provider.jobs (one key, one create) and its results through batches.provider.results (pricing, the
usage event, the budget charge). Provider mode keeps only what is its own: grouping records into jobs, the
job's state machine and each provider's batch wire. Decision 0021 lists who calls what.
"""

import json
import logging
from dataclasses import dataclass
from datetime import timedelta

from django.utils import timezone

from core import auth, hostkinds, scrub
from core.crypto import SecretUnavailable, sha256_hex
from core.errors import RelayError
from core.hostkinds.base import RESPONSES_PATHS
from core.models import Adapter
from gateway import adapters, routing, upstream
from policies import breaker, keypool, provider_limits, ratelimit
from policies.breaker import Failure
from usage import budgets, job_budgets
from usage.pricing import cost_nano_usd, discounted, provider_batch_cost
from usage.tokens import Tokens, worst_case

log = logging.getLogger(__name__)

MAX_KEY_ATTEMPTS = 3

# --- resolve ---------------------------------------------------------------------------------------


def resolve(policy_or_id, model, snap=None) -> routing.Route:
    """The route of `model` under a policy (the policy itself, or its id read from the catalog snapshot `snap`):
    the policy's grants, the first enabled binding whose host has keys in its pool, those keys. Decides
    `no_policy`, `policy_disabled`, `invalid_request` (no model string), `model_not_found`, `model_not_allowed`,
    `no_host_binding` and `no_keys` (RelayError). Cached per catalog generation (core.catalog)."""
    if policy_or_id is None or isinstance(policy_or_id, int):
        policy_or_id = routing.load_policy(policy_or_id, snap)
    return routing.resolve(policy_or_id, model, snap)


def resolve_call(call, snap) -> tuple:
    """`resolve` for a call of the pipeline, and whether the route can take it: the caller's `anthropic-beta`
    values the binding allows, the request's shape against the binding's adapter (`check_shape`), the endpoint
    against what the host's kind serves. Returns (policy, route, upstream path). All before a key is picked:
    a refusal has nothing to give back."""
    policy_id = call.policy.id if call.policy is not None else call.principal.policy_id
    policy = call.policy if call.policy is not None and snap is None else routing.load_policy(policy_id, snap)
    route = resolve(policy, call.body.get("model"), snap)
    adapters.check_betas(route.binding, call.inbound_headers)
    path = check_shape(call, route)
    adapters.check_served(route.binding, path)  # the host's kind may serve fewer endpoints (Gemini: no Completions)
    return policy, route, path


def _serves_responses(route) -> bool:
    """Whether the route's host kind answers OpenAI's Responses endpoint itself for the binding's adapter (OpenAI,
    Azure OpenAI and OpenAI-compatible kinds do; Gemini's does not): asked of the kind, never of a host's name."""
    kind = hostkinds.of(route.host, route.adapter)
    return all(kind.serves(route.adapter, path) for path in RESPONSES_PATHS)


def check_shape(call, route) -> str:
    """The upstream path of the call, or a 400 `cross_shape_dispatch` when the binding's adapter cannot serve the
    request's shape (the relay never translates between shapes)."""
    adapter = route.adapter
    if call.required_adapter is not None:
        if adapter == call.required_adapter:
            return call.path
        # The spec's one exception: a Responses item routed to an `openai` binding on a host whose kind
        # serves Responses goes to Chat Completions and fails there with the upstream's own status.
        if call.required_adapter == Adapter.OPENAI_RESPONSES and adapter == Adapter.OPENAI and _serves_responses(route):
            return "/v1/chat/completions"
        raise RelayError(
            400,
            "cross_shape_dispatch",
            f"cross-shape dispatch: {call.required_adapter} item routed to an {adapter} binding "
            f"({route.model.name}@{route.host.name})",
        )
    if adapters.PATH_ADAPTER.get(call.path) == adapter:
        return call.path
    if call.path in RESPONSES_PATHS and adapter == Adapter.OPENAI and _serves_responses(route):
        return call.path  # the kind's own Responses endpoint (OpenAI's, Azure's)
    raise RelayError(
        400,
        "cross_shape_dispatch",
        f"model {route.model.name} is served by an {adapter} binding and cannot be called on {call.path}",
    )


def recheck_credential(principal, snap) -> None:
    """The submitting credential checked again against the catalog snapshot `snap` (a key revoked, rotated out,
    disabled or expired, a token revoked): raises RelayError (AuthError) when it stopped working."""
    auth.recheck(principal, snap)


def recheck_call(call, snap) -> None:
    """A call whose credential was checked against another catalog than `snap` is checked again with it (its
    `reauthenticate`, which raises when the credential stopped working); a call checked with `snap` is not."""
    if call.reauthenticate is not None and not _same_generation(call.credential_snapshot, snap):
        call.principal, call.credential_snapshot = call.reauthenticate(snap), snap


def _same_generation(a, b) -> bool:
    return a is b or (a is not None and b is not None and a.gen == b.gen)


# --- admit -----------------------------------------------------------------------------------------
# A call's inbound rate limit and live-first share are decided inside the key pick's one Redis round trip
# (policies.keypool), not here: one round trip per call, whatever the policy configures. Admission here is
# the spend budgets', which the database holds.


def worst_nanos(pricing, body: dict, discount_percent: int = 0) -> int | None:
    """A record's worst case in nano-USD: its price × the most tokens it can be billed (usage.tokens.worst_case),
    less the batch's discount; None when unpriced. What a relay-run record and a provider job reserve."""
    return budgets.worst_case_nanos(pricing, worst_case(body), batch_discount_percent=discount_percent)


def admit(call) -> budgets.Hold | None:
    """A batch record's worst case reserved on the spend budgets governing it, before its call; None when none
    does (and for a live call, which its view checks and charges). Raises BudgetExceeded (429, retry_after).

    The worst case is a bound, not the size estimate the provider quotas reserve: every slot of every worker
    reserves at once, and a record that costs more than it reserved overshoots the budget by the difference,
    so with estimates the overshoot grew with the slots in flight."""
    if call.source != "batch" or not budgets.applicable(call.principal, call.policy):
        return None
    policy = call.policy or routing.load_policy(call.principal.policy_id)
    route = resolve(policy, call.body.get("model"))  # cached; a routing error is the call's answer
    return budgets.reserve(call.principal, policy, worst_nanos(route.binding.pricing, call.body, call.discount_percent))


def admit_job_check(principal, policy) -> bool:
    """Whether spend budgets govern a provider job's batch (read fresh: a job waits for hours), so that it must
    reserve before it is sent; raises BudgetExceeded when one is spent (the job waits unsent)."""
    if not budgets.applicable(principal, policy, fresh=True):
        return False
    budgets.check(principal, policy)
    return True


def admit_job(principal, policy, worst: int, records: int, ttl: timedelta) -> dict | None:
    """A provider job's records' summed worst case reserved on the budgets governing its batch, all or none, held
    `ttl` (the provider's window, not a record's deadline). Returns what the job keeps (usage.job_budgets); None
    when no budget applies. Raises BudgetExceeded. Call inside the transaction that records it on the job."""
    per_record = -(-worst // max(1, records))
    return job_budgets.reserve_for_job(principal, policy, worst, per_record, ttl)


# --- pick ------------------------------------------------------------------------------------------


@dataclass
class Candidate:
    key: object  # HostKey
    value: str
    key_hash: str  # breakers and LRU state are keyed by the value, so a rotated key starts fresh


def key_candidates(keys) -> list[Candidate]:
    """The pick's candidates from a route's keys, in order: each with its secret read and remembered by the
    scrubber (a provider echoing it back gets it scrubbed). A key whose secret cannot be read is left out,
    never sent. The one place keys become candidates: live calls, relay-run records and provider jobs."""
    out = []
    for key in keys:
        try:
            value = key.get_value()
        except SecretUnavailable:
            continue
        scrub.remember(value)
        out.append(Candidate(key, value, sha256_hex(value)[:12]))
    return out


def pick(policy, route, *, source: str, need=None, catalog_gen: str = "", request_id: str = "") -> keypool.Picks:
    """The keys a call may use, in order (policies.keypool.Picks), decided in ONE Redis round trip: the catalog
    generation `catalog_gen` (raises catalog.Stale: route again), the policy's inbound limit and live-first share
    (raises a 429 `rate_limit_exceeded` RelayError), then per key its breaker (an open one is skipped, a half-open
    one gives one probe), its tier limit, the provider's learned quotas (`need`: the call's tokens, or how to
    estimate them) and the policy's selection. A route whose every key is unreadable is a 503 `no_keys`."""
    candidates = key_candidates(route.keys)
    if route.keys and not candidates:
        raise _unreadable_keys(route, request_id)
    try:
        return keypool.pick(
            policy, candidates, max_picks=MAX_KEY_ATTEMPTS, catalog_gen=catalog_gen, source=source, need=need
        )
    except ratelimit.RateLimited as exc:
        err = RelayError(429, "rate_limit_exceeded", exc.message, headers={"Retry-After": exc.retry_after})
        err.retry_after = float(exc.retry_after)
        raise err from exc


def pick_one(policy, candidates: list) -> Candidate | None:
    """One key for a provider batch job, by the policy's selection and breakers as `pick` decides; no inbound
    limit is spent (a job is one request to the provider's batch quota, not the policy's requests). None when
    no candidate is usable."""
    if not candidates:
        return None
    no_inbound = ratelimit.plan(f"provider-job:{policy.id}", None, subject="")
    for cand, tier in keypool.Picks(policy, candidates, 1).start(no_inbound):
        tier.release()
        return cand
    return None


def unpick(picks) -> None:
    """Give back what `pick` took for a call that will not be made: the first key's tier and breaker probe, the
    tokens taken from its provider quotas, and the inbound reservation."""
    try:
        for cand, tier in picks:  # the first key, decided by the pick already (no round trip for the next)
            tier.release()
            provider_limits.settle(cand.key_hash, {}, picks.held, Tokens())
            breaker.release_probe(cand.key_hash)
            break
    finally:
        picks.inbound.release()


def _unreadable_keys(route, request_id: str) -> RelayError:
    """Every host key of the route has a secret the relay cannot read (an unset environment variable, a changed
    master key): a configuration fault, named to the operator in the log and to the caller as what it is."""
    sources = ", ".join(f"{k.name} ({'$' + k.value_env if k.value_env else 'encrypted value'})" for k in route.keys)
    log.error("request %s: no host key of %s can be read: %s", request_id, route.host.name, sources)
    return RelayError(
        503,
        "no_keys",
        f"no host key of {route.host.name} can be used: the relay cannot read their secrets "
        "(an operator must set them; the relay's log names them)",
    )


# --- call ------------------------------------------------------------------------------------------


def upstream_body(binding, body: dict) -> dict:
    """The request as a provider gets it: the binding's upstream model name, nothing relay-owned (`openrelay`,
    decision 0013). A live call, a relay-run record and a provider job's input file all send this."""
    out = dict(body, model=binding.upstream_name)
    out.pop("openrelay", None)
    return out


def call(route, path: str, cand: Candidate, payload: bytes, *, headers, deadline, cancel, streamed: bool):
    """One upstream send through the choke point (gateway.upstream): the host's kind builds the URL, headers and
    body. Returns the answer (or, `streamed`, the open stream); raises UpstreamError with no answer."""
    send = upstream.open_stream if streamed else upstream.call
    request = adapters.upstream_request(route.binding, path, cand.value, payload, headers, key=cand.key)
    return send(*request, deadline=deadline, cancel=cancel)


def payload(route, body: dict) -> bytes:
    return json.dumps(upstream_body(route.binding, body)).encode()


# --- settle ----------------------------------------------------------------------------------------

# Failures the request itself may have caused (a 5xx, a break after sending): a batch item's retry does not
# score them again (`score_failure(quiet=True)`).
RETRY_QUIET = frozenset({Failure.SERVER, Failure.NETWORK})


def score_failure(key_hash: str, failure: Failure, *, principal=None, retry_after=None, quiet=False) -> None:
    """A failed call on the key's breaker, as policies.breaker.RULES says: a connect failure, a 401 or a long 429
    benches the key for everyone; a 5xx or a break after sending scores `principal` (core.auth.Principal) only,
    and opens the key when two or more principals saw such failures lately. `quiet`: such a failure of a
    retried batch item scores nothing (the request, not the key, is at stake); its probe is handed back."""
    if quiet and failure in RETRY_QUIET:
        breaker.release_probe(key_hash)
        return
    tag = breaker.principal_tag(principal) if principal is not None else None
    breaker.record_failure(key_hash, failure, retry_after, principal=tag)


def settle_success(key_hash: str, reservations, tokens: Tokens, headers: dict, held) -> None:
    """A call the key answered 2xx: its breaker closed, the tier and inbound `reservations` committed with the
    tokens used, the provider's quota word learned and the unused part of `held` given back: one round trip."""
    used = Tokens(input=input_side(tokens), output=tokens.output)
    keypool.settle_success(
        key_hash,
        reservations,
        input_tokens=used.input,
        output_tokens=used.output,
        quota=provider_limits.settle_args(headers, held, used),
    )


def input_side(tokens: Tokens) -> int:
    return tokens.input + tokens.cache_read + tokens.cache_write


def price(pricing, tokens: Tokens | None, discount_percent: int = 0, executed_by: str = "relay") -> tuple:
    """(cost, billed) in nano-USD of `tokens` on `pricing`. `cost` is what the operator pays: the list price for
    a call the relay made, the provider's batch price for a record the provider ran (usage.pricing
    .provider_batch_cost). `billed` is what the caller pays: the list price less the batch's discount, None when
    that is the cost itself (a relay-run call without a discount). Both None when unpriced or no tokens."""
    if tokens is None:
        return None, None
    listed = cost_nano_usd(pricing, tokens)
    provider_run = executed_by == "provider"
    cost = provider_batch_cost(pricing, tokens) if provider_run else listed
    if listed is None or not (discount_percent or provider_run):
        return cost, None
    return cost, discounted(listed, discount_percent)


def usage_event(
    *,
    request_id: str,
    attribution: dict,
    status: int,
    duration_ms: int,
    attempts: int,
    policy: str = "",
    binding=None,
    model: str = "",
    host_key_id=None,
    error_kind: str = "",
    error_message: str = "",
    tokens: Tokens | None = None,
    cost=None,
    billed=None,
    executed_by: str = "relay",
    ts=None,
) -> dict:
    """The fields of one usage event (usage.services.record_event), the same for every request: a live call, a
    relay-run record and a provider-run one differ only in what they put in them. `attribution`: source, batch
    id and the principal's attribution (core.auth.Principal.usage_attribution, Batch.event_attribution).
    `binding`: the route's (its model, provider and host); without one, `model` as the caller named it."""
    tokens = tokens or Tokens()
    return {
        **attribution,
        "request_id": request_id,
        "ts": ts or timezone.now(),
        "status": status,
        "duration_ms": duration_ms,
        "attempts": attempts,
        "error_kind": error_kind,
        "error_message": scrub.scrub_text(error_message, load=False)[:500] if error_message else "",
        "policy": policy,
        "model": binding.model.name if binding is not None else model,
        "provider": binding.model.provider if binding is not None else "",
        "host": binding.host.name if binding is not None else "",
        "host_key_id": host_key_id,
        "input_tokens": tokens.input,
        "output_tokens": tokens.output,
        "cache_read_tokens": tokens.cache_read,
        "cache_write_tokens": tokens.cache_write,
        "cost_nano_usd": cost,
        "billed_cost_nano_usd": billed,
        "executed_by": executed_by,
    }


def billed_total(events) -> int | None:
    """What `events` bill their callers: each one's billed cost, else its cost; None when none is priced."""
    total = None
    for event in events:
        billed = event.get("billed_cost_nano_usd")
        value = event.get("cost_nano_usd") if billed is None else billed
        if value is not None:
            total = (total or 0) + value
    return total


# `charge`'s "not given" (None is a meaning of its own: a record or a job that reserved nothing).
_UNSET = object()


def charge(events, *, hold=_UNSET, job_hold=_UNSET, records: int = 0, request_id: str = "") -> None:
    """The billed cost of `events` to the spend budgets that govern them, after their calls:
    - `hold`, a relay-run record's reservation (`admit`): settled with it, quietly (a settle that fails leaves
      the hold to expire and be reclaimed; the call's answer stands); no events: only released. None (no budget
      governed the record when it was admitted): nothing is charged.
    - `job_hold`, a provider job's reservation (`admit_job`): `records` records' share settled with the chunk's
      billed total (call inside the transaction that writes the chunk). None (no budget applied when the job
      was sent): charged as a live call is.
    - neither: charged to the budgets of the events' attribution, as a live call is (one charge for all)."""
    total = billed_total(events)
    if hold is not _UNSET:
        budgets.settle_quietly(hold, total, request_id)
    elif job_hold is not _UNSET and job_hold:
        job_budgets.settle_job_part(job_hold, records, total)
    elif total:
        events = list(events)
        budgets.charge_event({**events[0], "billed_cost_nano_usd": total})
