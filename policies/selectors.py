"""A policy as the catalog snapshot holds it: read once per catalog generation, with its rate limit, rules and
host-key pool. Above core's catalog (which caches it and knows nothing of policies)."""

from core import catalog


def _load(policy_id: int):
    from policies.models import Policy

    policy = (
        Policy.objects.select_related("rate_limit").prefetch_related("rate_limit__rules").filter(pk=policy_id).first()
    )
    if policy is not None:
        policy.__dict__["_pool_memo"] = policy.pool()  # read once, kept with the instance
    return policy


def policy(policy_id: int, snap: catalog.Snapshot | None = None):
    """The policy with its rate limit, rules and host-key pool loaded; None if there is none.
    From `snap` when given (a held snapshot), else from the snapshot current in Redis."""
    snap = snap or catalog.current()
    if snap is None:
        return _load(policy_id)
    try:
        return snap.policies[policy_id]
    except KeyError:
        pass
    value = _load(policy_id)
    snap.policies[policy_id] = value
    return value
