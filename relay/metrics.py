"""Prometheus metrics at `GET /metrics` (bearer RELAY_ADMIN_TOKEN).

Workers are Celery processes and the API runs several gunicorn processes, possibly on
several machines, so no series is an in-process counter: every value is computed at scrape time
from what all processes share — PostgreSQL (items, batches, usage events) and Redis (queues,
breakers, rate-limit denials). Any replica's /metrics answers for the whole deployment; scrape one.

Series (all prefixed `relay_`):
- batch_items{state}, batches{surface,status}             gauges, from Item / Batch rows
- queue_depth{queue}                                      gauge, Celery messages waiting in Redis
- item_run_seconds{state}                                 histogram of finished items' started→finished
- upstream_request_seconds{host,status,source}            histogram of usage events' duration_ms
- breaker_state{host,key,state}, breaker_step{host,key}   per host key, by its name (never its value)
- ratelimit_denials_total{scope,name,meter}               counter, counted in Redis at each denial
- usage_requests_total{model,source,status}, usage_tokens_total{model,source,kind},
  usage_cost_usd_total{model,source}, usage_billed_cost_usd_total{model,source}   counters from usage events
- worker_slots_busy{worker}                               running items per worker host (lease owner)
- provider_jobs{kind,status}, provider_job_records{status} gauges, provider batch jobs (batches/provider)
- batch_records_run_total{executed_by}                    counter, batch records by where they ran
- budget_spent_usd, budget_reserved_usd, budget_limit_usd {budget,scope,scope_name,period}
                                                          gauges, spend budgets' current period (usage/budgets.py)
- webhook_deliveries{outcome}, webhook_oldest_undelivered_age_seconds, webhook_endpoints_paused
                                                          gauges, from the webhook outbox (batches/webhooks)

The upstream histogram and the usage counters are read from a rollup kept incrementally
(relay/metrics_rollup.py): a scrape counts the events written since the last count, never the whole
usage table, and retention deleting usage events leaves the counters where they are.

No label value is a string a tenant chose (decision 0014): `model` is a model of the catalog, and every
other name a usage event holds (an unknown model, a non-string `model`'s text) is counted under
model="unknown", folded in the query; hosts, keys, policies and workers are the operator's names,
states, statuses and sources the relay's own. So the number of series is bounded by the catalog's
size, whatever tenants send.

Only GET and HEAD are answered; any other method is a 405 (never the CSRF check's 403).
"""

import hmac
import logging

from django.conf import settings
from django.db.models import Count, Sum
from django.http import HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batches import dispatch
from batches.queues import QUEUES
from core.errors import RelayError
from relay import metrics_rollup
from relay.metrics_rollup import RUN_BUCKETS_S, UPSTREAM_BUCKETS_S

log = logging.getLogger(__name__)

# New usage events a scrape counts itself; the beat job (relay.tasks.roll_up_metrics) catches up the rest.
SCRAPE_MAX_ROWS = 50_000
BREAKER_STATES = ("closed", "half_open", "open")
NANO = 1_000_000_000


def _le(bound) -> str:
    return str(float(bound))


def _histogram(name, doc, labels, rows, buckets):
    """rows: (label values, {bucket: count ≤ bucket}, count, sum seconds)."""
    fam = HistogramMetricFamily(name, doc, labels=labels)
    for values, counts, total, total_s in rows:
        points = [(_le(b), counts[b]) for b in buckets] + [("+Inf", total)]
        fam.add_metric(values, points, sum_value=total_s)
    return fam


# Items in a terminal state are counted at most once per this many seconds (cached in Redis): at a million
# rows that count is a scan of the items table (~0.4 s), while the states a backlog alert reads (available,
# running, delegated) are counted exactly at every scrape from their partial indexes.
TERMINAL_COUNT_TTL_S = 60
_TERMINAL_KEY = "relay:metrics:terminal_items"


def _terminal_counts() -> dict[str, int]:
    from batches.models import Item, ItemState
    from core.redis import get_redis

    client = get_redis()
    cached = client.hgetall(_TERMINAL_KEY)
    if cached:
        texts = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in cached.items()}
        texts.pop("_", None)
        return texts
    open_states = (ItemState.AVAILABLE, ItemState.RUNNING, ItemState.DELEGATED)
    counts = dict(Item.objects.exclude(state__in=open_states).values_list("state").annotate(n=Count("pk")).order_by())
    pipe = client.pipeline()
    pipe.hset(_TERMINAL_KEY, mapping={"_": 1, **counts})
    pipe.expire(_TERMINAL_KEY, TERMINAL_COUNT_TTL_S)
    pipe.execute()
    return counts


def batch_items():
    from batches.models import Batch, Item, ItemState

    items = GaugeMetricFamily("relay_batch_items", "Batch items by state.", labels=["state"])
    counts = _terminal_counts()
    for state in (ItemState.AVAILABLE, ItemState.RUNNING, ItemState.DELEGATED):
        counts[state] = Item.objects.filter(state=state).count()  # each from its partial index
    for state in ItemState.values:
        items.add_metric([state], counts.get(state, 0))
    yield items
    batches = GaugeMetricFamily("relay_batches", "Batches by surface and status.", labels=["surface", "status"])
    for surface, status, n in Batch.objects.values_list("surface", "status").annotate(n=Count("pk")).order_by():
        batches.add_metric([surface, status], n)
    yield batches


def queue_depths() -> dict[str, int]:
    """Messages waiting in each Celery queue (all priority steps), through the dispatch module's one
    broker client."""
    lengths = dispatch.queue_lengths(QUEUES)
    if any(n is None for n in lengths.values()):
        raise RuntimeError("the broker could not be read")  # reported as this source's scrape error
    return lengths


def queue_depth():
    fam = GaugeMetricFamily("relay_queue_depth", "Celery messages waiting in the broker, per queue.", labels=["queue"])
    for queue, n in queue_depths().items():
        fam.add_metric([queue], n)
    yield fam


def item_run_seconds(runs=None):
    runs = runs if runs is not None else list(metrics_rollup.run_rows())
    yield _histogram(
        "relay_item_run_seconds",
        "Run time of finished batch items (claim to finish), by final state.",
        ["state"],
        [
            ([r.state], dict(zip(RUN_BUCKETS_S, r.buckets, strict=True)), r.n, r.total_ms / 1000)
            for r in sorted(runs, key=lambda r: r.state)
        ],
        RUN_BUCKETS_S,
    )


def _rollup() -> list:
    """The usage rollup after counting what was written since its last run (relay/metrics_rollup.py): a
    scrape reads a few hundred rows, not the usage table. When the control worker's run holds the cursor
    the scrape serves the rollup as it stands (it lags by at most that run)."""
    metrics_rollup.advance(SCRAPE_MAX_ROWS)
    return list(metrics_rollup.rows())


def upstream_seconds(rollup=None):
    by_labels: dict = {}
    for r in rollup if rollup is not None else _rollup():
        if not r.host:
            continue
        h = by_labels.setdefault((r.host, str(r.status), r.source), [[0] * len(UPSTREAM_BUCKETS_S), 0, 0])
        h[0] = [a + b for a, b in zip(h[0], r.buckets, strict=True)]
        h[1] += r.n
        h[2] += r.duration_ms
    yield _histogram(
        "relay_upstream_request_seconds",
        "Duration of requests that reached a host (live and batch), by host, final status and source.",
        ["host", "status", "source"],
        [
            (list(labels), dict(zip(UPSTREAM_BUCKETS_S, counts, strict=True)), n, total / 1000)
            for labels, (counts, n, total) in sorted(by_labels.items())
        ],
        UPSTREAM_BUCKETS_S,
    )


def usage_counters(rollup=None):
    rollup = rollup if rollup is not None else _rollup()
    requests = CounterMetricFamily(
        "relay_usage_requests", "Usage events by model, source and status.", labels=["model", "source", "status"]
    )
    tokens = CounterMetricFamily(
        "relay_usage_tokens", "Tokens recorded in usage events.", labels=["model", "source", "kind"]
    )
    cost = CounterMetricFamily(
        "relay_usage_cost_usd", "Cost of usage events (list price), USD.", labels=["model", "source"]
    )
    billed = CounterMetricFamily(
        "relay_usage_billed_cost_usd",
        "What callers are charged (after batch discounts), USD.",
        labels=["model", "source"],
    )
    ran = CounterMetricFamily(
        "relay_batch_records_run",
        "Batch records that ran, by where: the relay's workers or the provider's batch API.",
        labels=["executed_by"],
    )
    kinds = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens")
    by_status: dict = {}
    by_model: dict = {}
    by_where: dict = {}
    for r in rollup:
        key = (r.model, r.source, str(r.status))
        by_status[key] = by_status.get(key, 0) + r.n
        m = by_model.setdefault((r.model, r.source), dict.fromkeys((*kinds, "cost", "billed"), 0))
        for k in kinds:
            m[k] += getattr(r, k)
        m["cost"] += r.cost_nano_usd
        m["billed"] += r.billed_nano_usd
        if r.source == "batch":
            by_where[r.executed_by] = by_where.get(r.executed_by, 0) + r.n
    for labels, n in sorted(by_status.items()):
        requests.add_metric(list(labels), n)
    for labels, m in sorted(by_model.items()):
        for k in kinds:
            tokens.add_metric([*labels, k.removesuffix("_tokens")], m[k])
        cost.add_metric(list(labels), m["cost"] / NANO)
        billed.add_metric(list(labels), m["billed"] / NANO)
    for where, n in sorted(by_where.items()):
        ran.add_metric([where], n)
    yield requests
    yield tokens
    yield cost
    yield billed
    yield ran


def usage_rollup():
    """Every series counted from usage events, from one read of the rollup."""
    rollup = _rollup()
    yield from upstream_seconds(rollup)
    yield from usage_counters(rollup)
    yield from item_run_seconds()


def breaker_snapshots() -> list[tuple[str, str, dict]]:
    """(host name, key name, breaker snapshot) of every enabled host key; its value is only hashed."""
    from core.crypto import SecretUnavailable, sha256_hex
    from core.models import HostKey
    from policies import breaker

    out = []
    for key in HostKey.objects.filter(enabled=True).select_related("host").order_by("host__name", "name"):
        try:
            key_hash = sha256_hex(key.get_value())[:12]  # as gateway/pipeline.py keys the breaker
        except SecretUnavailable:
            continue
        out.append((key.host.name, key.name, breaker.snapshot(key_hash)))
    return out


def breakers():
    state = GaugeMetricFamily(
        "relay_breaker_state",
        "Circuit breaker of each host key (1 for its current state), by host and key name.",
        labels=["host", "key", "state"],
    )
    step = GaugeMetricFamily(
        "relay_breaker_step", "Cooldown ladder step of each host key's breaker.", labels=["host", "key"]
    )
    for host, key, snap in breaker_snapshots():
        for s in BREAKER_STATES:
            state.add_metric([host, key, s], 1 if snap["state"] == s else 0)
        step.add_metric([host, key], snap["step"])
    yield state
    yield step


def ratelimit_denials():
    from core.models import HostKey
    from core.redis import get_redis
    from policies.models import Policy
    from policies.ratelimit import DENIALS_KEY

    fam = CounterMetricFamily(
        "relay_ratelimit_denials",
        "Requests refused by a rate limit, by scope (policy = inbound, hostkey = upstream tier) and meter.",
        labels=["scope", "name", "meter"],
    )
    raw = get_redis().hgetall(DENIALS_KEY)
    parsed = []
    for field, value in raw.items():
        scope_id, _, meter = (field.decode() if isinstance(field, bytes) else field).partition("|")
        kind, _, ident = scope_id.partition(":")
        parsed.append((kind, ident, meter, int(value)))
    names = {
        "policy": dict(
            Policy.objects.filter(
                pk__in=[int(i) for k, i, _, _ in parsed if k == "policy" and i.isdigit()]
            ).values_list("pk", "name")
        ),
        "hostkey": dict(
            HostKey.objects.filter(
                pk__in=[int(i) for k, i, _, _ in parsed if k == "hostkey" and i.isdigit()]
            ).values_list("pk", "name")
        ),
    }
    for kind, ident, meter, n in sorted(parsed):
        name = names.get(kind, {}).get(int(ident), f"{kind}:{ident}") if ident.isdigit() else ident
        fam.add_metric([kind, name, meter], n)
    yield fam


def slots_busy() -> dict[str, int]:
    """Running items per worker host: a lease owner is host:pid:thread (batches.worker.drain.worker_id)."""
    from batches.models import Item, ItemState

    busy: dict[str, int] = {}
    for owner in Item.objects.filter(state=ItemState.RUNNING).values_list("lease_owner", flat=True):
        host = owner.split(":", 1)[0]
        busy[host] = busy.get(host, 0) + 1
    return dict(sorted(busy.items()))


def slots_capacity() -> dict[str, int]:
    """Slots per worker host, from what each live item-worker process announces
    (batches.worker.warmup.announce_slots)."""
    from batches.worker.warmup import SLOTS_KEY_PREFIX
    from core.redis import get_redis

    client = get_redis()
    keys = list(client.scan_iter(match=f"{SLOTS_KEY_PREFIX}*", count=500))
    capacity: dict[str, int] = {}
    for key, value in zip(keys, client.mget(keys) if keys else [], strict=True):
        if value is None:
            continue  # expired between the scan and the read
        host = (key.decode() if isinstance(key, bytes) else key).removeprefix(SLOTS_KEY_PREFIX).rsplit(":", 1)[0]
        capacity[host] = capacity.get(host, 0) + int(value)
    return capacity


def worker_slots():
    busy_fam = GaugeMetricFamily(
        "relay_worker_slots_busy", "Batch items running now, per worker host (of its lease).", labels=["worker"]
    )
    cap_fam = GaugeMetricFamily(
        "relay_worker_slots", "Item slots of the live item workers, per worker host.", labels=["worker"]
    )
    busy, capacity = slots_busy(), slots_capacity()
    for host in sorted(set(busy) | set(capacity)):
        busy_fam.add_metric([host], busy.get(host, 0))  # an idle live worker shows 0
        if host in capacity:
            cap_fam.add_metric([host], capacity[host])
    yield busy_fam
    yield cap_fam


def webhook_deliveries():
    from batches.webhooks import selectors

    deliveries = GaugeMetricFamily(
        "relay_webhook_deliveries",
        "Webhook deliveries by outcome: pending (retrying), delivered (2xx), failed (retries ran out).",
        labels=["outcome"],
    )
    for outcome, n in selectors.delivery_counts().items():
        deliveries.add_metric([outcome], n)
    yield deliveries
    yield GaugeMetricFamily(
        "relay_webhook_oldest_undelivered_age_seconds",
        "Age of the oldest event still waiting for a delivery (0 when none waits).",
        value=selectors.oldest_undelivered_age(),
    )
    yield GaugeMetricFamily(
        "relay_webhook_endpoints_paused",
        "Webhook endpoints paused after failing every delivery (or by an operator).",
        value=selectors.paused_endpoints(),
    )


def provider_jobs():
    from batches.provider.models import ProviderJob

    jobs = GaugeMetricFamily(
        "relay_provider_jobs", "Provider batch jobs by batch API and status.", labels=["kind", "status"]
    )
    records = GaugeMetricFamily(
        "relay_provider_job_records", "Records carried by provider batch jobs, by job status.", labels=["status"]
    )
    by_status: dict[str, int] = {}
    for kind, status, n, carried in (
        ProviderJob.objects.values_list("kind", "status").annotate(n=Count("pk"), r=Sum("records")).order_by()
    ):
        jobs.add_metric([kind, status], n)
        by_status[status] = by_status.get(status, 0) + (carried or 0)
    for status, n in by_status.items():
        records.add_metric([status], n)
    yield jobs
    yield records


def budgets():
    from usage import budgets as spend

    names = ["budget", "scope", "scope_name", "period"]
    spent = GaugeMetricFamily(
        "relay_budget_spent_usd", "Billed spend in the budget's current period, USD.", labels=names
    )
    reserved = GaugeMetricFamily(
        "relay_budget_reserved_usd", "Worst cases reserved by batch records in flight, USD.", labels=names
    )
    limit = GaugeMetricFamily("relay_budget_limit_usd", "The budget's amount per period, USD.", labels=names)
    for labels, s, r, lim in spend.metric_rows():
        values = [labels[n] for n in names]
        spent.add_metric(values, s)
        reserved.add_metric(values, r)
        limit.add_metric(values, lim)
    yield spent
    yield reserved
    yield limit


SOURCES = (
    batch_items,
    provider_jobs,
    queue_depth,
    usage_rollup,
    breakers,
    ratelimit_denials,
    worker_slots,
    webhook_deliveries,
    budgets,
)


class RelayCollector:
    """Each source is computed independently: one that fails (Redis down) is logged and
    reported by relay_scrape_error{source}, and the others are still served."""

    def collect(self):
        errors = GaugeMetricFamily(
            "relay_scrape_error", "1 when a metrics source failed this scrape.", labels=["source"]
        )
        for source in SOURCES:
            try:
                families = list(source())
            except Exception:
                log.warning("metrics source %s failed", source.__name__, exc_info=True)
                errors.add_metric([source.__name__], 1)
                continue
            errors.add_metric([source.__name__], 0)
            yield from families
        yield errors


registry = CollectorRegistry(auto_describe=False)
registry.register(RelayCollector())


def _authorized(request) -> bool:
    auth = request.headers.get("Authorization", "").strip()
    if auth[:7].lower() != "bearer " or not settings.RELAY_ADMIN_TOKEN:
        return False
    return hmac.compare_digest(auth[7:].strip().encode(), settings.RELAY_ADMIN_TOKEN.encode())


@csrf_exempt  # no session or form is involved: a POST is refused as a method (405), not by the CSRF check
def metrics_view(request):
    if request.method not in ("GET", "HEAD"):
        return RelayError(
            405,
            "method_not_allowed",
            f"{request.method[:20]} is not allowed on /metrics: use GET",
            headers={"Allow": "GET, HEAD"},
        ).response()
    if not _authorized(request):
        response = JsonResponse(
            {"error": {"message": "metrics need Authorization: Bearer <RELAY_ADMIN_TOKEN>", "type": "unauthorized"}},
            status=401,
        )
        response["WWW-Authenticate"] = 'Bearer realm="relay metrics"'
        return response
    return HttpResponse(generate_latest(registry), content_type=CONTENT_TYPE_LATEST)
