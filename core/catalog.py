"""A per-process cache of the catalog, invalidated through one Redis generation counter.

The catalog is what routing reads on every request and changes only when an
operator edits it: policies (grants, pool, rate limit and its rules), models,
host bindings, hosts, host keys (and their decrypted values), pricing. Each
process keeps what it has read under the generation it read it at

    relay:catalog:gen     an integer; every catalog write increments it

and a change of that number drops the whole cache. So a change is seen by the
next request in every process, not after a TTL. The pipeline does not read the
number in a round trip of its own: it routes with the snapshot it holds
(`held()`) and hands the snapshot's number to the key pool's pick script
(policies.keypool), which compares it with the counter in the same round trip
that takes the key. A different number there consumes nothing and raises
`Stale`; the pipeline reloads and routes again. A routing error found with a
held snapshot is confirmed against the counter (`current()`) before it is
answered, so a model added a moment ago is never refused from a stale cache.
Everything else (`policy()`, `route()` without a snapshot) reads the counter first.

Every write bumps, whatever path it takes:
- `save()` / `delete()` of a catalog model, the admin, `relay apply`, the CLI,
  services: post_save / post_delete / m2m_changed signals (`connect_signals`);
- queryset `.update()`, `.delete()`, `bulk_create()`, `bulk_update()`: the
  catalog models' default manager is `CatalogQuerySet.as_manager()`, and related
  managers (`policy.pool_links`, `rate_limit.rules`) inherit it.

A bump happens at once (this process, and this transaction's own reads, see the
change) and again when the transaction commits: another process that reloads
between the two reads the old rows and caches them under the first bump's
number; the second bump drops them.

Relay keys are cached too (`core.auth`): the row of a key that was found, with its
user, service account, project and team, so a request authenticates without a query.
Their writes bump like any other (revoke, disable, rotate, a user deactivated), and
the time-bound checks (expiry, a rotated value's grace) are made on every request.
A live request's key is looked up in the held snapshot and re-checked when the key
pick finds that snapshot stale; every other surface authenticates with the current
one. Inference tokens are not cached: they are checked with one query per request.

If the counter disappears (Redis flushed), it restarts from a random value, so a
process holding an old number cannot mistake a new counter for its own. While Redis
cannot be reached nothing is served from the cache, a bump that failed is retried
by the next request of the process that wrote, and no snapshot is used for longer
than MAX_AGE_S whatever the counter says (a backstop for a write whose bump was lost).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from core import generation
from core.redis import get_redis

GEN_KEY = generation.GEN_KEY
MAX_AGE_S = 300.0
# Routing errors are cached per (policy, model name) like routes, but a tenant picks the names: at
# most this many per snapshot, and none for a name longer than a catalog model's (200 characters).
# Past that an error is computed afresh each time, so endless distinct junk names cannot grow a
# web worker's memory (decision 0014); routes that exist are bounded by the catalog itself.
MAX_CACHED_ROUTE_ERRORS = 1000
ROUTE_NAME_MAX = 200


@dataclass
class _Snapshot:
    gen: str | None
    policies: dict = field(default_factory=dict)  # id -> Policy | None
    routes: dict = field(default_factory=dict)  # (policy id, model name) -> Route | (status, code, message)
    route_errors: int = 0  # how many of `routes` are cached errors (MAX_CACHED_ROUTE_ERRORS)
    relay_keys: dict = field(default_factory=dict)  # key hash -> the row core.auth found for it
    born: float = field(default_factory=time.monotonic)


class Stale(Exception):
    """The generation a caller routed with is no longer the one in Redis (raised by the key pick)."""

    def __init__(self, gen: str):
        super().__init__(gen)
        self.gen = gen


class _Cache:
    def __init__(self):
        self.snapshot = _Snapshot(gen=None)

    def clear(self) -> None:
        self.snapshot = _Snapshot(gen=None)

    def current(self) -> _Snapshot | None:
        """The snapshot valid for the generation in Redis now; None when Redis cannot tell."""
        if generation.bump_pending():
            generation.retry_bump()
            if generation.bump_pending():
                return None
        try:
            client = get_redis()
            gen = client.get(GEN_KEY)
            if gen is None:
                client.set(GEN_KEY, generation.seed(), nx=True)
                gen = client.get(GEN_KEY)
        except redis.RedisError:
            self.clear()  # what was read before the outage is not trusted after it
            return None
        snap = self.snapshot
        if snap.gen != gen or time.monotonic() - snap.born > MAX_AGE_S:
            snap = _Snapshot(gen=gen)
            self.snapshot = snap
        return snap

    def held(self) -> _Snapshot | None:
        """The snapshot this process holds, without a round trip, for a caller that checks its
        generation itself (the key pick); `current()` when there is none worth holding."""
        snap = self.snapshot
        if snap.gen is None or generation.bump_pending() or time.monotonic() - snap.born > MAX_AGE_S:
            return self.current()
        return snap


_local_cache = _Cache()
# A bump drops this process's cache at once (and again at commit).
generation.on_bump(_local_cache.clear)
bump = generation.bump


def held() -> _Snapshot | None:
    """See `_Cache.held`: route with it, then let the key pick confirm its generation."""
    return _local_cache.held()


def peek() -> _Snapshot:
    """The snapshot this process holds, as it is (no round trip, no check): for what is kept with it."""
    return _local_cache.snapshot


Snapshot = _Snapshot  # for annotations elsewhere


def current() -> _Snapshot | None:
    """The snapshot valid for the generation in Redis now (one round trip); None when Redis cannot tell."""
    return _local_cache.current()


def route(policy_obj, model_name: str, compute, snap: _Snapshot | None = None):
    """`compute(policy, model_name)` → Route, cached per (policy, model). A RelayError it
    raises is cached too (as status, code, message) and raised afresh each time."""
    from core.errors import RelayError

    snap = snap or _local_cache.current()
    if snap is None:
        return compute(policy_obj, model_name)
    cache_key = (policy_obj.id, model_name)
    hit = snap.routes.get(cache_key)
    if hit is None:
        try:
            hit = compute(policy_obj, model_name)
        except RelayError as err:
            if len(model_name) > ROUTE_NAME_MAX or snap.route_errors >= MAX_CACHED_ROUTE_ERRORS:
                raise
            hit = (err.status, err.code, err.message, type(err))
            snap.route_errors += 1
        snap.routes[cache_key] = hit
    if isinstance(hit, tuple):
        status, code, message, cls = hit
        raise cls(status, code, message)
    return hit


# --- writes -------------------------------------------------------------------------------------


CATALOG_MODELS = (
    "relay.Host",
    "relay.LLMModel",
    "relay.Pricing",
    "relay.HostBinding",
    "relay.HostKey",
    "policies.Policy",
    "policies.PolicyHostKey",
    "policies.RateLimit",
    "policies.RateLimitRule",
    # What authenticates a relay key (core.auth caches the key's row with these).
    "relay.RelayKey",
    "relay.User",
    "relay.ServiceAccount",
    "relay.Project",
    "relay.Team",
)


def _on_write(sender, **kwargs):
    bump()


def connect_signals() -> None:
    """Called from the apps' ready(): every save/delete of a catalog model bumps."""
    from django.apps import apps
    from django.db.models.signals import post_delete, post_save

    for label in CATALOG_MODELS:
        model = apps.get_model(label)
        post_save.connect(_on_write, sender=model, dispatch_uid=f"catalog-save-{label}")
        post_delete.connect(_on_write, sender=model, dispatch_uid=f"catalog-delete-{label}")


def connect_m2m(through) -> None:
    """A many-to-many table of a catalog model bumps on change too (policies connects its pool's from ready())."""
    from django.db.models.signals import m2m_changed

    m2m_changed.connect(_on_write, sender=through, dispatch_uid=f"catalog-m2m-{through._meta.label}")
