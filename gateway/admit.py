"""Admission of a batch record against spend budgets: its worst case reserved before the call. Here, above usage,
because the worst case needs the record's route (its binding's pricing), which only the gateway resolves."""

from gateway import routing
from usage.budgets import Hold, applicable, reserve, worst_case_nanos
from usage.tokens import worst_case


def reserve_for_batch_call(call) -> Hold | None:
    """A batch record's worst case (price × its most possible tokens, less its discount) reserved on the spend
    budgets governing it, before its call (gateway.pipeline); None when none does. Raises BudgetExceeded. A live
    call is checked and charged by its view instead.

    The worst case is a bound (usage.tokens.worst_case), not the size estimate the provider quotas reserve:
    every slot of every worker reserves at once, and a record that costs more than it reserved overshoots the
    budget by the difference, so with estimates the overshoot grew with the slots in flight."""
    if call.source != "batch" or not applicable(call.principal, call.policy):
        return None
    policy = call.policy or routing.load_policy(call.principal.policy_id)
    route = routing.resolve(policy, call.body.get("model"))  # cached; a routing error is the call's answer
    worst = worst_case_nanos(route.binding.pricing, worst_case(call.body), batch_discount_percent=call.discount_percent)
    return reserve(call.principal, policy, worst)
