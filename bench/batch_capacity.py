"""The batch benchmark's drains against a capacity: more worker processes (scale-out), and a provider
that rate-limits its keys. Run by bench/batch.py.
"""

import time
from pathlib import Path

import requests

from bench import catalog
from bench.batch_drain import SLOTS, throughput, wait_completed


def scale_out(stack, web, key, upstream, n: int, latency_ms: float, workers: int, item_bytes: int, procs) -> dict:
    """`workers` Celery workers (8 slots each; the first one runs the sweeper) drain `n` items at
    `latency_ms`: items/s against workers x 8 slots / latency."""
    started = [stack.start_worker()]
    for i in range(1, workers):
        started.append(stack.start_worker(name=f"bench{i + 1}", beat=False))
    procs["workers"] = started
    try:
        t = throughput(web, key, upstream, stack.tmp, n, latency_ms, item_bytes, {}, slots=workers * SLOTS)
    finally:
        for w in started:
            w.stop()
        procs.pop("workers", None)
    ideal = workers * SLOTS / (latency_ms / 1000)
    return {"workers": workers, "rate": t["rate"], "ideal": ideal, "ratio": t["rate"] / ideal, "tp": t}


def rate_limited_drain(
    web, key, upstream, tmp: Path, n: int, latency_ms: float, key_rps: float, limit_headers: bool = True
) -> dict:
    """An OpenAI-compatible batch (inline `requests`) for the model whose two host keys the fake
    upstream limits to `key_rps` requests/s each (429 + Retry-After beyond). The drain rate is the
    items that completed with 200 divided by the time from the create's answer to the batch's
    completion, but never less than n / limit (no batch drains faster), against the 2 x key_rps the
    provider allows: 1.0 means every item went through as fast as the provider lets. Items that
    failed (429) count for nothing, so a batch that gives up on a busy provider scores low however
    fast it ends."""
    from django.db.models import Count, Max

    from batches.models import Batch, Item

    upstream.configure(latency_ms)
    config = {"key_rps": key_rps, "limit_headers": limit_headers}
    requests.post(f"{upstream.url}/_bench/config", json=config, timeout=10).raise_for_status()
    upstream.reset_stats()
    records = [
        {
            "custom_id": f"rl-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": dict(catalog.chat_body(i), model=catalog.RL_MODEL),
        }
        for i in range(n)
    ]
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": records}
    t0 = time.time()
    resp = requests.post(f"{web.url}/v1/batches", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    t_created = time.time()
    if resp.status_code not in (200, 202):
        return {"skipped": f"POST /v1/batches answered {resp.status_code}: {resp.text[:300]}"}
    batch_pk = resp.json()["id"].removeprefix("batch_")
    limit = 2 * key_rps
    wait_completed(batch_pk, timeout=max(600, n / limit * 20))
    batch = Batch.objects.get(pk=batch_pk)
    items = Item.objects.filter(batch_id=batch_pk)
    states = {row["state"]: row["n"] for row in items.values("state").annotate(n=Count("id"))}
    ok = items.filter(state="completed", status_code=200)
    n_ok = ok.count()
    last = items.aggregate(last=Max("finished_at"))["last"]
    end = batch.completed_at or last
    seconds = max(end.timestamp() - t_created, 1e-3) if end else float("nan")
    codes = {row["status_code"]: row["n"] for row in items.values("status_code").annotate(n=Count("id"))}
    stats = upstream.stats()
    requests.post(f"{upstream.url}/_bench/config", json={"key_rps": 5}, timeout=10)
    rate = n_ok / max(seconds, n / limit) if n_ok and seconds > 0 else 0.0
    return {
        "n": n,
        "key_rps": key_rps,
        "limit_headers": limit_headers,
        "limit": limit,
        "ok": n_ok,
        "rate": rate,
        "fraction": rate / limit,
        "seconds": seconds,
        "batch_seconds": end.timestamp() - t0 if end else float("nan"),
        "states": states,
        "status_codes": codes,
        "upstream_requests": stats["requests"],
        "upstream_429": stats.get("rate_limited", 0),
    }
