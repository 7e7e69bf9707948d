"""How the API's gunicorn runs, in embedded mode and in the full stack (decision 0008).

`gthread` workers: gunicorn 27 parks a connection whose request has not
arrived in its poller (no thread held), and gateway.edge bounds how long a
request *body* may take (RELAY_BODY_READ_SECONDS + size/RELAY_BODY_MIN_RATE,
RELAY_BODY_IDLE_SECONDS between reads). A slow client therefore holds one
thread for at most that long; with THREADS threads per worker, 16 slow
connections leave most threads free and /healthz answers. In the full stack
nginx (deploy/nginx.conf) buffers whole requests first, so gunicorn never sees
a slow client at all.

A streamed answer holds its thread until its last event, so THREADS is sized for streams
(RELAY_WEB_THREADS, 256): 200 concurrent streams leave /healthz and whole answers prompt. Why
threads rather than an ASGI or gevent worker, with the measurements:
docs/decisions/0016-streaming-server-model.md.

Memory (decision 0014): what one request may make a worker build is capped where bodies are parsed,
a worker over RELAY_WEB_MAX_RSS_MB is recycled after the request that took it there, and every
worker is recycled after MAX_REQUESTS (+ up to MAX_REQUESTS_JITTER, so the two seldom restart
together) requests: a worker drains its requests (GRACEFUL_TIMEOUT covers the upstream deadline)
and a fresh one takes its place, so no request is dropped. relay/gunicorn_config.py holds the
check, and the access log's format, which drops query strings.

gunicorn's control socket (`gunicornc`) is off unless a path is given: by default gunicorn would
put it in $XDG_RUNTIME_DIR or ~/.gunicorn, outside the deployment, shared by every gunicorn of the
user. Embedded mode keeps it in its state directory (relay.embedded).

`python -m relay.webserver --bind 0.0.0.0:8080` runs it (compose.yaml, Dockerfile).
"""

import itertools
import os
import sys
import threading

WORKERS = 2
# Threads per worker. A streamed answer holds its thread until its last event (seconds to minutes), so
# the pool is sized for streams, not for the CPU: 200 concurrent streams must leave threads for /healthz
# and for answers served whole (docs/decisions/0016-streaming-server-model.md has the measurements).
# RELAY_WEB_THREADS sets it.
DEFAULT_THREADS = 256
# Of those, how many keep a database connection open between requests (CONN_MAX_AGE): as many as every
# thread kept before streaming, so a pool sized for streams does not also size PostgreSQL's connections
# (its default limit is 100). A thread beyond them closes its connection after each request; streams'
# usage events go through one writer thread per worker (gateway.streaming) and need none.
PERSISTENT_DB_THREADS = 32


def threads(env=None) -> int:
    raw = (os.environ if env is None else env).get("RELAY_WEB_THREADS", "")
    return int(raw) if raw.isascii() and raw.isdigit() and int(raw) > 0 else DEFAULT_THREADS


THREADS = threads()
# gunicorn's hard maximum; gateway.edge answers a URL over RELAY_MAX_URL_CHARS with a JSON 414 first.
LIMIT_REQUEST_LINE = 8190
# Every worker is recycled after this many requests, plus a random share of the jitter: rare enough
# that its warm-up (relay.webserver.warm_up) costs nothing measurable, often enough that slow growth
# does not last. The resident-size check (relay/gunicorn_config.py) handles fast growth.
MAX_REQUESTS = 10_000
MAX_REQUESTS_JITTER = 1_000
# How long a stopping worker lets its requests finish: RELAY_UPSTREAM_DEADLINE's default (300 s) and a margin.
GRACEFUL_TIMEOUT = 330


def gunicorn_argv(python: str, bind: str, *, access_log: bool = True, control_socket: str | None = None) -> list[str]:
    argv = [
        python,
        "-m",
        "gunicorn",
        "relay.wsgi",
        "--config",
        "python:relay.gunicorn_config",
        "-b",
        bind,
        "--worker-class",
        "gthread",
        "--workers",
        str(WORKERS),
        "--threads",
        str(threads()),
        "--timeout",
        "120",
        "--keep-alive",
        "5",
        "--limit-request-line",
        str(LIMIT_REQUEST_LINE),
        "--max-requests",
        str(MAX_REQUESTS),
        "--max-requests-jitter",
        str(MAX_REQUESTS_JITTER),
        "--graceful-timeout",
        str(GRACEFUL_TIMEOUT),
    ]
    argv += ["--control-socket", control_socket] if control_socket else ["--no-control-socket"]
    if access_log:
        argv += ["--access-logfile", "-"]
    return argv


def warm_up() -> None:
    """What each gunicorn worker's first requests would otherwise pay, done as the worker loads the app
    (relay/wsgi.py), before it accepts a connection: the URLconf with every view module, the catalog
    of the enabled policies, the upstream session. gunicorn loads the app in each worker after the
    fork, and Django imports the URLconf on the first request, so without this the first request a
    worker serves paid for the imports (0.18 s of CPU on the Intel bench host) and the catalog's load.
    Best effort: a step that fails is done by the first request instead. The worker's main thread
    serves no request, so its database connection is closed again."""
    import logging

    from django.db import connections
    from django.urls import get_resolver

    from core import warmup as warm_up_runner
    from gateway import routing, upstream

    steps = (
        ("db threads", _limit_persistent_connections),
        ("urls", lambda: get_resolver().url_patterns),
        ("catalog", routing.warm),
        ("upstream", upstream.warm),
        ("connection", connections.close_all),  # the main thread's: it serves no request
    )
    warm_up_runner.run_warm_up(steps, logging.getLogger("relay.webserver"), what="web worker", first="request")


_thread_slots = threading.local()
_slots_taken = itertools.count()


def _limit_persistent_connections() -> None:
    """Past PERSISTENT_DB_THREADS threads of a worker, a thread closes its database connection when its
    request has finished (after the answer's closers, so after a usage event's INSERT). The first threads
    to serve a request keep theirs, as every thread did when the pool was 32 threads."""
    from django.core.signals import request_finished

    request_finished.connect(_close_surplus_connection, dispatch_uid="relay.webserver.db_threads")


def _close_surplus_connection(**_) -> None:
    slot = getattr(_thread_slots, "slot", None)
    if slot is None:
        slot = _thread_slots.slot = next(_slots_taken)
    if slot >= PERSISTENT_DB_THREADS:
        from django.db import connections

        for connection in connections.all(initialized_only=True):
            connection.close()


def main() -> None:  # pragma: no cover - compose.yaml and the Dockerfile run it
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="0.0.0.0:8080")
    parser.add_argument("--control-socket", default=None, help="a path for gunicornc's socket (default: none)")
    args = parser.parse_args()
    argv = gunicorn_argv(sys.executable, args.bind, control_socket=args.control_socket)
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
