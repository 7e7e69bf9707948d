"""The relay's overhead per live request against a direct call to the same fake upstream.

    .venv/bin/python -m bench.live_overhead          (or: make bench, which runs every benchmark)

Starts, on loopback only: the fake upstream (bench/fake_upstream.py, its own process, 0 ms delay by
default), the relay web server as in production (gunicorn relay.wsgi, 2 workers x 8 threads) on a fresh
PostgreSQL database `relay_bench` (dropped and migrated each run) and Redis db 9 (BENCH_REDIS_DB_LIVE;
flushed; a db holding someone else's keys is refused), and seeds a
catalog: a policy with a rate limit on every meter (far above what the run spends), one host key, a
priced binding.

Then, from this process, with one keep-alive requests.Session per target:
1. sequential: after a warm-up, N pairs of POST /v1/chat/completions, alternating relay and direct so
   that drift in the machine's load hits both alike; median and p99 of each, and of the per-pair
   difference (relay - direct = the relay's overhead);
2. throughput: 8 client threads for a fixed time against each target; requests/s.

The peer: LiteLLM's proxy (bench/peer_litellm.py, its own virtualenv, 2 workers) on the same fake
upstream is started after the relay's rounds and throughput run and measured the same way in a phase
of its own (LiteLLM and direct alternating, then its throughput), so its overhead is printed beside
ours, each against direct calls made at the same time, and neither runs while the other is measured;
when it cannot be installed or started, the reason is printed.

Knobs (environment): BENCH_LIVE_N (500), BENCH_LIVE_WARMUP (50), BENCH_LIVE_CONCURRENCY (8),
BENCH_LIVE_SECONDS (5), BENCH_LIVE_UPSTREAM_DELAY_MS (0), BENCH_PYSPY=<dir> (a py-spy profile of the
gunicorn workers, CPU only, during the relay's throughput run; see bench/batch.py).
Prints figures; asserts nothing about timings.
"""

import contextlib
import os
import threading
import time

import requests

from bench import catalog, harness, measure, peer_litellm
from bench.harness import env_float, env_int, log
from bench.measure import percentile


def _post(session: requests.Session, url: str, headers: dict, body: dict) -> float:
    t0 = time.perf_counter()
    resp = session.post(url, json=body, headers=headers, timeout=60)
    elapsed = time.perf_counter() - t0
    if resp.status_code != 200:
        raise RuntimeError(f"POST {url} answered {resp.status_code}: {resp.text[:500]}")
    return elapsed


def _throughput(url: str, headers: dict, body: dict, threads: int, seconds: float) -> dict:
    counts = [0] * threads
    errors = [0] * threads
    latencies: list[list[float]] = [[] for _ in range(threads)]
    start = threading.Barrier(threads + 1)
    stop_at = [0.0]

    def run(n: int) -> None:
        with requests.Session() as s:
            _post(s, url, headers, body)  # open the connection before the clock starts
            start.wait()
            while time.perf_counter() < stop_at[0]:
                t0 = time.perf_counter()
                try:
                    r = s.post(url, json=body, headers=headers, timeout=60)
                    ok = r.status_code == 200
                except requests.RequestException:
                    ok = False
                if ok:
                    counts[n] += 1
                    latencies[n].append(time.perf_counter() - t0)
                else:
                    errors[n] += 1

    workers = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(threads)]
    for w in workers:
        w.start()
    stop_at[0] = time.perf_counter() + 3600  # set for real once every thread is connected
    start.wait()
    t0 = time.perf_counter()
    stop_at[0] = t0 + seconds
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    lat = [x for xs in latencies for x in xs]
    return {
        "rps": sum(counts) / elapsed,
        "requests": sum(counts),
        "errors": sum(errors),
        "median_ms": percentile(lat, 50) * 1000,
        "p99_ms": percentile(lat, 99) * 1000,
    }


def _sequential(targets: list, n: int, warmup: int, watch=contextlib.nullcontext):
    """`warmup` rounds, then `n` rounds of one call to each target in turn, each on its own keep-alive
    session. Returns the seconds of every measured call by target name, and what `watch()` (entered
    around the measured rounds only: a CpuWatch) gave."""
    sessions = {name: requests.Session() for name, *_ in targets}
    log(f"sequential: {warmup} warm-up rounds, then {n} rounds ({' , '.join(sessions)} in turn)")
    for _ in range(warmup):
        for name, url, headers, b in targets:
            _post(sessions[name], url, headers, b)
    times: dict[str, list[float]] = {name: [] for name in sessions}
    with watch() as watched:
        for _ in range(n):
            for name, url, headers, b in targets:
                times[name].append(_post(sessions[name], url, headers, b))
    for sess in sessions.values():
        sess.close()
    return times, watched


def cpu_groups(stack: harness.Stack, web: harness.Web, upstream: harness.Upstream) -> dict:
    return {
        "web (gunicorn)": lambda: measure.process_tree(web.proc.popen.pid),
        "postgres": lambda: measure.pg_backends(stack.db_name),
        "fake upstream": lambda: [upstream.proc.popen.pid],
        "this client": lambda: [os.getpid()],
    }


def run() -> dict:
    n = env_int("BENCH_LIVE_N", 500)
    warmup = env_int("BENCH_LIVE_WARMUP", 50)
    conc = env_int("BENCH_LIVE_CONCURRENCY", 8)
    seconds = env_float("BENCH_LIVE_SECONDS", 5)
    delay_ms = env_float("BENCH_LIVE_UPSTREAM_DELAY_MS", 0)
    started = time.monotonic()
    with harness.Stack(db_name=harness.db_name(), redis_db=env_int("BENCH_REDIS_DB_LIVE", 9)) as stack:
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        upstream = stack.start_upstream(delay_ms)
        relay_key = catalog.seed_catalog(upstream.url)
        web = stack.start_web()
        gunicorn = " ".join(harness.GUNICORN_ARGS)
        log(f"fake upstream {upstream.url} ({delay_ms:g} ms), relay {web.url} (gunicorn {gunicorn})")

        body = catalog.chat_body(1)
        direct_body = dict(body, model=catalog.UPSTREAM_MODEL)  # what the relay sends upstream
        relay_url, relay_headers = f"{web.url}/v1/chat/completions", {"Authorization": f"Bearer {relay_key}"}
        direct_url, direct_headers = (
            f"{upstream.url}/v1/chat/completions",
            {"Authorization": f"Bearer {catalog.UPSTREAM_KEY}"},
        )

        # The relay and the peer are each measured against the direct call in a phase of their own,
        # with the other not running: LiteLLM's proxy keeps ~0.75 of a core busy between its requests,
        # which, interleaved, added ~1 ms to the relay's overhead and ~0.5 ms to the direct call on
        # a 2-core host (bench/README.md). Each overhead is still the per-round difference against
        # direct calls made at the same time.
        relay_target = ("relay", relay_url, relay_headers, body)
        direct_target = ("direct", direct_url, direct_headers, direct_body)
        times, seq_cpu = _sequential(
            [relay_target, direct_target], n, warmup, watch=lambda: measure.CpuWatch(cpu_groups(stack, web, upstream))
        )
        relay_t, direct_t = times["relay"], times["direct"]
        diff = [r - d for r, d in zip(relay_t, direct_t, strict=True)]

        log(f"throughput: {conc} threads x {seconds:g} s per target")
        direct_tp = _throughput(direct_url, direct_headers, direct_body, conc, seconds)
        with measure.CpuWatch(cpu_groups(stack, web, upstream)) as tp_cpu, harness.profiled(web, "live-throughput"):
            relay_tp = _throughput(relay_url, relay_headers, body, conc, seconds)

        peer, peer_skip, peer_t, peer_diff, peer_direct_t, peer_tp = None, "", None, None, None, None
        try:
            log("starting the peer: LiteLLM's proxy on the same fake upstream")
            peer = peer_litellm.start(stack, upstream.url)
            log(f"LiteLLM {peer.version} on {peer.url}")
        except peer_litellm.Skip as exc:
            peer_skip = str(exc)
            log(f"peer skipped: {peer_skip}")
        if peer is not None:
            peer_url = f"{peer.url}/v1/chat/completions"
            times, _ = _sequential([("litellm", peer_url, peer.headers, body), direct_target], n, warmup)
            peer_t, peer_direct_t = times["litellm"], times["direct"]
            peer_diff = [r - d for r, d in zip(peer_t, peer_direct_t, strict=True)]
            peer_tp = _throughput(peer_url, peer.headers, body, conc, seconds)
            peer.proc.stop()

        from usage.models import UsageEvent

        events = UsageEvent.objects.filter(source="live").count()
        expected = warmup + n + relay_tp["requests"] + relay_tp["errors"] + conc
    ms = 1000.0
    result = {
        "n": n,
        "delay_ms": delay_ms,
        "relay_median": percentile(relay_t, 50) * ms,
        "relay_p99": percentile(relay_t, 99) * ms,
        "direct_median": percentile(direct_t, 50) * ms,
        "direct_p99": percentile(direct_t, 99) * ms,
        "overhead_median": percentile(diff, 50) * ms,
        "overhead_p99": percentile(diff, 99) * ms,
        "relay_tp": relay_tp,
        "direct_tp": direct_tp,
        "peer": (
            {
                "version": peer.version,
                "median": percentile(peer_t, 50) * ms,
                "p99": percentile(peer_t, 99) * ms,
                "overhead_median": percentile(peer_diff, 50) * ms,
                "overhead_p99": percentile(peer_diff, 99) * ms,
                "direct_median": percentile(peer_direct_t, 50) * ms,
                "tp": peer_tp,
            }
            if peer is not None
            else None
        ),
        "peer_skip": peer_skip,
        "load": measure.load(),
        "conc": conc,
        "seconds": seconds,
        "events": events,
        "events_expected": expected,
        "wall_s": time.monotonic() - started,
        "seq_cpu": seq_cpu.describe(n, "pair (web, postgres: the relay call; upstream, client: both calls)"),
        "tp_cpu": tp_cpu.describe(relay_tp["requests"] + conc, "relay request"),
    }
    print_report(result)
    return result


def print_report(r: dict) -> None:
    print()
    print(f"== Live overhead (issues 3, 11) — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"load at the end: {r['load']}")
    print(
        f"POST /v1/chat/completions, fake upstream at {r['delay_ms']:g} ms; sequential: {r['n']} requests each, "
        "one keep-alive session per target"
    )
    p = r["peer"]
    rows = [
        ["direct to fake upstream", f"{r['direct_median']:.2f}", f"{r['direct_p99']:.2f}"],
        ["through the relay", f"{r['relay_median']:.2f}", f"{r['relay_p99']:.2f}"],
        ["relay overhead (per-round difference)", f"{r['overhead_median']:.2f}", f"{r['overhead_p99']:.2f}"],
    ]
    if p is not None:
        rows += [
            [f"through LiteLLM {p['version']} (peer)", f"{p['median']:.2f}", f"{p['p99']:.2f}"],
            ["LiteLLM overhead (per-round difference)", f"{p['overhead_median']:.2f}", f"{p['overhead_p99']:.2f}"],
        ]
    print(measure.table(["sequential latency", "median ms", "p99 ms"], rows))
    if p is None:
        print(f"peer (LiteLLM) skipped: {r['peer_skip']}")
    else:
        print(
            f"(LiteLLM's rounds ran after the relay's, alternating with direct calls whose median then was "
            f"{p['direct_median']:.2f} ms; its overhead is against those)"
        )
    print(r["seq_cpu"])
    print()
    rows = []
    runs = [("direct to fake upstream", r["direct_tp"]), ("through the relay", r["relay_tp"])]
    if p is not None:
        runs.append((f"through LiteLLM {p['version']}", p["tp"]))
    for label, t in runs:
        rows.append([label, f"{t['rps']:.0f}", f"{t['median_ms']:.2f}", f"{t['p99_ms']:.2f}", t["errors"]])
    headers = [f"concurrency {r['conc']}, {r['seconds']:g} s", "requests/s", "median ms", "p99 ms", "errors"]
    print(measure.table(headers, rows))
    print(f"relay at concurrency {r['conc']}: {r['tp_cpu']}")
    print(
        f"usage events recorded (source=live): {r['events']} of {r['events_expected']} relay requests; "
        f"benchmark wall time {r['wall_s']:.0f} s"
    )
    print()


if __name__ == "__main__":
    run()
