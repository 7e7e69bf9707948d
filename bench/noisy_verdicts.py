"""The noisy-neighbour drill's verdicts: what tenant A achieved (its streams' billing, its provider-mode spend, the
headers that reached the provider) and, per attack, whether it was contained. bench/noisy_core.py holds the tenants
and the attacks; this module only reads what they left behind.

The process running this has Django set up on the relay's database (the drill's stack, or the test's).
"""

import time
from collections import Counter
from dataclasses import dataclass

import requests

from bench.noisy_core import (
    A_BETAS,
    A_HEADERS,
    BATCH_FLOOR_S,
    BATCH_RATIO,
    HANG_UP_AFTER,
    LIVE_CALLS,
    P50_RATIO,
    PROVIDER_RECORDS,
    SLOW_CALLS,
    STREAM_TOLERANCE,
    STREAMS,
    TEST_ANSWER_BOUND_S,
    WEBHOOK_ENDPOINTS,
    AFigures,
    BFigures,
    Tenants,
    batch_pk,
)
from bench.noisy_upstream import PROBED_HEADERS

# --- what A achieved ------------------------------------------------------------------------------------


def stream_billing(a: AFigures, seen: dict, settle_s: float = 15.0) -> list[dict]:
    """Per hung-up stream: the tokens its usage event charged against what the provider had produced when
    the connection was closed (prompt words + the words of the chunks it sent)."""
    from usage.models import UsageEvent

    out = []
    for tag, rid in a.stream_ids.items():
        provider = (seen.get("streams") or {}).get(tag) or {}
        event = None
        deadline = time.monotonic() + settle_s
        while rid and event is None and time.monotonic() < deadline:
            event = UsageEvent.objects.filter(request_id=rid).first()
            if event is None:
                time.sleep(0.25)
        # "Produced" is the provider's output: the estimate of it is what the relay relayed. The input side is
        # judged only as charged at all: the relay estimates it from the whole request, the fake counts words.
        produced = provider.get("words") or 0
        billed_out = event.output_tokens if event else 0
        billed_in = event.input_tokens if event else 0
        out.append(
            {
                "tag": tag,
                "event": event is not None,
                "billed_in": event.input_tokens if event else 0,
                "billed_out": event.output_tokens if event else 0,
                "cost": (event.billed_cost_nano_usd or event.cost_nano_usd or 0) if event else 0,
                "estimated": getattr(event, "usage_estimated", None) if event else None,
                "provider_in": provider.get("prompt_words") or 0,
                "provider_out": provider.get("words") or 0,
                "closed_by_client": provider.get("closed_by_client"),
                "within": produced > 0
                and billed_in > 0
                and abs(billed_out - produced) <= STREAM_TOLERANCE * produced
                and getattr(event, "usage_estimated", None) is not False,
            }
        )
    return out


def provider_spend(tenants: Tenants, a: AFigures, settle_s: float = 30.0) -> dict:
    """A's provider-mode spend against its budget, once nothing of its jobs is in flight: every batch past
    validation and no job being sent, run or read (or `settle_s` gone, then `settled` is False)."""
    from batches.models import Batch, Item
    from batches.provider.models import JobStatus, ProviderJob
    from usage.models import UsageEvent

    pks = [batch_pk(p) for p in a.provider_batches]
    busy = (JobStatus.SUBMITTING, JobStatus.RUNNING, JobStatus.INGESTING)
    deadline = time.monotonic() + settle_s
    settled, quiet_since = False, None
    while time.monotonic() < deadline:
        items = Item.objects.filter(batch_id__in=pks).count()
        in_flight = ProviderJob.objects.filter(batch_id__in=pks, status__in=busy).exists()
        final = Batch.objects.filter(pk__in=pks, completed_at__isnull=False).count()
        calm = items == PROVIDER_RECORDS * len(pks) and not in_flight
        if final == len(pks) or (calm and quiet_since and time.monotonic() - quiet_since >= 3.0):
            settled = True
            break
        quiet_since = (quiet_since or time.monotonic()) if calm else None
        time.sleep(0.25)
    events = UsageEvent.objects.filter(
        principal_kind="serviceaccount", principal_id=tenants.a_batch_sa, executed_by="provider"
    )
    per_batch: dict = {}
    for batch_id, cost, billed in events.values_list("batch_id", "cost_nano_usd", "billed_cost_nano_usd"):
        per_batch[batch_id] = per_batch.get(batch_id, 0) + (billed if billed is not None else cost or 0)
    spend = sum(per_batch.values())
    one_job = max(per_batch.values(), default=0)
    jobs = list(ProviderJob.objects.filter(batch_id__in=pks).values_list("status", flat=True))
    return {
        "settled": settled,
        "spend": spend,
        "budget": tenants.a_batch_budget_nanos,
        "one_job": one_job,
        "records_billed": events.count(),
        "jobs": jobs,
        "within": settled and spend <= tenants.a_batch_budget_nanos + one_job,
    }


def headers_reached(seen: dict) -> list[dict]:
    """The provider-side sightings of a header value tenant A chose."""
    mine = {v.lower() for v in A_HEADERS.values()} | {b.strip().lower() for b in A_BETAS.split(",")}
    out = []
    for row in seen.get("headers") or []:
        values = {v.strip().lower() for v in str(row["value"]).split(",")}
        if row["header"] in PROBED_HEADERS and values & mine:
            out.append(row)
    return out


def seen_by_provider(upstream_url: str) -> dict:
    return requests.get(f"{upstream_url}/_noisy/seen", timeout=30).json()


# --- the verdicts ---------------------------------------------------------------------------------------


@dataclass
class Verdict:
    attack: str
    contained: bool
    line: str


def _s(value: float | None) -> str:
    return "—" if value is None else f"{value:.1f} s"


def _usd(nanos: int) -> str:
    return f"${nanos / 1e9:.6f}"


def verdicts(quiet: BFigures | None, b: BFigures, a: AFigures, billing: list, spend: dict, reached: list) -> list:
    """One verdict per attack; `quiet` None (the test's single round): B's batches need only complete."""
    out = []
    bounds, late = {}, []
    for surface, took in b.batch_s.items():
        before = quiet.batch_s.get(surface) if quiet else None
        bounds[surface] = max(BATCH_RATIO * before, BATCH_FLOOR_S) if before is not None else None
        if took is None or (bounds[surface] is not None and took > bounds[surface]):
            late.append(surface)
    test_ok = a.test_answer_s is not None and a.test_answer_s <= TEST_ANSWER_BOUND_S
    refused = ", ".join(f"{s} {c}" for s, c in sorted(set(a.endpoints_refused))) or "none"
    times = ", ".join(
        f"{surface} {_s(quiet.batch_s.get(surface) if quiet else None)} → {_s(took)} ({b.batch_status[surface]}"
        + (f", bound {bounds[surface]:.1f} s)" if bounds[surface] is not None else ")")
        for surface, took in b.batch_s.items()
    )
    out.append(
        Verdict(
            "webhooks",
            not late and test_ok,
            f"A: {WEBHOOK_ENDPOINTS} endpoints asked, {a.endpoints_created} made (refused: {refused}), "
            f"{len(a.hook_batches)} batches ended, `test` answered {a.test_status} in {_s(a.test_answer_s)} "
            f"(bound {TEST_ANSWER_BOUND_S:g} s) | B's batches quiet → attacked: {times}",
        )
    )
    counted = Counter(f"{s} {c}" for s, c in a.slow_statuses)
    slow = ", ".join(f"{n} x {what}" for what, n in counted.most_common()) or "none answered"
    b_refused = ", ".join(f"{n} x {s} {c}" for (s, c), n in Counter(b.refused).most_common()) or "none"
    q_refused = len(quiet.refused) if quiet else "—"
    out.append(
        Verdict(
            "read timeouts",
            not b.refused and not b.bench_events and not b.items_failed and a.slow_rounds > 0,
            f"A: {SLOW_CALLS} calls at a time past the read timeout all through B's run ({slow}) | "
            f"B: live refused {q_refused} → {len(b.refused)} "
            f"({b_refused}), no_keys events {b.bench_events}, batch records failed {b.items_failed}",
        )
    )
    parts = [
        (f"{row['billed_in']}+{row['billed_out']}" if row["event"] else "no usage event")
        + f" vs {row['provider_in']}+{row['provider_out']}"
        + (" (usage_estimated)" if row["estimated"] else "")
        for row in billing
    ]
    out.append(
        Verdict(
            "hung-up streams",
            bool(billing) and all(row["within"] for row in billing) and len(billing) == STREAMS,
            f"A: {len(billing)} streams closed after {HANG_UP_AFTER} chunks; billed in+out tokens vs the provider's "
            f"prompt words + output produced (output within ±{STREAM_TOLERANCE:.0%}, input > 0): "
            f"{'; '.join(parts) or 'none'}",
        )
    )
    out.append(
        Verdict(
            "provider-mode budget",
            spend["within"],
            f"A: budget {_usd(spend['budget'])}, {len(a.provider_batches)} batches x {PROVIDER_RECORDS} records at the "
            f"provider: spent {_usd(spend['spend'])} ({spend['records_billed']} records billed) vs budget + one job "
            f"{_usd(spend['budget'] + spend['one_job'])}; jobs {sorted(spend['jobs'])}"
            + ("" if spend["settled"] else "; NOT SETTLED (jobs still moving when the drill stopped looking)"),
        )
    )
    seen = sorted({f"{r['header']}: {r['value']} ({r['path']})" for r in reached})
    # A call that failed for another reason never reached the provider: it proves nothing either way. A 4xx is
    # the relay refusing the header (contained); a 5xx is not judged.
    answered = len(a.header_statuses) == 2 and all(status < 500 for _, status in a.header_statuses)
    calls = ", ".join(f"{path} {status}" for path, status in a.header_statuses)
    out.append(
        Verdict(
            "provider headers",
            answered and not reached,
            f"A sent OpenAI-Organization, OpenAI-Project, anthropic-beta on live calls ({calls}) and on its provider "
            f"batches; the provider saw: {'; '.join(seen) or 'none of them'}",
        )
    )
    return out


def b_live_line(quiet: BFigures | None, b: BFigures) -> str:
    q = quiet.p50_ms if quiet else None
    ratio = f" (x{b.p50_ms / q:.2f}, bound x{P50_RATIO:g}: printed, not judged)" if q and b.p50_ms else ""
    return (
        f"B live: {LIVE_CALLS} calls, p50 {'—' if q is None else f'{q:.0f} ms'} → {b.p50_ms or 0:.0f} ms{ratio}, "
        f"refused {len(quiet.refused) if quiet else '—'} → {len(b.refused)}"
    )
