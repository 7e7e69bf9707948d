"""Waits for a host's capacity, held by the records that need that host and by no other.

When a record finds no usable key of its host (every key's breaker open or paused, its tier limit or its
provider quota spent) or every key it tried answered 429, the wait concerns that host, as the batch's
policy reaches it, not the batch: its records bound for other hosts keep running. Three things hold the
wait where it belongs (docs/batch-waiting.md):

- the record itself goes back to `available` with its own `not_before` (the claim skips it until then);
- the wait is remembered by the worker process until it ends (`remember`): a record bound for that host,
  of any batch of the policy, claimed meanwhile by this process sees it before calling the pipeline
  (`waiting_until`) and waits at once, without a key pick or an attempt (in another process, the key
  pick the record makes anyway tells it, in the same Redis round trip);
- the batch's next available records bound for the same host are held too (`hold_route`): their
  `not_before` is set in one statement, so they are not claimed, one by one, only to learn the same wait.
  The scan reads the inputs of at most HOLD_SCAN records past the one that learned it (a record's host is
  known only from its input's model); a record beyond them that is claimed during the wait holds the
  next ones in turn.

When every record of the batch goes to that host (`only_host`: the models its records name, read once per
batch), the wait concerns the whole batch after all, and the batch waits (its `not_before`): nothing of it
is claimed until then, as cheap as a hold gets (a batch paced by its one host's quota is not churned).

These are shortcuts: a wait not known costs one more record's key pick, never a wrong result (the pipeline's
own pick refuses benched keys). The hot path pays nothing for them: no Redis round trip is added per record.
"""

import json
import logging
import threading
from datetime import datetime, timedelta

import redis
from django.db.models import Q
from django.utils import timezone

from batches import dispatch, storage
from batches.lifecycle import claim
from batches.models import Item, ItemState
from core.errors import RelayError
from core.redis import get_redis
from gateway import routing

log = logging.getLogger(__name__)

# Records of a batch whose inputs one hold reads, past the record that learned the wait.
HOLD_SCAN = 1000
_HELD = "relay:route_held:{batch}:{host}:{until}:{start}"


def host_of(policy, body: dict, snapshot) -> str | None:
    """The host a record goes to under `policy` (its model's route), or None when it has no route (the
    pipeline then fails it, as it would any record)."""
    model = body.get("model") if isinstance(body, dict) else None
    if not isinstance(model, str) or not model:
        return None
    try:
        return routing.resolve(policy, model, snapshot).host.name
    except RelayError:
        return None


# (policy id, host) → when its wait ends, as this process learned it.
_known: dict = {}
_KNOWN_MAX = 4096
_lock = threading.Lock()  # the slots of a worker are threads of one process


def remember(policy_id, host: str, until: datetime) -> None:
    """Every key of `host` under this policy is out of capacity until `until` (as this process knows)."""
    if not host:
        return
    key = (policy_id, host)
    with _lock:
        if len(_known) >= _KNOWN_MAX and key not in _known:
            now = timezone.now()
            for stale in [k for k, end in _known.items() if end <= now]:
                del _known[stale]
            if len(_known) >= _KNOWN_MAX:
                _known.clear()
        current = _known.get(key)
        if current is None or current < until:
            _known[key] = until


def waiting_until(policy_id, host: str | None) -> datetime | None:
    """When the known wait of `host` under this policy ends, if it has not yet."""
    until = _known.get((policy_id, host)) if host else None
    return until if until is not None and until > timezone.now() else None


def forget() -> None:
    """Forget every wait this process knows (an operator reset the breakers; a test moved the clock)."""
    with _lock:
        _known.clear()


# The models a batch's records name, per batch: fixed at submit, so read once (here, and in Redis for the other
# processes) and mapped to hosts with the current catalog when asked.
_MODELS = "relay:batch_models:{batch}"
_MODELS_TTL_S = 2 * 24 * 3600  # a batch's window and then some
_NO_MODEL = ""  # the marker of a batch read, whose records name no model at all
_models: dict = {}
SCAN_CHUNK = 2000


def batch_models(batch_id) -> frozenset:
    """The models the batch's records name (read from their inputs once per batch: every record, any state)."""
    found = _models.get(batch_id)
    if found is not None:
        return found
    key = _MODELS.format(batch=batch_id)
    try:
        cached = get_redis().smembers(key)
    except redis.RedisError:
        cached = None
    if cached:
        found = frozenset(m.decode() if isinstance(m, bytes) else m for m in cached) - {_NO_MODEL}
    else:
        found = frozenset(_read_models(batch_id))
        try:
            pipe = get_redis().pipeline(transaction=False)
            pipe.sadd(key, _NO_MODEL, *found)
            pipe.expire(key, _MODELS_TTL_S)
            pipe.execute()
        except redis.RedisError:
            pass
    with _lock:
        if len(_models) >= 256:
            _models.clear()
        _models[batch_id] = found
    return found


def _read_models(batch_id) -> set:
    models, after = set(), -1
    while True:
        rows = list(
            Item.objects.filter(batch_id=batch_id, idx__gt=after)
            .order_by("idx")
            .values_list("idx", "input_ref")[:SCAN_CHUNK]
        )
        if not rows:
            return models
        for data in storage.read_many([ref for _, ref in rows]):
            model = _model_of(data)
            if model is not None:
                models.add(model)
        after = rows[-1][0]


def _model_of(data) -> str | None:
    if isinstance(data, storage.PayloadMissing):
        return None
    try:
        body = json.loads(data)
    except ValueError:
        return None
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) and model else None


def only_host(batch_id, host: str, policy, snapshot) -> bool:
    """Do all the batch's records go to `host`? Then a wait for that host's keys concerns the whole batch: it
    waits as a batch (no record is claimed until then), the cheapest hold there is."""
    models = batch_models(batch_id)
    return bool(models) and all(host_of(policy, {"model": m}, snapshot) == host for m in models)


def hold_route(item: Item, host: str, until: datetime, policy, snapshot) -> int:
    """Hold the batch's next available records bound for `host` until `until` (HOLD_SCAN of them at most,
    from `item` on, once per wait and stretch). Returns how many were held."""
    start = item.idx // HOLD_SCAN
    try:
        marker = _HELD.format(batch=item.batch_id, host=host, until=int(until.timestamp()), start=start)
        ttl = max(1, int((until - timezone.now()).total_seconds()) + 1)
        if not get_redis().set(marker, 1, nx=True, ex=ttl):
            return 0  # another record of this stretch already held them
    except redis.RedisError:
        return 0
    rows = list(
        Item.objects.filter(batch_id=item.batch_id, state=ItemState.AVAILABLE, idx__gt=item.idx)
        .filter(Q(not_before__isnull=True) | Q(not_before__lt=until))  # those held already are not read again
        .order_by("idx")
        .values_list("id", "input_ref")[:HOLD_SCAN]
    )
    hosts: dict[str, str | None] = {}  # model → host, for this scan
    held = []
    # One read for them all: a query for `db:` payloads, a pread each for byte ranges of the input file.
    for (item_id, _), data in zip(rows, storage.read_many([ref for _, ref in rows]), strict=True):
        model = _model_of(data)
        if model is None:
            continue  # its own claim fails it as it should
        if model not in hosts:
            hosts[model] = host_of(policy, {"model": model}, snapshot)
        if hosts[model] == host:
            held.append(item_id)
    n = claim.hold(item.batch_id, held, until) if held else 0
    if n:
        log.info("batch %s: %d records for host %s wait until %s", item.batch_id, n, host, until)
        dispatch.wake_at(until + timedelta(milliseconds=1))
    return n
