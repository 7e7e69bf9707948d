"""Per host kind: live overhead, provider-mode and relay-mode batch CPU, polls, cost (`make bench-kinds`).

    .venv/bin/python -m bench.kinds        (or: make bench-kinds; BENCH_QUICK=1 make bench-kinds for smaller sizes)

Starts, on loopback only: the fake provider (bench/kinds_upstream.py, its own process: devkit.upstream, which plays
every kind's wire — OpenAI, Anthropic, Azure OpenAI, an OpenAI-compatible server, the Gemini API, Bedrock with its
SigV4 checks and the in-process S3 stand-in its batch jobs read and write, Vertex AI with its token endpoint and
Cloud Storage — and their batch APIs), the relay web server with relay.webserver's argv on a fresh database
`relay_bench_kinds` and Redis db 13 (BENCH_REDIS_DB_KINDS; a db holding someone else's keys is refused), and every
background process relay.processes declares (item worker, control worker, beat, webhooks). The catalog is
deploy/demo-catalog.yaml (one host of each kind) on the fake, applied with `manage.py relay apply -f`, its rate
limit raised far above what a run spends, plus two twins of each kind's batch binding: `kinds-<kind>-provider`
(batch_mode provider) and `kinds-<kind>-relay` (batch_mode relay), same host, upstream model and price
(bench/kinds_parts.py). The relay polls at its defaults (RELAY_PROVIDER_POLL_SECONDS 12, backing off to 60).
Nothing of the relay is imported here: HTTP, /proc and the relay's CLI only.

Per kind, in turn:
1. live overhead: after BENCH_KINDS_LIVE_WARMUP rounds, BENCH_KINDS_LIVE_N rounds of one call through the relay
   (the demo binding: chat completions, or Messages for the Anthropic-adapter kinds) and the same call made
   straight to the fake in the kind's own wire (its URL scheme, auth — SigV4 for Bedrock, a bearer token for
   Vertex — and envelope), alternating; p50 and p99 of the per-round difference, and the p50's difference to
   the openai kind's;
2. provider mode (kinds with a batch API the relay speaks): BENCH_KINDS_ITEMS records for the provider twin on
   the kind's surface (OpenAI Files + Batches, or Anthropic Message Batches for Claude on anthropic, Bedrock and
   Vertex), the fake's job taking BENCH_KINDS_JOB_SECONDS; from the submit to the batch ended: CPU per record of
   every relay process (web, item worker, control, beat, webhooks) and PostgreSQL's sessions (as
   bench/provider_batch.py counts it, idle polling ticks included), wall time, and from the fake's request log
   the polls per job per minute of polling and the most requests about one job in any 60 s (bound: 5);
3. relay mode: the same number of records for the relay twin, the fake at 0 ms, measured the same way;
4. cost: the batch usage events' cost_nano_usd of each batch, from GET /api/usage/summary (admin token),
   read before and after it.
Gemini runs relay mode only (its batch records run in the relay: see Kind.why_relay). Before the figures, a
warm-up: 100 records (Bedrock's minimum) of every provider twin at once, a 2 s job, and 100 relay-mode records on
each surface, so each kind's provider code is loaded in the control worker before it is measured.

Knobs: BENCH_KINDS_ITEMS (10000; quick 2000), BENCH_KINDS_JOB_SECONDS (60; quick 30), BENCH_KINDS_LIVE_N (500;
quick 200), BENCH_KINDS_LIVE_WARMUP (50; quick 30), BENCH_KINDS (all: openai,anthropic,azure_openai,
openai_compatible,bedrock,vertex,gemini), BENCH_KINDS_SKIP (live,provider,relay,warmup), BENCH_ITEM_BYTES (650),
BENCH_REDIS_DB_KINDS (13), BENCH_DB_PREFIX, BENCH_KEEP_DB=1. BENCH_QUICK=1 lowers the defaults.
Prints figures; asserts nothing about timings. Exit status 1 when some figure could not be measured.
"""

import os
import subprocess
import time
import traceback

import requests

from bench import harness, measure
from bench.harness import PY, env_float, env_int, log
from bench.kinds_parts import (
    KINDS,
    Kind,
    batch_costs,
    direct_target,
    document,
    polls,
    relay_key,
    relay_target,
    sequential,
    submit,
    succeeded,
    upstream_log,
    wait,
)
from bench.kinds_parts import apply as apply_catalog
from bench.measure import CpuWatch, percentile
from bench.sidebyside_runs import pg_backends

RELAY_GROUPS = ("web", "worker", "control", "beat", "webhooks", "postgres")
POLL_BUDGET = 5
CPU_TARGET_MS = 0.3
WARMUP_RECORDS = 100  # Bedrock's minimum per job


def start_fake(stack: harness.Stack) -> harness.Upstream:
    proc = stack.spawn("upstream", [PY, "-m", "bench.kinds_upstream"], stdout=subprocess.PIPE)
    line = proc.popen.stdout.readline().decode().strip()
    if not line.startswith("READY "):
        raise RuntimeError(f"fake provider did not start: {line!r}\n{proc.tail()}")
    return harness.Upstream(line.split(" ", 1)[1], proc)


class Bench:
    def __init__(self, stack, up, web, key, doc, cfg):
        self.stack, self.up, self.web, self.key, self.doc, self.cfg = stack, up, web, key, doc, cfg
        fleet = {p.name.removesuffix("-bench"): p for p in stack.procs if p.name.endswith("-bench")}
        self.groups = {
            "web": lambda: measure.process_tree(web.proc.popen.pid),
            **{role: (lambda p=proc: measure.process_tree(p.popen.pid)) for role, proc in fleet.items()},
            "postgres": lambda: pg_backends(stack.db_name),
            "fake": lambda: [up.proc.popen.pid],
        }
        self.results: dict[str, dict] = {}
        self.errors: list[str] = []

    def config(self, job_seconds: float | None = None, delay_ms: float = 0.0) -> None:
        requests.post(f"{self.up.url}/_bench/config", json={"delay_ms": delay_ms}, timeout=10).raise_for_status()
        if job_seconds is not None:
            body = {"batch_seconds": job_seconds}
            requests.post(f"{self.up.url}/_bench/kinds_config", json=body, timeout=10).raise_for_status()

    # --- figures ---

    def live(self, kind: Kind) -> dict:
        relay = relay_target(kind, self.web.url, self.key)
        direct = direct_target(kind, self.up.url, self.doc)
        times = sequential([relay, direct], self.cfg["live_n"], self.cfg["live_warmup"])
        diff = [r - d for r, d in zip(times["relay"], times["direct"], strict=True)]
        ms = 1000.0
        return {
            "p50": percentile(diff, 50) * ms,
            "p99": percentile(diff, 99) * ms,
            "direct_p50": percentile(times["direct"], 50) * ms,
            "relay_p50": percentile(times["relay"], 50) * ms,
        }

    def batch(self, kind: Kind, mode: str, n: int) -> dict:
        model = kind.model(mode)
        timeout = max(900.0, self.cfg["job_s"] * 10) if mode == "provider" else max(900.0, n / 5)
        before = batch_costs(self.web.url).get(model, (0, 0, 0))
        t0 = time.time()
        with CpuWatch(self.groups) as cpu:
            batch_id = submit(kind, model, self.web.url, self.key, self.stack.tmp, n, self.cfg["item_bytes"])
            body = wait(kind, batch_id, self.web.url, self.key, timeout)
        t1 = time.time()
        after = batch_costs(self.web.url).get(model, (0, 0, 0))
        ok, problem = succeeded(body, n)
        per = cpu.per_unit_ms(n)
        out = {
            "id": batch_id,
            "n": n,
            "ok": ok,
            "problem": problem,
            "wall_s": t1 - t0,
            "cpu_ms": sum(per.get(g, 0.0) for g in RELAY_GROUPS),
            "by_group_us": {g: round(v * 1000, 1) for g, v in per.items()},
            "busy": cpu.machine_busy,
            "cost": after[0] - before[0],
            "events": after[1] - before[1],
            "unpriced": after[2] - before[2],
        }
        entries = [e for e in upstream_log(self.up.url) if t0 - 1 <= e["t"] <= t1 + 1]
        out["upstream"] = polls(entries)
        return out

    def warm_up(self, kinds: list[Kind]) -> None:
        """100 records of every provider twin at once (a 2 s job), and 100 relay-mode records per surface."""
        self.config(job_seconds=2.0)
        pending = []
        for kind in kinds:
            modes = ["provider"] if kind.provider_mode else []
            if kind.name in ("openai", "anthropic"):
                modes.append("relay")
            for mode in modes:
                try:
                    batch_id = submit(
                        kind, kind.model(mode), self.web.url, self.key, self.stack.tmp, WARMUP_RECORDS, 650
                    )
                    pending.append((kind, mode, batch_id))
                except Exception as exc:  # noqa: BLE001 - its own figure will fail and say so
                    log(f"warm-up of {kind.name} ({mode}) not submitted: {exc}")
        for kind, mode, batch_id in pending:
            try:
                body = wait(kind, batch_id, self.web.url, self.key, 300)
                log(f"warm-up {kind.name} ({mode}): {succeeded(body, WARMUP_RECORDS)}")
            except Exception as exc:  # noqa: BLE001
                log(f"warm-up of {kind.name} ({mode}) did not end: {exc}")

    def attempt(self, label: str, fn):
        try:
            out = fn()
            log(f"{label}: {_brief(out)}")
            return out
        except Exception as exc:  # noqa: BLE001 - one kind's failure is reported; the others still run
            message = f"{type(exc).__name__}: {str(exc)[:400]}"
            self.errors.append(f"{label}: {message}")
            log(f"{label} FAILED: {message}")
            traceback.print_exc()
            return {"error": message}


def _brief(out: dict) -> str:
    keys = ("p50", "p99", "cpu_ms", "ok", "wall_s", "cost", "problem")
    return ", ".join(f"{k} {out[k]:.3g}" if isinstance(out[k], float) else f"{k} {out[k]}" for k in keys if k in out)


def run() -> Bench:
    quick = os.environ.get("BENCH_QUICK") == "1"
    cfg = {
        "n": env_int("BENCH_KINDS_ITEMS", 2000 if quick else 10_000),
        "job_s": env_float("BENCH_KINDS_JOB_SECONDS", 30 if quick else 60),
        "live_n": env_int("BENCH_KINDS_LIVE_N", 200 if quick else 500),
        "live_warmup": env_int("BENCH_KINDS_LIVE_WARMUP", 30 if quick else 50),
        "item_bytes": env_int("BENCH_ITEM_BYTES", 650),
    }
    wanted = [k.strip() for k in (os.environ.get("BENCH_KINDS") or "").split(",") if k.strip()]
    kinds = [k for k in KINDS if not wanted or k.name in wanted]
    skip = set((os.environ.get("BENCH_KINDS_SKIP") or "").replace(" ", "").split(","))
    os.environ.setdefault("RELAY_HOSTKEY_DEMO", "demo-upstream-key")  # the demo catalog's host keys (value_from)
    started, load_before = time.monotonic(), measure.load()
    stack = harness.Stack(
        db_name=harness.db_name("_kinds"), redis_db=env_int("BENCH_REDIS_DB_KINDS", 13), isolated=True
    )
    with stack:
        stack.keep_db = os.environ.get("BENCH_KEEP_DB") == "1"
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        up = start_fake(stack)
        doc = document(up.url)
        log(f"relay apply: {apply_catalog(stack, up.url)}")
        key = relay_key(stack)
        web = stack.start_web(production=True)
        stack.start_worker()
        log(f"fake provider {up.url}, relay {web.url}; roles {[p.name for p in stack.procs]}")
        b = Bench(stack, up, web, key, doc, cfg)
        b.load_before, b.kinds = load_before, kinds
        if "live" not in skip:
            for kind in kinds:
                b.results.setdefault(kind.name, {})["live"] = b.attempt(f"live {kind.name}", lambda k=kind: b.live(k))
        if "warmup" not in skip:
            b.warm_up(kinds)
        for kind in kinds:
            r = b.results.setdefault(kind.name, {})
            if kind.provider_mode and "provider" not in skip:
                b.config(job_seconds=cfg["job_s"])
                r["provider"] = b.attempt(f"provider mode {kind.name}", lambda k=kind: b.batch(k, "provider", cfg["n"]))
            if "relay" not in skip:
                b.config(delay_ms=0)
                r["relay"] = b.attempt(f"relay mode {kind.name}", lambda k=kind: b.batch(k, "relay", cfg["n"]))
    b.wall_s = time.monotonic() - started
    print_report(b)
    return b


# --- the report ----------------------------------------------------------------------------------------------


def _usd(nanos) -> str:
    return f"{nanos / 1e9:.4f}"


def _cell(fig: dict | None, fmt) -> str:
    if fig is None:
        return "-"
    if "error" in fig:
        return "FAILED (below)"
    return fmt(fig)


def print_report(b: Bench) -> None:
    cfg = b.cfg
    n = cfg["n"]
    print()
    print(f"== Host kinds — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"load before: {b.load_before}; after: {measure.load()}; {b.wall_s:.0f} s")
    base = (b.results.get("openai") or {}).get("live") or {}
    rows = []
    for kind in b.kinds:
        r = b.results.get(kind.name, {})
        live, prov, rel = r.get("live"), r.get("provider"), r.get("relay")
        vs = "-"
        if live and "error" not in live and base and "error" not in base:
            vs = f"{live['p50'] - base['p50']:+.2f}"
        jobs = (prov or {}).get("upstream", {}).get("jobs", [])
        rate = max((j["per_minute"] for j in jobs), default=float("nan"))
        rows.append(
            [
                kind.name,
                _cell(live, lambda f: f"{f['p50']:.2f} (p99 {f['p99']:.2f})"),
                vs,
                _cell(prov, lambda f: f"{f['cpu_ms']:.3f}") if kind.provider_mode else "n/a (relay only)",
                _cell(prov, lambda f, r=rate, j=jobs: f"{r:.2f}" if j else "no job") if kind.provider_mode else "n/a",
                _cell(rel, lambda f: f"{f['cpu_ms']:.3f}"),
                _cell(prov, lambda f: _usd(f["cost"])) if kind.provider_mode else "n/a",
                _cell(rel, lambda f: _usd(f["cost"])),
            ]
        )
    headers = [
        "kind",
        "live p50 Δ vs direct ms",
        "Δ vs openai kind ms",
        "provider CPU/record ms",
        "polls/job/min",
        "relay CPU/record ms",
        f"cost provider USD ({n:,})",
        f"cost relay USD ({n:,})",
    ]
    print(measure.table(headers, rows))
    print(
        f"targets: provider CPU/record ≤ {CPU_TARGET_MS} ms; polls ≤ {POLL_BUDGET} per job per minute; live p50 "
        f"within 0.5 ms of the openai kind's. Sizes: {n:,} records per batch ({cfg['item_bytes']} B), the fake's job "
        f"{cfg['job_s']:g} s, relay mode at 0 ms; live {cfg['live_n']} rounds after {cfg['live_warmup']} warm-up."
    )
    print("CPU = web + item worker + control + beat + webhooks + PostgreSQL sessions, submit → batch ended.")
    for kind in b.kinds:
        r = b.results.get(kind.name, {})
        live = r.get("live")
        if live and "error" not in live:
            print(
                f"  {kind.name} live: relay p50 {live['relay_p50']:.2f} ms, direct p50 {live['direct_p50']:.2f} ms; "
                f"overhead p50 {live['p50']:.2f}, p99 {live['p99']:.2f}"
            )
        for mode in ("provider", "relay"):
            f = r.get(mode)
            if not f or "error" in f:
                continue
            line = (
                f"  {kind.name} {mode}: {f['ok']:,}/{f['n']:,} succeeded in {f['wall_s']:.0f} s, machine "
                f"{f['busy']:.2f} cores busy; µs/record {f['by_group_us']}; {f['events']:,} batch usage events"
            )
            if f["unpriced"]:
                line += f" ({f['unpriced']:,} unpriced)"
            if f["problem"]:
                line += f"; NOT ALL SUCCEEDED: {f['problem']}"
            print(line)
            u = f["upstream"]
            if mode == "provider":
                jobs = "; ".join(
                    f"job {j['job']}: {j['polls']} polls in the {j['span_s']:.0f} s from its create to its last poll, "
                    f"{j['per_minute']:.2f}/min, "
                    f"most requests about it in 60 s {j['max_60s']} (bound {POLL_BUDGET})"
                    for j in u["jobs"]
                )
                print(f"    batch API {u['apis'] or 'none'}: {u['requests']} requests; {jobs or 'NO JOB CREATED'}")
            elif u["jobs"]:
                print(f"    relay mode, yet the fake saw {len(u['jobs'])} job(s) created")
        if not kind.provider_mode:
            print(f"  {kind.name}: relay mode only — {kind.why_relay}")
    for error in b.errors:
        print(f"FAILED: {error}")
    print()


if __name__ == "__main__":
    result = run()
    raise SystemExit(1 if result.errors else 0)
