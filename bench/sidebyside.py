"""`make bench`: each hot-path figure of this tree beside the previous release's, measured alternately in one run.

    .venv/bin/python -m bench.sidebyside          (or: make bench; make bench-quick for smaller sizes)

The previous release is the git ref in bench/BASELINE (bench/trees.py checks it out into `.bench/baseline`);
"this tree" is BENCH_TREE, by default this checkout. Each tree gets its own stack, up side by side for the
whole run: a fresh database (relay_bench_sbs_previous / relay_bench_sbs_this) migrated by its own
`manage.py migrate`, its own Redis db, a fake upstream, the web server with the tree's relay.webserver argv,
and later its background processes (`python -m relay.processes ROLE`, every role the tree has), all run from
the tree's directory with this checkout's .venv. The catalog goes in through the tree's `relay apply` and
`relay key create` (bench/tree_catalog.py). The client, the fake upstream and the measuring code are this
checkout's; nothing of either relay is imported here.

Every figure runs in pairs, the previous release then this tree, BENCH_SBS_PAIRS times (3); the report gives
each tree's median over its runs, their ratio (this / previous), the target and whether this tree meets it:
- relay-mode CPU per batch record: the item worker's and PostgreSQL's (every session but the web server's)
  CPU over a native batch of BENCH_SBS_DRAIN_ITEMS (2,000) records at BENCH_LATENCY_MS (100) from submit to
  completion; once with none of budgets, live-first, token limits and webhooks configured, once with all of
  them (bench/tree_catalog.py) and live calls at BENCH_SBS_LIVE_RPS (5) on the same policy meanwhile;
- the drain's rate of that first batch against the slots' (8 / 100 ms = 80 items/s);
- live overhead over a direct call (p50, p99) and requests/s at concurrency 8 against a direct client's
  (bench/live_overhead.py's measurements);
- streaming: first-byte overhead (p50, p99) and chunk throughput of 50 streams against direct's, paced at
  BENCH_STREAM_EVENT_MS (10) and unpaced (bench/streaming.py's measurements);
- provider-mode CPU per record, every relay process and PostgreSQL, from the upload to the batch completed:
  BENCH_SBS_PROVIDER_ITEMS (20,000) records, a BENCH_SBS_PROVIDER_JOB_SECONDS (30) job at the fake;
- scale-out: BENCH_SCALE_ITEMS (400) records at BENCH_SCALE_LATENCY_MS (1000) by 3, 2, then 1 item workers.

Knobs: BENCH_SBS_PAIRS (3), BENCH_SBS_DRAIN_ITEMS (2000), BENCH_LATENCY_MS (100), BENCH_SBS_LIVE_RPS (5),
BENCH_LIVE_N (500), BENCH_LIVE_WARMUP (50), BENCH_LIVE_CONCURRENCY (8), BENCH_LIVE_SECONDS (5),
BENCH_STREAM_N (200), BENCH_STREAM_WARMUP (20), BENCH_STREAM_SECONDS (3), BENCH_STREAM_EVENT_MS (10),
BENCH_SBS_PROVIDER_ITEMS (20000), BENCH_SBS_PROVIDER_JOB_SECONDS (30), BENCH_SCALE_ITEMS (400),
BENCH_SCALE_LATENCY_MS (1000), BENCH_SCALE_WORKERS (1,2,3), BENCH_ITEM_BYTES (650), BENCH_SBS_SKIP (figures
to leave out: live,stream,drain,provider,scale,configured), BENCH_TREE, BENCH_BASELINE, BENCH_BASELINE_DIR,
BENCH_REDIS_DB_PREVIOUS (11), BENCH_REDIS_DB_THIS (12). BENCH_QUICK=1 (scripts/bench.sh) lowers the defaults.
Prints figures; asserts nothing about timings.
"""

import contextlib
import os
import statistics
import time
import traceback

from bench import harness, measure, tree_catalog, trees
from bench import sidebyside_runs as runs
from bench.harness import env_float, env_int, log

# (figure, key, label, format, target, test): test is ("ratio", r) for this / previous <= r, ("le", x) for
# this tree's value <= x, ("ge", x) for >= x.
ROWS = [
    ("drain", "cpu_ms", "relay-mode CPU per batch record, none configured (ms)", ".2f", ("ratio", 0.6)),
    ("configured", "cpu_ms", "relay-mode CPU per batch record, all configured (ms)", ".2f", ("ratio", 0.75)),
    ("live", "overhead_p50", "live overhead over a direct call, p50 (ms)", ".2f", ("ratio", 0.7)),
    ("live", "overhead_p99", "live overhead over a direct call, p99 (ms)", ".2f", ("le", 6.0)),
    ("live", "rps_ratio", "live requests/s at concurrency 8, of a direct client's", ".2f", ("ge", 0.55)),
    ("stream", "ttfb_p50", "streaming first-byte overhead, p50 (ms)", ".2f", ("le", 2.0)),
    ("stream", "ttfb_p99", "streaming first-byte overhead, p99 (ms)", ".2f", ("le", 10.0)),
    ("stream", "paced", "chunk throughput of direct's, 50 paced streams", ".2f", ("ge", 0.95)),
    ("stream", "unpaced", "chunk throughput of direct's, 50 unpaced streams", ".2f", ("ge", 0.5)),
    ("provider", "cpu_ms", "provider-mode CPU per record, all processes (ms)", ".3f", ("le", 0.3)),
    ("drain", "ratio", "drain at 100 ms, of the slot limit", ".2f", ("ge", 0.95)),
]


def _target(test: tuple) -> str:
    kind, bound = test
    return {"ratio": f"≤ {bound:g}× previous", "le": f"≤ {bound:g}", "ge": f"≥ {bound:g}"}[kind]


def _met(test: tuple, prev, this) -> str:
    kind, bound = test
    if this is None or (kind == "ratio" and not prev):
        return "?"
    value = this / prev if kind == "ratio" else this
    return "yes" if (value <= bound if kind in ("ratio", "le") else value >= bound) else "NO"


class Run:
    """The runs of every figure by tree, and what went wrong."""

    def __init__(self, pairs: int):
        self.pairs = pairs
        self.values: dict = {}  # figure -> label -> [result dicts]
        self.errors: list[str] = []

    def alternate(self, figure: str, sides: list, fn) -> None:
        """`fn(side)` for the previous release then this tree, `pairs` times."""
        for i in range(self.pairs):
            for side in sides:
                log(f"{figure}: pair {i + 1} of {self.pairs}, {side.tree}")
                try:
                    out = fn(side)
                except Exception as exc:  # noqa: BLE001 - a figure that fails on one tree is reported, not fatal
                    self.errors.append(f"{figure} on {side.tree}: {type(exc).__name__}: {exc}")
                    log(self.errors[-1])
                    traceback.print_exc()
                    continue
                log(f"{figure} on {side.tree}: {_brief(out)}")
                self.values.setdefault(figure, {}).setdefault(side.tree.label, []).append(out)

    def median(self, figure: str, label: str, key):
        got = [v[key] for v in self.values.get(figure, {}).get(label, []) if v.get(key) is not None]
        return statistics.median(got) if got else None


def _brief(out: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in out.items() if k != "counts")


def _side(tree: trees.Tree, redis_db: int, es: contextlib.ExitStack) -> runs.Side:
    stack = es.enter_context(
        harness.Stack(db_name=harness.db_name(f"_sbs_{tree.label}"), redis_db=redis_db, tree=tree.path, isolated=True)
    )
    log(f"{tree}: {tree.path}; fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
    stack.fresh()
    upstream = stack.start_upstream(0)
    log(f"{tree}: relay apply: {tree_catalog.apply(stack, upstream.url, configured=False)}")
    key = tree_catalog.relay_key(stack)
    web = stack.start_web(production=True)
    return runs.Side(tree=tree, stack=stack, upstream=upstream, web=web, key=key)


def _start_fleet(side: runs.Side) -> None:
    side.stack.start_worker()
    side.fleet = {p.name.removesuffix("-bench"): p for p in side.stack.procs if p.name.endswith("-bench")}
    if "webhooks" not in side.fleet:
        side.notes.append("no webhooks process (webhooks are delivered by the control worker)")


def _configure(side: runs.Side, receiver: tree_catalog.Receiver) -> None:
    try:
        log(f"{side.tree}: relay apply: {tree_catalog.apply(side.stack, side.upstream.url, configured=True)}")
    except RuntimeError as exc:
        side.notes.append(f"the configured catalog was refused: {str(exc)[-300:]}")
    problem = tree_catalog.register_webhook(side.web.url, side.key, receiver.url)
    if problem:
        side.notes.append(problem)


def run() -> Run:
    quick = os.environ.get("BENCH_QUICK") == "1"
    pairs = env_int("BENCH_SBS_PAIRS", 3)
    skip = set((os.environ.get("BENCH_SBS_SKIP") or "").replace(" ", "").split(","))
    item_bytes = env_int("BENCH_ITEM_BYTES", 650)
    cfg = {
        "drain_n": env_int("BENCH_SBS_DRAIN_ITEMS", 500 if quick else 2000),
        "latency": env_float("BENCH_LATENCY_MS", 100),
        "live_rps": env_float("BENCH_SBS_LIVE_RPS", 5),
        "live": (
            env_int("BENCH_LIVE_N", 500),
            env_int("BENCH_LIVE_WARMUP", 50),
            env_int("BENCH_LIVE_CONCURRENCY", 8),
            env_float("BENCH_LIVE_SECONDS", 5),
        ),
        "stream": (
            env_int("BENCH_STREAM_N", 200),
            env_int("BENCH_STREAM_WARMUP", 20),
            env_float("BENCH_STREAM_SECONDS", 3),
            env_float("BENCH_STREAM_EVENT_MS", 10),
        ),
        "provider_n": env_int("BENCH_SBS_PROVIDER_ITEMS", 5000 if quick else 20_000),
        "provider_job_s": env_float("BENCH_SBS_PROVIDER_JOB_SECONDS", 10 if quick else 30),
        "scale_n": env_int("BENCH_SCALE_ITEMS", 400),
        "scale_latency": env_float("BENCH_SCALE_LATENCY_MS", 1000),
        "scale_workers": [int(x) for x in (os.environ.get("BENCH_SCALE_WORKERS") or "1,2,3").split(",") if x.strip()],
    }
    # The configured catalog's webhook endpoint is a loopback receiver: every relay process must accept it.
    os.environ.setdefault("RELAY_WEBHOOK_ALLOWED_HOSTS", "127.0.0.1")
    started = time.monotonic()
    r = Run(pairs)
    r.cfg, r.load_before = cfg, measure.load()
    prev, this = trees.previous(), trees.this()
    r.trees = (prev, this)
    with contextlib.ExitStack() as es:
        sides = [
            _side(prev, env_int("BENCH_REDIS_DB_PREVIOUS", 11), es),
            _side(this, env_int("BENCH_REDIS_DB_THIS", 12), es),
        ]
        if "live" not in skip:
            r.alternate("live", sides, lambda s: runs.live(s, *cfg["live"]))
        if "stream" not in skip:
            r.alternate("stream", sides, lambda s: runs.stream(s, *cfg["stream"]))
        if skip >= {"drain", "provider", "scale", "configured"}:
            return _finish(r, sides, started)
        for side in sides:
            log(f"{side.tree}: starting the background processes")
            _start_fleet(side)
        if "drain" not in skip:
            r.alternate("drain", sides, lambda s: runs.drain(s, cfg["drain_n"], cfg["latency"], item_bytes))
        if "provider" not in skip:
            r.alternate(
                "provider", sides, lambda s: runs.provider(s, cfg["provider_n"], cfg["provider_job_s"], item_bytes)
            )
        if "scale" not in skip:
            r.alternate(
                "scale",
                sides,
                lambda s: runs.scale(s, cfg["scale_n"], cfg["scale_latency"], cfg["scale_workers"], item_bytes),
            )
        if "configured" not in skip:
            receiver = tree_catalog.Receiver()
            es.callback(receiver.close)
            for side in sides:
                _configure(side, receiver)
            r.alternate(
                "configured",
                sides,
                lambda s: runs.drain(s, cfg["drain_n"], cfg["latency"], item_bytes, live_rps=cfg["live_rps"]),
            )
            r.webhooks_received = receiver.count
        return _finish(r, sides, started)


def _finish(r: Run, sides: list, started: float) -> Run:
    r.notes = {side.tree.label: list(side.notes) for side in sides}
    r.wall_s = time.monotonic() - started
    print_report(r)
    return r


def print_report(r: Run) -> None:
    prev, this = r.trees
    cfg = r.cfg
    print()
    print(f"== Side by side with the previous release — {measure.machine()}, {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"previous: {prev.commit} ({prev.path}); this tree: {this.commit} ({this.path})")
    print(f"load before: {r.load_before}; after: {measure.load()}; {r.pairs} pairs, medians; {r.wall_s:.0f} s")
    rows = []
    for figure, key, label, fmt, test in ROWS:
        if figure not in r.values:
            continue
        rows.append(_row(r, figure, key, label, fmt, test))
    for count in cfg["scale_workers"]:
        if "scale" in r.values:
            label = f"scale-out, {count} worker(s), of {count} × 8 slots at {cfg['scale_latency']:g} ms"
            rows.append(_row(r, "scale", count, label, ".2f", ("ge", 0.95)))
    headers = ["figure", f"previous ({prev.commit})", f"this tree ({this.commit})", "ratio", "target", "met?"]
    print(measure.table(headers, rows))
    live_n, _, conc, live_s = cfg["live"]
    stream_n, _, stream_s, paced_ms = cfg["stream"]
    print(
        f"sizes: batch records {cfg['drain_n']:,} at {cfg['latency']:g} ms (configured: with {cfg['live_rps']:g} live "
        f"calls/s on the policy); live {live_n} pairs, {conc} threads × {live_s:g} s; streaming {stream_n} pairs, "
        f"50 streams × {stream_s:g} s, paced at {paced_ms:g} ms; provider mode {cfg['provider_n']:,} records, a "
        f"{cfg['provider_job_s']:g} s job; scale-out {cfg['scale_n']} records"
    )
    print("relay-mode CPU = item worker + PostgreSQL sessions other than the web server's; per run (ms/record):")
    for figure in ("drain", "configured"):
        for label, got in r.values.get(figure, {}).items():
            parts = "; ".join(
                f"{v['cpu_ms']:.2f} (worker {v['worker_ms']:.2f}, pg {v['pg_ms']:.2f}; drain {v['ratio']:.2f}; "
                f"machine {v['busy']:.2f} cores)"
                for v in got
            )
            print(f"  {figure}, {label}: {parts}")
    for label, got in r.values.get("provider", {}).items():
        print(f"  provider mode, {label}, µs per record by process: {got[-1]['by_group_us']}")
    if hasattr(r, "webhooks_received"):
        print(f"webhook events received by the loopback endpoint: {r.webhooks_received}")
    for label, notes in r.notes.items():
        for note in notes:
            print(f"note, {label}: {note}")
    for error in r.errors:
        print(f"FAILED: {error}")
    print()


def _row(r: Run, figure: str, key, label: str, fmt: str, test: tuple) -> list:
    prev, this = r.median(figure, "previous", key), r.median(figure, "this", key)
    ratio = f"{this / prev:.2f}" if prev and this is not None else "-"
    shown = [format(v, fmt) if v is not None else "n/a" for v in (prev, this)]
    return [label, *shown, ratio, _target(test), _met(test, prev, this)]


if __name__ == "__main__":
    result = run()
    raise SystemExit(1 if result.errors else 0)
