"""How the API's gunicorn runs, in embedded mode and in the full stack (issue 12).

`gthread` workers: gunicorn 27 parks a connection whose request has not
arrived in its poller (no thread held), and relay.edge bounds how long a
request *body* may take (RELAY_BODY_READ_SECONDS + size/RELAY_BODY_MIN_RATE,
RELAY_BODY_IDLE_SECONDS between reads). A slow client therefore holds one
thread for at most that long; with THREADS threads per worker, 16 slow
connections leave most threads free and /healthz answers. In the full stack
nginx (deploy/nginx.conf) buffers whole requests first, so gunicorn never sees
a slow client at all.

`python -m relay.webserver --bind 0.0.0.0:8080` runs it (compose.yaml, Dockerfile).
"""

import os
import sys

WORKERS = 2
THREADS = 32
# gunicorn's hard maximum; relay.edge answers a URL over RELAY_MAX_URL_CHARS with a JSON 414 first.
LIMIT_REQUEST_LINE = 8190


def gunicorn_argv(python: str, bind: str, *, access_log: bool = True) -> list[str]:
    argv = [
        python,
        "-m",
        "gunicorn",
        "relay.wsgi",
        "-b",
        bind,
        "--worker-class",
        "gthread",
        "--workers",
        str(WORKERS),
        "--threads",
        str(THREADS),
        "--timeout",
        "120",
        "--keep-alive",
        "5",
        "--limit-request-line",
        str(LIMIT_REQUEST_LINE),
    ]
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

    from relay import processes, routing, upstream

    steps = (
        ("urls", lambda: get_resolver().url_patterns),
        ("catalog", routing.warm),
        ("upstream", upstream.warm),
        ("connection", connections.close_all),  # the main thread's: it serves no request
    )
    processes.run_warm_up(steps, logging.getLogger("relay.webserver"), what="web worker", first="request")


def main() -> None:  # pragma: no cover - compose.yaml and the Dockerfile run it
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="0.0.0.0:8080")
    args = parser.parse_args()
    argv = gunicorn_argv(sys.executable, args.bind)
    os.execv(sys.executable, argv)


if __name__ == "__main__":
    main()
