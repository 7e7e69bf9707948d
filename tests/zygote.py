"""A warm parent for the test suite's relay processes: it imports the third-party libraries they all load
(Django, Celery, DRF, redis-py, requests, ...) once, then forks each process the suite asks for.

Why: a worker fleet (tests/workers.py `Worker`: item worker, control worker, webhook lane, beat) is four
Python processes, and each spent about a second importing libraries before it ran a line of the relay;
about 40 fleets start in a run, on 2 cores. Forked from here, a process skips those imports and nothing
else: the child takes the environment it was asked for (os.environ replaced whole), its own session
(process group), its log file as stdout and stderr, and then runs `python -m MODULE ARGS` as the command
line says (runpy, as `-m` does) — Celery's own command line for the workers and beat, `relay.processes`
for the webhook lane, exactly the argv compose.yaml runs. Nothing of the relay is imported here (its
settings read the environment when they load, which must be the child's) and nothing here reads the
environment at import: the child loads settings, apps, catalog and connections itself.

Protocol, one JSON object per line on stdin, one answer per line on stdout:
  {"op": "spawn", "argv": [...], "env": {...}, "cwd": "...", "log": "path"}  -> {"pid": N}
    (stdout and stderr to "log"; "stdout": "path" sends stdout elsewhere, /dev/null included)
  {"op": "poll", "pid": N}                                                -> {"returncode": null | int}
The children are this process's; it reaps them when asked, so a child's exit status is read here (the
returncode, negative for a signal, as subprocess reports it). EOF on stdin ends it; its children go on
until their owner stops them (tests/workers.py), as a process started with Popen would.
"""

import importlib
import json
import os
import runpy
import sys

# The libraries a relay process imports that cost the most (python -X importtime on the item worker,
# cumulative >= 8 ms each), less those that read Django's settings as they load (DRF's views, drf-spectacular's
# openapi, auth's base_user): they cannot load here. A name that fails to import (a later library version
# that starts reading settings) is skipped: the child imports it as it always did.
PRELOAD = (
    "django",
    "django.conf",
    "django.urls",
    "django.http",
    "django.db.models",
    "django.db.models.functions",
    "django.db.backends.postgresql.base",
    "django.forms",
    "django.template.backends.django",
    "django.core.serializers.json",
    "django.core.handlers.wsgi",
    "django.utils.deprecation",
    "django.contrib.admin",
    "asgiref.sync",
    "rest_framework.serializers",
    "celery",
    "celery.app.base",
    "celery.bin.celery",
    "celery.beat",
    "celery.apps.worker",
    "celery.apps.beat",
    "celery.worker",
    "celery.worker.control",
    "celery.worker.request",
    "celery.concurrency.prefork",
    "celery.concurrency.thread",
    "celery.backends.redis",
    "kombu",
    "kombu.transport.redis",
    "billiard",
    "redis",
    "hiredis",
    "requests",
    "urllib3",
    "psycopg2",
    "psycopg2.extras",
    "jwt",
    "cryptography.x509",
    "cryptography.hazmat.primitives.asymmetric.rsa",
    "httpx2",
    "flower.app",
    "tornado.web",
    "prometheus_client",
    "markdown",
    "yaml",
    "orjson",
    "ijson",
    "environ",
    "sqlparse",
    "google.auth",
    "google.oauth2.service_account",
)


# The relay's own packages: none may be imported here (the child's environment is not known yet).
OURS = ("relay", "core", "usage", "policies", "gateway", "batches", "devkit", "bench")


def preload() -> None:
    # Without it, a library that touches Django's settings while it loads fails here (and is skipped)
    # instead of loading the relay's settings from this process's environment.
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: S112 - see PRELOAD: the child imports it itself
            continue
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in OURS)
    if loaded:
        raise SystemExit(f"zygote: the preload imported the relay's own modules: {loaded}")


def _child(request: dict) -> None:
    """In the forked child: become the process the request describes, then run its command line."""
    os.setsid()  # its own session and process group, as Popen(start_new_session=True) gives
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, request.get("stdout", request["log"])), (2, request["log"])):
        opened = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    if argv[1:2] != ["-m"]:
        raise SystemExit(f"zygote: only `python -m MODULE ...` command lines, not {argv!r}")
    _name(argv)
    sys.argv = [argv[2], *argv[3:]]
    sys.path[0] = request["cwd"]
    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)


def _name(argv: list[str]) -> None:
    """A fork keeps this process's command line, so `ps` and `top` would show every child as the zygote:
    the child's name (the `comm` column) says what it runs instead: a Celery worker's node name
    (`items-shared`, `control-shared`), `celery beat`, `webhooks`, `gunicorn`."""
    if "-n" in argv:
        name = argv[argv.index("-n") + 1].split("@")[0]
    elif "beat" in argv:
        name = "celery beat"
    else:
        name = argv[3] if argv[2] == "relay.processes" else argv[2]
    name = name[:15].encode()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def main() -> None:
    preload()
    statuses: dict[int, int] = {}
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    for line in stdin:
        request = json.loads(line)
        while True:  # reap every child that has ended, keeping its status for `poll`
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            statuses[pid] = os.waitstatus_to_exitcode(status)
        if request["op"] == "spawn":
            stdout.flush()
            pid = os.fork()
            if pid == 0:
                _child(request)  # the child leaves the loop for good: its module ran, the interpreter exits
                return
            answer = {"pid": pid}
        else:
            answer = {"returncode": statuses.get(request["pid"])}
        stdout.write(json.dumps(answer).encode() + b"\n")
        stdout.flush()


if __name__ == "__main__":
    main()
