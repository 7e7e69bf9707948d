"""Routing: a request's `model` → the policy's grants → an enabled binding → host, adapter, keys.

Errors and their statuses follow the product (relay-product.md A6): 404
`model_not_found`, 403 `no_policy` / `policy_disabled` / `model_not_allowed`,
503 `no_host_binding` / `no_keys`.
"""

import contextlib
from dataclasses import dataclass

from core import catalog
from core.crypto import SecretUnavailable
from core.errors import RelayError, clipped
from core.grants import granted
from core.models import HostBinding, HostKey, LLMModel
from policies import selectors as policy_selectors
from policies.models import Policy


@dataclass
class Route:
    policy: Policy
    model: LLMModel
    binding: HostBinding
    keys: list[HostKey]  # the policy's pool keys on the binding's host, in declared order

    @property
    def host(self):
        return self.binding.host

    @property
    def adapter(self) -> str:
        return self.binding.adapter


class RoutingError(RelayError):
    pass


def load_policy(policy_id: int | None, snap=None) -> Policy:
    """The policy from the per-process catalog cache (core.catalog): no query while the
    catalog is unchanged. `snap`: a held snapshot (see catalog.held) instead of the current one."""
    policy = policy_selectors.policy(policy_id, snap) if policy_id else None
    if policy is None:
        raise RoutingError(403, "no_policy", "no policy is bound to this principal")
    return policy


def resolve(policy: Policy, model_name, snap=None) -> Route:
    if not policy.enabled:
        raise RoutingError(403, "policy_disabled", f"policy {policy.name} is disabled")
    if not isinstance(model_name, str) or not model_name:
        raise RelayError(400, "invalid_request", "the request body needs a 'model' string")
    # Cached per (policy, model) until the next catalog write, errors included.
    return catalog.route(policy, model_name, _resolve, snap)


def _resolve(policy: Policy, model_name: str) -> Route:
    # One query for the model and its bindings; the model alone only on the error path.
    bindings = list(
        HostBinding.objects.filter(model__name=model_name).select_related("model", "host", "pricing").order_by("id")
    )
    if not bindings:
        if not LLMModel.objects.filter(name=model_name).exists():
            raise RoutingError(404, "model_not_found", f"model {clipped(model_name)} does not exist")
        raise RoutingError(503, "no_host_binding", f"model {model_name} has no host binding")
    model = bindings[0].model
    allowed = [b for b in bindings if granted(policy.grants, model.provider, model.name, b.host.name)]
    if not allowed:
        raise RoutingError(403, "model_not_allowed", f"model {model_name} is not allowed by policy {policy.name}")
    enabled = [b for b in allowed if b.enabled]
    if not enabled:
        raise RoutingError(503, "no_host_binding", f"model {model_name} has no enabled host binding")
    pool = [k for k in policy.pool() if k.enabled]
    # Prefer the first binding whose host has keys in the policy's pool.
    for binding in enabled:
        keys = [k for k in pool if k.host_id == binding.host_id]
        if keys:
            return Route(policy=policy, model=model, binding=binding, keys=keys)
    raise RoutingError(503, "no_keys", f"policy {policy.name} has no enabled host key for {enabled[0].host.name}")


# What `warm` loads at most: a bound on a worker's start-up time, whatever the catalog's size.
WARM_POLICIES = 50
WARM_ROUTES = 500


def warm() -> int:
    """Load every enabled policy and resolve its routes (to each model with a binding) into the catalog
    cache, with one snapshot; returns the routes resolved. A Celery worker calls it in its parent
    process before the pool processes are forked (relay/celery.py), so they start with the catalog
    loaded. Measured (`make bench`, scale-out: 24 pool processes taking their first item at once on 2
    cores): the first item of each spent ~150 ms of its 1.45 s loading the policy and its route."""
    snap = catalog.current()
    if snap is None:  # Redis cannot tell which catalog is current: nothing can be cached
        return 0
    if snap.policies:  # loaded already: a pool process that inherited its parent's current snapshot
        return 0
    names = list(HostBinding.objects.order_by().values_list("model__name", flat=True).distinct()[:WARM_ROUTES])
    resolved = 0
    for policy_id in Policy.objects.filter(enabled=True).order_by("id").values_list("id", flat=True)[:WARM_POLICIES]:
        policy = policy_selectors.policy(policy_id, snap)
        for name in names:
            if resolved >= WARM_ROUTES:
                return resolved
            try:
                route = resolve(policy, name, snap)
            except RelayError:  # not granted, no key: cached as such, as a request would find it
                pass
            else:
                for key in route.keys:  # decrypted once, kept with the cached instance
                    with contextlib.suppress(SecretUnavailable):
                        key.get_value()
            resolved += 1
    return resolved
