"""The noisy-neighbour guarantee: what one tenant sends or registers costs only that tenant.

The drill's attacked round (bench/noisy_core.py; `make noisy-drill` runs it beside a quiet round and prints the
table) against the suite's processes: the production web server, the background processes as compose declares
them, and the drill's fake provider. Tenant A registers dead webhook endpoints and ends batches, keeps calls in
flight that time out at the provider, hangs up streams, sends provider-mode batches on a $0 budget and chooses
provider headers; tenant B runs live calls and an OpenAI, an Anthropic and a native batch meanwhile. Asserted
are counts, never timings: B refused 0 times and its batches completed, A's streams billed, A's provider spend
within one job of its budget, none of A's headers at the provider. The verdicts' own rules are checked on
figures made up here (unit tier)."""

import subprocess
import sys

import pytest

from bench import noisy_core, noisy_verdicts
from bench.noisy_core import AFigures, BFigures
from tests.workers import ROOT, production_web, stop_process_group

# B's batches take about a second here; without the webhook lane they were still validating after 240 s.
B_BATCH_WAIT_S = 60.0


@pytest.fixture(scope="module")
def worker_env():
    return dict(noisy_core.DRILL_ENV)


@pytest.fixture
def provider():
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.noisy_upstream", "--delay-ms", "20"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    line = proc.stdout.readline().decode().strip()
    assert line.startswith("READY "), line
    yield line.split(" ", 1)[1]
    stop_process_group(proc)
    proc.stdout.close()


@pytest.fixture
def relay(transactional_db):
    from django.db import connection

    with production_web(connection.settings_dict, log_prefix="relay-web-noisy-", env=noisy_core.DRILL_ENV) as web:
        yield web


@pytest.fixture
def dead_receiver():
    receiver = noisy_core.DeadReceiver()
    yield receiver
    receiver.stop()


@pytest.mark.e2e
def test_no_tenant_can_slow_bench_steer_or_dodge_the_bill_for_another(worker, relay, provider, dead_receiver):
    assert worker.alive(), worker.output()
    tenants = noisy_core.seed(provider)
    b, a = noisy_core.attacked_round(relay.url, tenants, dead_receiver, wait_s=B_BATCH_WAIT_S)
    seen = noisy_verdicts.seen_by_provider(provider)
    billing = noisy_verdicts.stream_billing(a, seen)
    spend = noisy_verdicts.provider_spend(tenants, a)
    verdicts = noisy_verdicts.verdicts(None, b, a, billing, spend, noisy_verdicts.headers_reached(seen))
    report = "\n".join(f"{v.attack}: {'contained' if v.contained else 'NOT CONTAINED'}: {v.line}" for v in verdicts)
    assert not a.errors, a.errors
    # Each attack really happened: the provider held A's slow calls until the relay gave up on them, its
    # streams were cut, the dead receiver was dialled.
    assert a.slow_rounds >= 1 and seen["slow_closed"] >= noisy_core.SLOW_CALLS, report
    assert all(row["closed_by_client"] for row in billing) and len(billing) == noisy_core.STREAMS, report
    assert dead_receiver.accepted >= 1, report
    assert [v.attack for v in verdicts if not v.contained] == [], report
    assert b.refused == [] and b.bench_events == 0 and b.items_failed == 0, report
    assert all(took is not None for took in b.batch_s.values()), report


# --- the verdicts' rules ---------------------------------------------------------------------------------


def _b(**kw) -> BFigures:
    figures = BFigures(live_ms=[50.0, 60.0], batch_s={"openai": 1.0, "anthropic": 1.0, "native": 1.0})
    figures.batch_status = {s: "completed" for s in figures.batch_s}
    figures.__dict__.update(kw)
    return figures


def _a(**kw) -> AFigures:
    a = AFigures(test_answer_s=0.1, test_status=202, slow_rounds=2, header_statuses=[("chat", 200), ("messages", 400)])
    a.__dict__.update(kw)
    return a


def _stream(**kw) -> dict:
    row = {"tag": "s", "event": True, "billed_in": 30, "billed_out": 100, "cost": 1, "estimated": True}
    row.update(provider_in=5, provider_out=100, closed_by_client=True, within=True)
    row.update(kw)
    return row


SPEND = {"settled": True, "spend": 0, "budget": 0, "one_job": 0, "records_billed": 0, "jobs": [], "within": True}


def _verdicts(quiet=None, b=None, a=None, billing=None, spend=None, reached=()):
    billing = [_stream() for _ in range(noisy_core.STREAMS)] if billing is None else billing
    out = noisy_verdicts.verdicts(quiet, b or _b(), a or _a(), billing, spend or SPEND, list(reached))
    return {v.attack: v.contained for v in out}


def test_every_attack_contained_when_the_figures_say_so():
    assert set(_verdicts().values()) == {True}


def test_a_batch_of_b_past_its_bound_or_a_slow_test_is_not_contained():
    quiet = _b(batch_s={"openai": 2.0, "anthropic": 2.0, "native": 2.0})
    assert _verdicts(quiet, _b(batch_s={"openai": 9.9, "anthropic": 1.0, "native": 1.0}))["webhooks"]
    assert not _verdicts(quiet, _b(batch_s={"openai": 10.1, "anthropic": 1.0, "native": 1.0}))["webhooks"]
    assert not _verdicts(quiet, _b(batch_s={"openai": None, "anthropic": 1.0, "native": 1.0}))["webhooks"]
    assert not _verdicts(a=_a(test_answer_s=10.2, test_status=400))["webhooks"]


def test_one_refusal_of_b_or_no_slow_call_back_is_not_contained():
    assert not _verdicts(b=_b(refused=[(503, "no_keys")]))["read timeouts"]
    assert not _verdicts(b=_b(items_failed=1))["read timeouts"]
    assert not _verdicts(a=_a(slow_rounds=0))["read timeouts"]


def test_a_stream_billed_nothing_or_far_from_what_was_produced_is_not_contained():
    assert not _verdicts(billing=[_stream(within=False)] * noisy_core.STREAMS)["hung-up streams"]
    assert not _verdicts(billing=[])["hung-up streams"]


def test_headers_are_judged_only_on_calls_that_were_answered():
    seen = {
        "headers": [
            {"path": "/v1/chat/completions", "header": "openai-organization", "value": "org-operator"},
            {"path": "/v1/messages", "header": "anthropic-beta", "value": "prompt-caching-2024-07-31"},
        ]
    }
    assert noisy_verdicts.headers_reached(seen) == []  # the operator's own values are not A's doing
    seen["headers"].append({"path": "/v1/messages", "header": "anthropic-beta", "value": "mcp-client-2025-04-04"})
    assert [row["value"] for row in noisy_verdicts.headers_reached(seen)] == ["mcp-client-2025-04-04"]
    assert not _verdicts(reached=noisy_verdicts.headers_reached(seen))["provider headers"]
    assert not _verdicts(a=_a(header_statuses=[("chat", 503), ("messages", 400)]))["provider headers"]
