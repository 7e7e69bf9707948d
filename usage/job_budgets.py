"""Spend budgets for provider batch jobs: one reservation for a job's records, settled chunk by chunk
(usage.budgets holds the budgets, their periods and the reserve/settle primitives this builds on).

A provider job is sent by one process and its results are written by others, hours later: its reservation is
kept on the job row (as JSON), not in a process's memory, and lives as long as the job.
"""

from datetime import timedelta

from django.db import transaction
from django.db.models import F
from django.utils import timezone

from usage.budgets import Hold, _add, _index, _period_id, reserve, settle
from usage.models import BudgetHold


def reserve_for_job(principal, policy, worst_nanos: int, per_record: int, ttl: timedelta) -> dict | None:
    """`reserve` for the records of a provider batch job (their summed worst case, `per_record` each), all or
    none; its holds live `ttl` (the provider's window, not a record's deadline). Returns what the job keeps:
    {"holds": [[hold id, period id, nanos]], "budgets": [ids], "per_record": nanos}; None when no budget
    applies. Raises BudgetExceeded. Call inside the transaction that records it on the job, so a process
    that dies in between leaves neither."""
    hold = reserve(principal, policy, worst_nanos)
    if hold is None:
        return None
    BudgetHold.objects.filter(pk__in=[part[0] for part in hold.parts]).update(expires_at=timezone.now() + ttl)
    return {
        "holds": [list(part) for part in hold.parts],
        "budgets": [budget.id for budget in hold.budgets],
        "per_record": max(0, int(per_record)),
    }


def settle_job_part(held: dict | None, records: int, billed_nanos: int | None) -> None:
    """Some of a job's records are final (a chunk of its results written): their share of the reservation
    (`records` × per_record, never more than a hold still has) is given back and their billed cost charged
    to the budgets reserved on. Call inside the transaction that writes the chunk."""
    if not held:
        return
    now = timezone.now()
    deltas: dict[int, list[int]] = {}
    if billed_nanos:
        by_id = {b.id: b for found in _index().by_scope.values() for b in found}
        budgets = [by_id[i] for i in held.get("budgets") or () if i in by_id]
        for budget in budgets:
            pid = _period_id(budget, now)
            if pid is not None:
                deltas.setdefault(pid, [0, 0])[0] += billed_nanos
    give_back = max(0, int(held.get("per_record") or 0)) * max(0, records)
    with transaction.atomic():
        if give_back:
            ids = [part[0] for part in held.get("holds") or ()]
            rows = BudgetHold.objects.select_for_update().filter(pk__in=ids).values_list("id", "period_id", "nanos")
            for hold_id, pid, nanos in rows:
                take = min(nanos, give_back)
                if take:
                    BudgetHold.objects.filter(pk=hold_id).update(nanos=F("nanos") - take)
                    deltas.setdefault(pid, [0, 0])[1] -= take
        _add(deltas)


def release_job_hold(held: dict | None) -> None:
    """What is left of a job's reservation given back (the job ended, or its records went back to the relay's
    workers, which reserve their own): `settle` with nothing charged, on the holds as they stand now."""
    if not held:
        return
    ids = [part[0] for part in held.get("holds") or ()]
    with transaction.atomic():
        rows = BudgetHold.objects.select_for_update().filter(pk__in=ids).values_list("id", "period_id", "nanos")
        parts = tuple((hold_id, pid, nanos) for hold_id, pid, nanos in rows)
        if parts:
            settle(Hold(parts=parts, budgets=()), None)
