"""Streamed live calls through the relay against the same streams taken directly from the fake upstream.

    .venv/bin/python -m bench.streaming          (or: make bench, which runs every benchmark)

Starts, on loopback only: the fake upstream (bench/fake_upstream.py, which streams OpenAI's chat chunks
when asked), the relay web server exactly as production runs it (relay.webserver's argv: gthread, 2
workers x RELAY_WEB_THREADS) on a fresh database `relay_bench_stream` and Redis db 11
(BENCH_REDIS_DB_STREAM), and seeds the live benchmark's catalog. Every stream is
POST /v1/chat/completions with `"stream": true`, answered in ~BENCH_STREAM_EVENTS events (one word each).

1. time to first byte: after a warm-up, N pairs of one stream through the relay and one direct,
   alternating, each on its own keep-alive connection; from the request's first byte sent to the
   answer body's first byte read. The relay's overhead is the per-pair difference.
2. chunk throughput: events per second received by C client threads streaming back to back for a
   fixed time, at C = 1 and 50, relay and direct, with the provider sending as fast as it can
   (the relay's ceiling) and paced at BENCH_STREAM_EVENT_MS between events (a model's pace);
   the ratio relay / direct.
3. 200 open streams (paced, ~2 s each) while /healthz and a whole (non-streamed) chat completion are
   asked 10 times each: their latencies, which the issue bounds at 2 s.

The peer: LiteLLM's proxy (bench/peer_litellm.py), when its virtualenv is there, measured the same way
after the relay (1 and 2), in a phase of its own. Prints figures; asserts nothing about timings.
Knobs: BENCH_STREAM_N (200), BENCH_STREAM_WARMUP (20), BENCH_STREAM_SECONDS (3), BENCH_STREAM_EVENTS (100),
BENCH_STREAM_EVENT_MS (10), BENCH_STREAM_OPEN (200).
"""

import http.client
import json
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests

from bench import catalog, harness, measure, peer_litellm
from bench.harness import env_float, env_int, log
from bench.measure import percentile

PATH = "/v1/chat/completions"


@dataclass
class Target:
    name: str
    url: str
    headers: dict
    body: bytes

    def connect(self) -> http.client.HTTPConnection:
        parts = urlsplit(self.url)
        return http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)

    @property
    def path(self) -> str:
        return (urlsplit(self.url).path.rstrip("/") or "") + PATH


def body(events: int, model: str) -> bytes:
    # The fake upstream's answer is a banner (9 words) and the prompt's first 200 characters, one event a word.
    words = " ".join(["ab"] * max(1, min(66, events - 12)))
    return json.dumps({"model": model, "stream": True, "messages": [{"role": "user", "content": words}]}).encode()


def stream_once(conn: http.client.HTTPConnection, target: Target) -> tuple[float, int]:
    """One stream: (seconds to its first body byte, events read)."""
    started = time.perf_counter()
    conn.request("POST", target.path, body=target.body, headers={**target.headers, "Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{target.name} answered {resp.status}: {resp.read()[:300]!r}")
    first = resp.read1(65536)
    ttfb = time.perf_counter() - started
    events = first.count(b"\n\n")
    while piece := resp.read1(65536):
        events += piece.count(b"\n\n")
    return ttfb, events


def first_bytes(targets: list[Target], n: int, warmup: int) -> dict[str, list[float]]:
    conns = {t.name: t.connect() for t in targets}
    times: dict[str, list[float]] = {t.name: [] for t in targets}
    for i in range(warmup + n):
        for t in targets:
            ttfb, _ = stream_once(conns[t.name], t)
            if i >= warmup:
                times[t.name].append(ttfb)
    for conn in conns.values():
        conn.close()
    return times


def throughput(target: Target, clients: int, seconds: float) -> dict:
    """Events per second received by `clients` threads streaming back to back for `seconds`."""
    counts, streams, errors = [0] * clients, [0] * clients, []
    barrier = threading.Barrier(clients + 1)
    stop = [0.0]

    def run(i: int) -> None:
        conn = target.connect()
        try:
            stream_once(conn, target)  # the connection open before the clock starts
            barrier.wait()
            while time.perf_counter() < stop[0]:
                _, events = stream_once(conn, target)
                counts[i] += events
                streams[i] += 1
        except Exception as exc:  # noqa: BLE001 - counted and printed
            errors.append(repr(exc))
            barrier.abort()
        finally:
            conn.close()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(clients)]
    stop[0] = time.perf_counter() + 3600
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    stop[0] = started + seconds
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    return {"events_s": sum(counts) / elapsed, "streams": sum(streams), "errors": len(errors), "error": errors[:1]}


def open_streams(target: Target, relay_url: str, relay_key: str, count: int) -> dict:
    """`count` streams open at once while /healthz and a whole chat completion are asked 10 times each."""
    opened, done, errors = [], [], []
    lock = threading.Lock()

    def run() -> None:
        conn = target.connect()
        try:
            conn.request(
                "POST", target.path, body=target.body, headers={**target.headers, "Content-Type": "application/json"}
            )
            resp = conn.getresponse()
            resp.read1(65536)
            with lock:
                opened.append(1)
            while resp.read1(65536):
                pass
            with lock:
                done.append(1)
        except Exception as exc:  # noqa: BLE001 - counted and printed
            with lock:
                errors.append(repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(opened) + len(errors) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    at_once = len(opened) - len(done)
    whole = json.dumps({"model": catalog.MODEL, "messages": [{"role": "user", "content": "hi"}]})
    probes: dict[str, list[float]] = {"healthz": [], "whole chat completion": []}
    with requests.Session() as s:
        for _ in range(10):
            for name in probes:
                started = time.perf_counter()
                if name == "healthz":
                    r = s.get(f"{relay_url}/healthz", timeout=30)
                else:
                    r = s.post(
                        f"{relay_url}{PATH}",
                        data=whole,
                        headers={"Authorization": f"Bearer {relay_key}", "Content-Type": "application/json"},
                        timeout=30,
                    )
                probes[name].append(time.perf_counter() - started)
                if r.status_code != 200:
                    errors.append(f"{name} answered {r.status_code}")
    for t in threads:
        t.join(timeout=60)
    return {"at_once": at_once, "done": len(done), "errors": errors[:3], "n_errors": len(errors), "probes": probes}


def run() -> dict:
    n = env_int("BENCH_STREAM_N", 200)
    warmup = env_int("BENCH_STREAM_WARMUP", 20)
    seconds = env_float("BENCH_STREAM_SECONDS", 3)
    events = env_int("BENCH_STREAM_EVENTS", 100)
    paced_ms = env_float("BENCH_STREAM_EVENT_MS", 10)
    n_open = env_int("BENCH_STREAM_OPEN", 200)
    started = time.monotonic()
    result: dict = {"n": n, "events": events, "paced_ms": paced_ms, "seconds": seconds, "open": n_open}
    with harness.Stack(db_name=harness.db_name("_stream"), redis_db=env_int("BENCH_REDIS_DB_STREAM", 11)) as stack:
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        upstream = stack.start_upstream(0)
        relay_key = catalog.seed_catalog(upstream.url)
        web = stack.start_web(production=True)
        from relay.webserver import WORKERS, threads

        result["server"] = f"gunicorn gthread, {WORKERS} workers x {threads()} threads (relay.webserver)"
        log(f"fake upstream {upstream.url}, relay {web.url} ({result['server']})")
        relay = Target("relay", web.url, {"Authorization": f"Bearer {relay_key}"}, body(events, catalog.MODEL))
        direct = Target(
            "direct",
            upstream.url,
            {"Authorization": f"Bearer {catalog.UPSTREAM_KEY}"},
            body(events, catalog.UPSTREAM_MODEL),
        )
        # CPU of the web server (and PostgreSQL, for the usage events) per stream: what the relay costs
        # whatever else the machine runs (its wall-clock figures are only as good as the machine is quiet).
        groups = {
            "web (gunicorn)": lambda: measure.process_tree(web.proc.popen.pid),
            "postgres": lambda: measure.pg_backends(stack.db_name),
        }
        result.update(_measure(relay, direct, upstream, n, warmup, seconds, paced_ms, groups))

        log(f"{n_open} streams open at once (paced at 20 ms), /healthz and whole answers asked meanwhile")
        upstream_config(upstream, 20)
        result["open_streams"] = open_streams(relay, web.url, relay_key, n_open)
        upstream_config(upstream, 0)

        print_report(result, peer=False)  # the relay's figures, whatever becomes of the peer
        try:
            log("starting the peer: LiteLLM's proxy on the same fake upstream")
            web.proc.stop()  # not running while the peer is measured
            peer = peer_litellm.start(stack, upstream.url)
            log(f"LiteLLM {peer.version} on {peer.url}")
            litellm = Target("litellm", peer.url, peer.headers, body(events, catalog.MODEL))
            result["peer"] = {
                "version": peer.version,
                **_measure(litellm, direct, upstream, n, warmup, seconds, paced_ms),
            }
            peer.proc.stop()
        except peer_litellm.Skip as exc:
            result["peer_skip"] = str(exc)
            log(f"peer skipped: {exc}")
        except Exception as exc:  # noqa: BLE001 - the peer's failure is printed, ours are not hidden by it
            result["peer_skip"] = f"{type(exc).__name__}: {exc}"
            log(f"peer failed: {result['peer_skip']}")

        try:
            from usage.models import UsageEvent

            result["events_recorded"] = UsageEvent.objects.filter(source="live").count()
        except Exception as exc:  # noqa: BLE001 - the figures above stand without it
            result["events_recorded"] = f"not counted ({type(exc).__name__})"
    result["wall_s"] = time.monotonic() - started
    print_report(result)
    return result


def upstream_config(upstream: harness.Upstream, event_ms: float) -> None:
    requests.post(f"{upstream.url}/_bench/config", json={"event_delay_ms": event_ms}, timeout=10).raise_for_status()


def _measure(
    via: Target, direct: Target, upstream, n: int, warmup: int, seconds: float, paced_ms: float, groups=None
) -> dict:
    log(f"time to first byte: {warmup} warm-up pairs, then {n} pairs ({via.name}, direct in turn)")
    times = first_bytes([via, direct], n, warmup)
    diff = [a - b for a, b in zip(times[via.name], times["direct"], strict=True)]
    ms = 1000.0
    out = {
        "ttfb": {
            "via_p50": percentile(times[via.name], 50) * ms,
            "via_p99": percentile(times[via.name], 99) * ms,
            "direct_p50": percentile(times["direct"], 50) * ms,
            "direct_p99": percentile(times["direct"], 99) * ms,
            "overhead_p50": percentile(diff, 50) * ms,
            "overhead_p99": percentile(diff, 99) * ms,
        },
        "throughput": [],
    }
    for pace in (0.0, paced_ms):
        upstream_config(upstream, pace)
        for clients in (1, 50):
            paced = f"{pace:g} ms/event" if pace else "unpaced"
            log(f"throughput: {clients} clients x {seconds:g} s, provider {paced}")
            d = throughput(direct, clients, seconds)
            with measure.CpuWatch(groups or {}) as cpu:
                v = throughput(via, clients, seconds)
            if groups:
                v["cpu"] = cpu.describe(max(1, v["streams"]), "stream")
            out["throughput"].append({"pace": pace, "clients": clients, "direct": d, "via": v})
    upstream_config(upstream, 0)
    return out


def _report_measure(label: str, r: dict) -> None:
    t = r["ttfb"]
    print(
        measure.table(
            ["time to first byte", "p50 ms", "p99 ms"],
            [
                ["direct to fake upstream", f"{t['direct_p50']:.2f}", f"{t['direct_p99']:.2f}"],
                [f"through {label}", f"{t['via_p50']:.2f}", f"{t['via_p99']:.2f}"],
                [f"{label} overhead (per-pair difference)", f"{t['overhead_p50']:.2f}", f"{t['overhead_p99']:.2f}"],
            ],
        )
    )
    rows = []
    for row in r["throughput"]:
        pace = "as fast as it can" if not row["pace"] else f"{row['pace']:g} ms between events"
        d, v = row["direct"], row["via"]
        ratio = v["events_s"] / d["events_s"] if d["events_s"] else 0
        errors = d["errors"] + v["errors"]
        rows.append([pace, row["clients"], f"{d['events_s']:.0f}", f"{v['events_s']:.0f}", f"{ratio:.2f}", errors])
        for e in d["error"] + v["error"]:
            print(f"  error: {e}")
    print(measure.table(["provider sends", "streams", "direct events/s", f"{label} events/s", "ratio", "errors"], rows))
    for row in r["throughput"]:
        if row["via"].get("cpu"):
            pace = "unpaced" if not row["pace"] else f"{row['pace']:g} ms/event"
            print(f"  {label}, {row['clients']} streams, {pace}: {row['via']['cpu']}")


def print_report(r: dict, peer: bool = True) -> None:
    print()
    print(f"== Streaming — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"load at the end: {measure.load()}; relay web server: {r.get('server')}")
    print(
        f"POST {PATH} with stream: true, ~{r['events']} events a stream; first byte over {r['n']} pairs; "
        f"throughput over {r['seconds']:g} s per cell"
    )
    _report_measure("the relay", r)
    o = r.get("open_streams")
    if o:
        rows = [[name, f"{percentile(v, 50) * 1000:.1f}", f"{max(v) * 1000:.1f}"] for name, v in o["probes"].items()]
        print(
            f"{o['at_once']} streams open at once ({o['done']} ended normally, {o['n_errors']} errors {o['errors']}):"
        )
        print(measure.table(["asked meanwhile (10 each)", "p50 ms", "max ms"], rows))
    if not peer:
        print(flush=True)
        return
    p = r.get("peer")
    if p:
        print(f"-- the peer: LiteLLM {p['version']} (its own phase, against direct calls made meanwhile)")
        _report_measure(f"LiteLLM {p['version']}", p)
    else:
        print(f"peer (LiteLLM) skipped: {r.get('peer_skip')}")
    print(f"usage events recorded (source=live): {r.get('events_recorded')}; benchmark wall time {r['wall_s']:.0f} s")
    print(flush=True)
    print()


if __name__ == "__main__":
    run()
