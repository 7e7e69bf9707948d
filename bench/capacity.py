"""Sharing capacity: live traffic beside a draining batch on one host key, and a provider
that limits tokens.

    python -m bench.capacity            (BENCH_QUICK=1: smaller runs)

`run(quick)` returns a dict of figures and prints them:
- live alone vs live with a batch draining on the same key (a provider quota of N requests per window
  the relay learns from the headers): live p50/p99 latency and the share of live requests refused
  (429 or 503 no_keys), and what the batch drained against what live left of the quota;
- a provider that limits tokens per window: the share of calls it answered 429, and the tokens it
  served against its limit (the drain ratio).

Live and batch calls go through the relay's pipeline (`gateway.pipeline.dispatch`: the key pick, the
learned quotas, live first, breakers) in this process's threads, with the real PostgreSQL and Redis,
against fake providers on loopback; the batch is a pool of 8 slots that each take the next record
and, when the pipeline answers "no capacity", wait what it says, as a batch worker's slot does. It
measures the relay's pacing decisions, not the web or worker processes (bench/batch.py does those).
"""

import json
import logging
import math
import threading
import time
from http.server import ThreadingHTTPServer

from devkit.upstream import DemoUpstream, _Handler, canned

log = logging.getLogger(__name__)


class TokenLimitedUpstream(DemoUpstream):
    """A provider that limits tokens per key per fixed window, as OpenAI's TPM limits do: a request is
    counted at its start for its prompt plus its `max_tokens` and settled to its real usage at its end;
    one that does not fit gets 429 with Retry-After. Every answer carries OpenAI's
    `x-ratelimit-{limit,remaining,reset}-tokens`. Its answers use half their `max_tokens`.
    `limit_requests`: also a request quota per window, with `x-ratelimit-*-requests` (None: none)."""

    def __init__(self, limit_tokens: int | None, window: float = 1.0, delay: float = 0.0, limit_requests=None):
        super().__init__()
        self.RequestHandlerClass = _TokenHandler
        self.limit_tokens = limit_tokens
        self.limit_requests = limit_requests
        self.window = window
        self.delay = delay
        self.windows: dict[str, list] = {}  # key -> [window index, tokens counted, requests counted]
        self.stats = {"ok": 0, "limited": 0, "tokens": 0}

    def reset_stats(self) -> None:
        with self.lock:
            self.windows.clear()
            self.stats = {"ok": 0, "limited": 0, "tokens": 0}

    def _state(self, key: str, now: float) -> list:
        idx = int(now // self.window)
        state = self.windows.get(key)
        if state is None or state[0] != idx:
            state = self.windows[key] = [idx, 0, 0]
        return state

    def admit(self, key: str, cost: int) -> tuple[bool, int]:
        """Count a request of `cost` tokens at its start: (admitted, its window index)."""
        with self.lock:
            state = self._state(key, time.time())
            fits = self.limit_tokens is None or state[1] + cost <= self.limit_tokens
            fits = fits and (self.limit_requests is None or state[2] + 1 <= self.limit_requests)
            if fits:
                state[1] += cost
                state[2] += 1
                self.stats["ok"] += 1
            else:
                self.stats["limited"] += 1
            return fits, state[0]

    def settle(self, key: str, idx: int, counted: int, used: int) -> None:
        with self.lock:
            self.stats["tokens"] += used
            state = self.windows.get(key)
            if state is not None and state[0] == idx:
                state[1] += used - counted

    def headers(self, key: str) -> dict:
        now = time.time()
        with self.lock:
            state = self._state(key, now)
            reset_ms = max(1, int(((state[0] + 1) * self.window - now) * 1000))
            out = {}
            if self.limit_tokens is not None:
                out.update(
                    {
                        "x-ratelimit-limit-tokens": self.limit_tokens,
                        "x-ratelimit-remaining-tokens": max(0, self.limit_tokens - state[1]),
                        "x-ratelimit-reset-tokens": f"{reset_ms}ms",
                    }
                )
            if self.limit_requests is not None:
                out.update(
                    {
                        "x-ratelimit-limit-requests": self.limit_requests,
                        "x-ratelimit-remaining-requests": max(0, self.limit_requests - state[2]),
                        "x-ratelimit-reset-requests": f"{reset_ms}ms",
                    }
                )
            return out, reset_ms


def _words(text: str) -> int:
    return max(1, len(text.split()))


class _TokenHandler(_Handler):
    server: TokenLimitedUpstream

    def _answer(self, srv, key, body, raw=b""):
        prompt = " ".join(str(m.get("content", "")) for m in body.get("messages") or [] if isinstance(m, dict))
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        prompt_tokens = _words(prompt)
        counted = prompt_tokens + max_tokens
        admitted, idx = srv.admit(key, counted)
        if not admitted:
            headers, reset_ms = srv.headers(key)
            headers["Retry-After"] = max(1, math.ceil(reset_ms / 1000))
            error = {"message": "Rate limit reached for tokens", "type": "tokens", "code": "rate_limit_exceeded"}
            return self._send(429, {"error": error}, headers)
        if srv.delay:
            time.sleep(srv.delay)
        answer = canned(self.path, body)
        completion = max(1, max_tokens // 2)
        answer["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
        srv.settle(key, idx, counted, prompt_tokens + completion)
        headers, _ = srv.headers(key)
        return self._send(200, answer, headers)

    def _send(self, status: int, answer: dict, headers: dict) -> None:
        payload = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        for name, value in headers.items():
            self.send_header(name, str(value))
        self.end_headers()
        self.wfile.write(payload)


def start(server: ThreadingHTTPServer) -> ThreadingHTTPServer:
    threading.Thread(target=server.serve_forever, name="capacity-upstream", daemon=True).start()
    return server


# --- the measurement -------------------------------------------------------------------------------

SLOTS = 8  # a batch worker's item slots


def _seed(provider_url: str, name: str, batch_share: str = "0.80"):
    """A team, project and service account, a host on `provider_url` with one key, a policy: the
    principal whose calls the bench makes."""
    from decimal import Decimal

    from core import auth
    from core.models import Host, HostBinding, HostKey, LLMModel, Project, ServiceAccount, Team
    from core.services import create_relay_key
    from policies.models import Policy, PolicyHostKey

    team = Team.objects.create(name=f"cap-{name}")
    project = Project.objects.create(name=f"cap-{name}", team=team)
    sa = ServiceAccount.objects.create(project=project, name=f"cap-{name}")
    host = Host.objects.create(name=f"cap-{name}", base_url=provider_url)
    model = LLMModel.objects.create(name=f"model-{name}", provider="openai")
    HostBinding.objects.create(model=model, host=host, adapter="openai", upstream_name="gpt-4o")
    key = HostKey(name=f"cap-{name}", host=host)
    key.set_value(f"sk-capacity-{name}")
    key.save()
    policy = Policy.objects.create(name=f"cap-{name}", project=project, grants=["*"], batch_share=Decimal(batch_share))
    PolicyHostKey.objects.create(policy=policy, host_key=key, position=0)
    sa.policy = policy
    sa.save()
    _, plaintext = create_relay_key(service_account=sa, name=f"cap-{name}")
    return auth.principal_for_key(plaintext), model.name


def _call(principal, model: str, source: str, i: int, max_tokens: int = 16):
    import uuid

    from gateway import pipeline

    body = {"model": model, "max_tokens": max_tokens, "messages": [{"role": "user", "content": f"record {i}"}]}
    started = time.monotonic()
    outcome = pipeline.dispatch(
        pipeline.Call(
            path="/v1/chat/completions",
            body=body,
            principal=principal,
            source=source,
            request_id=str(uuid.uuid4()),
            deadline=time.monotonic() + 60,
        )
    )
    return outcome, time.monotonic() - started


def _batch_slots(principal, model: str, stop: threading.Event, served: list, records=None, max_tokens=16):
    """SLOTS threads, each taking the next record and, when the pipeline says there is no capacity,
    waiting what it says (as a batch worker's slot does). `records`: a list to drain (None: forever)."""
    from django.db import connection

    lock = threading.Lock()
    counter = iter(range(10**9)) if records is None else iter(records)

    def slot():
        try:
            while not stop.is_set():
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                while not stop.is_set():
                    outcome, _ = _call(principal, model, "batch", i, max_tokens)
                    if outcome.ok:
                        served.append(time.monotonic())
                        break
                    stop.wait(min(max(outcome.retry_after or 0.05, 0.01), 1.0))
        finally:
            connection.close()

    threads = [threading.Thread(target=slot, name=f"batch-slot-{n}") for n in range(SLOTS)]
    for t in threads:
        t.start()
    return threads


def _live(principal, model: str, rate: float, seconds: float) -> list:
    """Live requests at `rate` per second for `seconds`, each on its own thread at its time (an open
    loop: a slow answer does not delay the next request). Returns (sent at, status, latency s) per request."""
    from django.db import connection

    results, threads = [], []

    def one(i, sent):
        try:
            outcome, latency = _call(principal, model, "live", i)
            results.append((sent, outcome.status, latency))
        finally:
            connection.close()

    start_at = time.monotonic()
    for i in range(int(rate * seconds)):
        delay = start_at + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i, time.monotonic()))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return results


def _pct(values: list, p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(math.ceil(p / 100 * len(values))) - 1)]


def _live_figures(results: list) -> dict:
    latencies = [lat * 1000 for _, status, lat in results if status == 200]
    refused = sum(1 for _, status, _ in results if status in (429, 503))
    return {
        "n": len(results),
        "p50_ms": _pct(latencies, 50),
        "p99_ms": _pct(latencies, 99),
        "refused": refused,
        "refused_rate": refused / max(1, len(results)),
    }


def live_with_batch(quick: bool) -> dict:
    """The issue's scenario: a key limited to `limit` requests per `window` s (the relay learns it from
    the provider's headers), live traffic at `rate`/s throughout; for the first `k` provider windows
    live is alone, for the next `k` a batch (8 slots, never short of records) drains on the same key."""
    limit, window, rate = 100, 10.0, 4.0
    k = 2 if quick else 6
    provider = start(TokenLimitedUpstream(None, window=window, delay=0.05, limit_requests=limit))
    try:
        principal, model = _seed(provider.url, "live")
        _call(principal, model, "live", -1)  # the relay learns the quota
        time.sleep(window - time.time() % window)  # start at a provider window's start
        provider.reset_stats()
        t0 = time.monotonic()
        live_results = []
        live = threading.Thread(target=lambda: live_results.extend(_live(principal, model, rate, 2 * k * window)))
        live.start()
        time.sleep(k * window)
        alone_stats = dict(provider.stats)
        stop, served = threading.Event(), []
        t_batch = time.monotonic()
        slots = _batch_slots(principal, model, stop, served)
        time.sleep(max(0.0, t0 + 2 * k * window - time.monotonic()))
        stop.set()
        t_end = time.monotonic()
        live.join()
        for t in slots:
            t.join()
        stats = dict(provider.stats)
    finally:
        provider.shutdown()
        provider.server_close()
    alone = _live_figures([r for r in live_results if r[0] < t_batch])
    with_batch = _live_figures([r for r in live_results if r[0] >= t_batch])
    batch_n = sum(1 for t in served if t <= t_end)
    live_ok = with_batch["n"] - with_batch["refused"]
    leaves = max(1, k * limit - live_ok)
    return {
        "limit": f"{limit} requests / {window:g} s",
        "live_rate": rate,
        "windows": k,
        "live_alone": alone,
        "live_with_batch": with_batch,
        "batch_served": batch_n,
        "live_leaves": leaves,
        "batch_drain_of_what_live_leaves": batch_n / leaves,
        "provider_429_alone": alone_stats["limited"],
        "provider_429": stats["limited"] - alone_stats["limited"],
    }


def token_limited(quick: bool) -> dict:
    """A batch drained against a provider limiting tokens per window (counted at a call's start for its
    prompt plus max_tokens, settled to its real usage at its end): 429 rate and tokens served / limit."""
    limit, window = 20_000, 2.0
    n = 600 if quick else 2000
    provider = start(TokenLimitedUpstream(limit, window=window, delay=0.05))
    try:
        principal, model = _seed(provider.url, "tokens")
        stop, served = threading.Event(), []
        t0 = time.monotonic()
        slots = _batch_slots(principal, model, stop, served, records=list(range(n)), max_tokens=400)
        for t in slots:
            t.join()
        elapsed = time.monotonic() - t0
        stats = dict(provider.stats)
    finally:
        provider.shutdown()
        provider.server_close()
    calls = stats["ok"] + stats["limited"]
    return {
        "limit": f"{limit} tokens / {window:g} s",
        "records": n,
        "served": len(served),
        "seconds": round(elapsed, 1),
        "calls": calls,
        "rate_429": stats["limited"] / max(1, calls),
        "drain_ratio": stats["tokens"] / (limit * elapsed / window),
    }


def run(quick: bool) -> dict:
    """Both measurements on a dedicated database and Redis db (BENCH_REDIS_DB_CAPACITY, default 12)."""
    from bench import harness

    with harness.Stack(
        db_name=harness.db_name("_capacity"), redis_db=harness.env_int("BENCH_REDIS_DB_CAPACITY", 12)
    ) as stack:
        stack.fresh()
        harness.log("capacity: live alone vs live with a batch on the same key")
        shared = live_with_batch(quick)
        harness.log("capacity: a batch against a token-limited provider")
        tokens = token_limited(quick)
    result = {"live_with_batch": shared, "token_limited": tokens}
    _print(result)
    return result


def _print(result: dict) -> None:
    s = result["live_with_batch"]
    a, b = s["live_alone"], s["live_with_batch"]
    print(f"\ncapacity: one key, {s['limit']}, live {s['live_rate']:g}/s; {s['windows']} windows each")
    print(f"  {'':18} {'p50 ms':>8} {'p99 ms':>8} {'refused':>8}")
    print(f"  {'live alone':18} {a['p50_ms']:8.1f} {a['p99_ms']:8.1f} {a['refused_rate']:8.1%}")
    print(f"  {'live with batch':18} {b['p50_ms']:8.1f} {b['p99_ms']:8.1f} {b['refused_rate']:8.1%}")
    print(
        f"  batch: {s['batch_served']} served of the ~{s['live_leaves']} live left "
        f"({s['batch_drain_of_what_live_leaves']:.2f}); provider 429s: {s['provider_429']}"
    )
    t = result["token_limited"]
    print(
        f"capacity: token-limited provider ({t['limit']}): {t['served']}/{t['records']} records in {t['seconds']} s, "
        f"429s {t['rate_429']:.2%} of {t['calls']} calls, drain {t['drain_ratio']:.2f} of the token limit"
    )


if __name__ == "__main__":
    import os

    run(os.environ.get("BENCH_QUICK") == "1")
