"""The noisy-neighbour drill: no tenant can slow, bench, steer or dodge the bill for another.

    .venv/bin/python -m bench.noisy          (or: make noisy-drill)

Starts, on loopback only, the relay's real process set against the machine's PostgreSQL and Redis, in a
database of its own (`relay_bench_noisy`, dropped at the end; BENCH_DB_PREFIX changes `relay_bench`) and Redis
db NOISY_REDIS_DB (13): the web server as production runs it (relay.webserver's argv), the background processes
as compose declares them (relay.processes.fleet), and the fake provider (bench/noisy_upstream.py: the providers'
wire formats and batch APIs, answering after NOISY_UPSTREAM_DELAY_MS, 50). The processes run with
bench.noisy_core.DRILL_ENV: a 2 s RELAY_UPSTREAM_READ_TIMEOUT, loopback webhook endpoints allowed, provider
jobs polled every 0.5 s. Two tenants share the catalog and its host keys (bench/noisy_core.py says what each
does):

1. quiet: tenant B alone — live calls one after another while an OpenAI, an Anthropic and a native batch run;
2. attacked: tenant A does its worst (dead webhook endpoints, calls that time out at the provider, streams it
   hangs up, provider-mode batches on a $0 budget, provider headers of its choosing) while B does the same
   again.

Prints one line per attack with B's figures beside the quiet run's and A's containment figures, and exits 1
when any attack is not contained (counts, and the issue's generous bounds on B's batch times; B's live p50
ratio is printed, not judged: the machine is shared). A few minutes on 2 cores.
"""

import json
import os
import subprocess
import sys
import time

from bench import harness, noisy_core, noisy_verdicts
from bench.harness import env_int, log

PY = harness.PY


def start_upstream(stack: harness.Stack, delay_ms: float) -> str:
    proc = stack.spawn(
        "noisy-upstream", [PY, "-m", "bench.noisy_upstream", "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE
    )
    line = proc.popen.stdout.readline().decode().strip()
    if not line.startswith("READY "):
        raise RuntimeError(f"fake provider did not start: {line!r}\n{proc.tail()}")
    return line.split(" ", 1)[1]


def warm_up(url: str, tenants: noisy_core.Tenants) -> None:
    """Every process loads its code before the quiet figures: a few live calls and one small batch."""
    import requests

    for i in range(5):
        chat = {**noisy_core.CHAT, "messages": [{"role": "user", "content": f"warm-up {i}"}]}
        requests.post(f"{url}/v1/chat/completions", json=chat, headers=noisy_core._auth(tenants.b), timeout=60)
    noisy_core.run_b_batches_once(url, tenants.b)


def run() -> int:
    started = time.monotonic()
    redis_db = env_int("NOISY_REDIS_DB", 13)
    with harness.Stack(db_name=harness.db_name("_noisy"), redis_db=redis_db) as stack:
        os.environ.update(noisy_core.DRILL_ENV)  # this process and every process it starts
        log(f"fresh database {stack.db_name}, Redis db {stack.redis_db}; migrating")
        stack.fresh()
        upstream = start_upstream(stack, harness.env_float("NOISY_UPSTREAM_DELAY_MS", 50.0))
        tenants = noisy_core.seed(upstream)
        web = stack.start_web(production=True)
        stack.start_worker("noisy")
        log(f"fake provider {upstream}, relay {web.url}; {', '.join(p.name for p in stack.procs)} started")
        warm_up(web.url, tenants)
        log("1. quiet: tenant B alone")
        quiet = noisy_core.quiet_round(web.url, tenants)
        log("2. attacked: tenant A does its worst while B does the same again")
        receiver = noisy_core.DeadReceiver()
        try:
            b, a = noisy_core.attacked_round(web.url, tenants, receiver)
            seen = noisy_verdicts.seen_by_provider(upstream)
            billing = noisy_verdicts.stream_billing(a, seen)
            spend = noisy_verdicts.provider_spend(tenants, a)
            reached = noisy_verdicts.headers_reached(noisy_verdicts.seen_by_provider(upstream))
        finally:
            receiver.stop()
        verdicts = noisy_verdicts.verdicts(quiet, b, a, billing, spend, reached)
        accepted = receiver.accepted
    print()
    print(f"== Noisy-neighbour drill — {time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores")
    width = max(len(v.attack) for v in verdicts)
    for v in verdicts:
        print(f"{v.attack:<{width}}  {'contained    ' if v.contained else 'NOT CONTAINED'}  {v.line}")
    print(noisy_verdicts.b_live_line(quiet, b))
    print(f"the dead receiver accepted {accepted} connections; A's errors: {a.errors or 'none'}")
    print(f"drill wall time {time.monotonic() - started:.0f} s")
    out = os.environ.get("NOISY_JSON")
    if out:
        with open(out, "w") as fh:
            json.dump({v.attack: {"contained": v.contained, "line": v.line} for v in verdicts}, fh, indent=2)
    failed = [v.attack for v in verdicts if not v.contained]
    print(f"noisy-drill: {'FAILED: not contained: ' + ', '.join(failed) if failed else 'every attack contained'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run())
