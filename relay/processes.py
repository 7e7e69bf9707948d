"""The relay's background processes, defined once.

compose.yaml (`python -m relay.processes worker|control|webhooks|beat`), embedded mode,
the tests and the benchmarks all start them from here, so each runs exactly as
production does:

- `worker`  — item work: queue `batch`, 8 slots per replica shared by every batch (design §4), as 8
  threads of one process (see `worker_argv`).
- `control` — control work: queue `control` (sweeping, validation, finalization) and `default`.
  Its own pool, so control work never waits behind items and never takes an item slot.
- `webhooks` — webhook deliveries (batches/webhooks/lane.py): not a Celery worker but a loop that picks due
  deliveries from PostgreSQL fairly across owners and POSTs many at once, with per-endpoint and per-owner
  caps. Its own process, so a tenant's receivers that never answer cannot take a control slot.
- `beat`    — the periodic jobs (the sweeper), one per deployment.

Usage: `python -m relay.processes ROLE [--name NAME] [--schedule FILE] [--loglevel LEVEL]`.
"""

import argparse
import os
import sys
import tempfile

from batches import queues

# 8 items in flight per replica, shared by all batches (design §4).
WORKER_CONCURRENCY = 8
# Validation and finalization of large batches take seconds; four slots keep a few
# long jobs (or one frozen process) from holding up the sweeper and the wake-ups.
CONTROL_CONCURRENCY = 4
ITEM_QUEUES = queues.ITEM_QUEUE
CONTROL_QUEUES = f"{queues.CONTROL_QUEUE},{queues.DEFAULT_QUEUE}"
ROLES = ("worker", "control", "webhooks", "beat")


def _celery(python: str) -> list[str]:
    return [python, "-m", "celery", "-A", "relay"]


def worker_argv(python: str, name: str, *, loglevel: str = "INFO") -> list[str]:
    """The item worker: queue `batch`, 8 slots as threads of one process (Celery's `threads` pool).

    A slot spends its item waiting on the provider, so the slots share one interpreter (and its GIL)
    at little cost, and one process means one bookkeeper thread, one catalog, one upstream pool and 9
    database connections per replica instead of 16. Measured (`make bench`, 2,000 items at 100 ms,
    2-core AMD EPYC, same code, A/B quick runs): CPU per item, worker + PostgreSQL + Redis, 3.9-5.1 ms
    with 8 prefork processes, 3.2-3.9 ms with 8 threads; 0 ms ceiling 436 against 464 items/s (noisy:
    366-582 in full runs). Likely cause: work after a 100 ms sleep runs on cold caches, and 8
    processes (and 16 backends) keep more of them cold than one. A replica uses about one core of
    Python at most: more throughput is more replicas."""
    return [
        *_celery(python),
        "worker",
        "-Q",
        ITEM_QUEUES,
        "-c",
        str(WORKER_CONCURRENCY),
        "-P",
        "threads",
        "--loglevel",
        loglevel,
        "-n",
        f"items-{name}@%h",
    ]


def control_argv(python: str, name: str, *, loglevel: str = "INFO") -> list[str]:
    """The control worker: sweeping, validation and finalization, on their own queue and pool."""
    return [
        *_celery(python),
        "worker",
        "-Q",
        CONTROL_QUEUES,
        "-c",
        str(CONTROL_CONCURRENCY),
        "-P",
        "prefork",
        "--loglevel",
        loglevel,
        "-n",
        f"control-{name}@%h",
    ]


def webhooks_argv(python: str, name: str, *, loglevel: str = "INFO") -> list[str]:
    """The webhook lane: deliveries, concurrently, on a lane of their own (RELAY_WEBHOOK_CONCURRENCY)."""
    return [python, "-m", "relay.processes", "webhooks", "--name", f"webhooks-{name}", "--loglevel", loglevel]


def run_webhooks(name: str, loglevel: str) -> None:
    """Become the webhook lane: set Django up (its logging config, scrub filter included) and loop until SIGTERM."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")
    os.environ["LOG_LEVEL"] = loglevel
    import django

    django.setup()
    from batches.webhooks import lane

    lane.main(name)


def beat_argv(python: str, schedule: str, *, loglevel: str = "INFO") -> list[str]:
    """The periodic jobs. `schedule` is beat's state file: keep it out of the working directory."""
    return [*_celery(python), "beat", "--loglevel", loglevel, "-s", schedule]


def fleet(python: str, name: str, *, schedule: str, loglevel: str = "INFO") -> list[tuple[str, list[str]]]:
    """Every background process a relay needs, as (role, argv): what compose.yaml declares."""
    return [
        ("worker", worker_argv(python, name, loglevel=loglevel)),
        ("control", control_argv(python, name, loglevel=loglevel)),
        ("webhooks", webhooks_argv(python, name, loglevel=loglevel)),
        ("beat", beat_argv(python, schedule, loglevel=loglevel)),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m relay.processes", description=__doc__.split("\n\n")[0])
    parser.add_argument("role", choices=ROLES)
    parser.add_argument("--name", default=os.environ.get("HOSTNAME", "relay"))
    parser.add_argument("--schedule", default=os.path.join(tempfile.gettempdir(), "relay-celerybeat-schedule"))
    parser.add_argument("--loglevel", default=os.environ.get("LOG_LEVEL", "INFO"))
    args = parser.parse_args(argv)
    if args.role == "worker":
        cmd = worker_argv(sys.executable, args.name, loglevel=args.loglevel)
    elif args.role == "control":
        cmd = control_argv(sys.executable, args.name, loglevel=args.loglevel)
    elif args.role == "webhooks":
        run_webhooks(args.name, args.loglevel)  # this process is the lane (no exec: it is Python already)
        return
    else:
        cmd = beat_argv(sys.executable, args.schedule, loglevel=args.loglevel)
    os.execv(sys.executable, cmd)  # become the process: signals from compose reach Celery directly


if __name__ == "__main__":
    main()
