"""Real Celery worker processes for end-to-end batch tests (no eager mode).

The relay's background processes are started exactly as in production
(relay.processes: the 8-slot item worker on `batch`, the control worker on
`control`, the webhook lane, beat), against the test database and the test Redis, with short
lease/heartbeat/sweep settings so crash recovery is observable in seconds. Each is forked from a warm
parent that has the third-party libraries imported (tests/zygote.py: about a second of each process's
start), then runs compose's command line in its own environment; TEST_FLEET_FORK=0 starts them with
Popen instead.
"""

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from relay.processes import fleet

ROOT = Path(__file__).resolve().parent.parent

TEST_BATCH_ENV = {
    "RELAY_BATCH_LEASE_SECONDS": "3",
    "RELAY_BATCH_HEARTBEAT_SECONDS": "0.5",
    "RELAY_BATCH_SWEEP_SECONDS": "1",
    "RELAY_BATCH_ITEM_DEADLINE_SECONDS": "6",
}


def database_url(settings_dict: dict) -> str:
    s = settings_dict
    auth = s["USER"] + (f":{s['PASSWORD']}" if s.get("PASSWORD") else "")
    return f"postgres://{auth}@{s['HOST'] or '127.0.0.1'}:{s['PORT'] or 5432}/{s['NAME']}"


class _Zygote:
    """This process's tests/zygote.py, started on first use and kept for the session (one per xdist worker)."""

    _lock = threading.Lock()
    _proc: subprocess.Popen | None = None

    @classmethod
    def ask(cls, request: dict) -> dict:
        with cls._lock:
            if cls._proc is None or cls._proc.poll() is not None:
                cls._proc = subprocess.Popen(
                    [sys.executable, "-m", "tests.zygote"], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE
                )
            cls._proc.stdin.write(json.dumps(request).encode() + b"\n")
            cls._proc.stdin.flush()
            line = cls._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the test zygote exited with {cls._proc.wait()}")
            return json.loads(line)


class Forked:
    """A process forked by the zygote, with the part of Popen's interface the tests use."""

    def __init__(self, argv: list[str], env: dict, log_path: str, stdout_path: str | None = None):
        self.args = argv
        self.returncode: int | None = None
        request = {"op": "spawn", "argv": argv, "env": env, "cwd": str(ROOT), "log": log_path}
        if stdout_path is not None:
            request["stdout"] = stdout_path
        self.pid = _Zygote.ask(request)["pid"]

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = _Zygote.ask({"op": "poll", "pid": self.pid})["returncode"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode


def _start(argv: list[str], env: dict, log, *, quiet_stdout: bool = False) -> "subprocess.Popen | Forked":
    """argv (`python -m ...`) in a session of its own, stderr (and stdout, unless `quiet_stdout`) to `log`."""
    if os.environ.get("TEST_FLEET_FORK", "1") != "0":
        return Forked(argv, env, log.name, os.devnull if quiet_stdout else None)
    stdout = subprocess.DEVNULL if quiet_stdout else log
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=stdout, stderr=log, start_new_session=True)


class Worker:
    """The relay's background processes (relay.processes.fleet: item worker, control worker, webhook lane, beat),
    each in its own process group, started exactly as compose.yaml starts them."""

    def __init__(self, db_url: str, name: str, extra_env: dict | None = None, beat: bool = True):
        self.name = name
        self.schedule = tempfile.mkdtemp(prefix="relay-beat-")
        env = {**os.environ, "DATABASE_URL": db_url, **TEST_BATCH_ENV, **(extra_env or {})}
        self.logs, self.procs, self.argv = {}, {}, {}
        self.env = env
        schedule = os.path.join(self.schedule, "beat")
        loglevel = os.environ.get("TEST_WORKER_LOGLEVEL", "WARNING")
        for role, args in fleet(sys.executable, name, schedule=schedule, loglevel=loglevel):
            if role == "beat" and not beat:
                continue
            if role in ("worker", "control"):  # the Celery workers (the webhook lane is not one)
                args = [*args, "--without-gossip", "--without-mingle"]
            log = open(os.path.join(self.schedule, f"{role}.log"), "w+b")  # noqa: SIM115 - closed in stop()
            self.logs[role] = log
            self.argv[role] = args
            self.procs[role] = _start(args, env, log)

    @property
    def proc(self) -> "subprocess.Popen | Forked":
        """The item worker (the one holding the 8 slots)."""
        return self.procs["worker"]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def kill(self, role: str | None = None) -> None:
        """SIGKILL the processes (pool children included), like an OOM kill or a lost node."""
        for name, proc in self.procs.items():
            if role is not None and name != role:
                continue
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)

    def restart(self, role: str) -> None:
        """Start a role again after `kill(role)`, as compose's `restart: unless-stopped` would."""
        self.procs[role] = _start(self.argv[role], self.env, self.logs[role])

    def signal(self, sig: int, role: str = "worker") -> None:
        """Send a signal to one process group (SIGSTOP freezes it, SIGCONT thaws it)."""
        os.killpg(self.procs[role].pid, sig)

    def stop(self, grace: float = 0.5) -> None:
        """SIGTERM, and SIGKILL for what is still running after `grace` seconds: a Celery worker's warm
        shutdown waits out its broker poll and its pool (1-3 s), and nothing is checked after it."""
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGCONT)  # a frozen process cannot act on SIGTERM
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs.values()):
            time.sleep(0.02)
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole group: pool children too
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)
        for log in self.logs.values():
            log.close()
        # Its logs and beat's schedule: a run starts ~25 fleets; read them (`output`, `logs`) before the stop.
        shutil.rmtree(self.schedule, ignore_errors=True)

    def output(self) -> str:
        parts = []
        for role, log in self.logs.items():
            if not log.closed:
                log.flush()
            path = Path(log.name)
            text = path.read_text(errors="replace")[-3000:] if path.exists() else "(removed when the fleet stopped)"
            parts.append(f"--- {role} ---\n" + text)
        return "\n".join(parts)


def broker_idle() -> bool:
    """No task waits in the broker and none runs: tasks are acknowledged late, so a message a worker took
    stays in the transport's `unacked` hash until its task has returned."""
    import redis
    from django.conf import settings

    r = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    if r.hlen("unacked"):
        return False
    return not any(r.type(key) == b"list" and r.llen(key) for key in r.scan_iter(count=1000))


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process_group(proc: "subprocess.Popen | Forked") -> None:
    """SIGTERM to the process's whole group (it was started in a session of its own), SIGKILL after 20 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class Web:
    url: str
    port: int
    log: Path


@contextlib.contextmanager
def production_web(settings_dict: dict, *, log_prefix: str, access_log: bool = False, env: dict | None = None):
    """The production web server (gunicorn with relay.webserver's argv: embedded mode's and compose's) on the
    test database, on a free port; yields once it answers /healthz and every web worker has warmed up
    (a worker still warming up when a test restarts PostgreSQL would find no database for its catalog).
    Its log (stderr, and the access log when `access_log`) is in `Web.log`."""
    import requests

    from relay.webserver import WORKERS, gunicorn_argv

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix=log_prefix, suffix=".log")  # noqa: SIM115 - closed below
    proc = _start(
        gunicorn_argv(sys.executable, f"127.0.0.1:{port}", access_log=access_log),
        dict(os.environ, DATABASE_URL=database_url(settings_dict), LOG_LEVEL="INFO", **(env or {})),
        log,
        quiet_stdout=not access_log,
    )
    url = f"http://127.0.0.1:{port}"

    def up():
        try:
            return requests.get(url + "/healthz", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def warmed() -> int:
        return sum("web worker warmed up" in line for line in Path(log.name).read_text().splitlines())

    try:
        wait_for(up, 60, interval=0.3, what="gunicorn to answer /healthz")
        wait_for(lambda: warmed() >= WORKERS, 60, interval=0.05, what="every web worker to warm up")
        yield Web(url, port, Path(log.name))
    finally:
        stop_process_group(proc)
        log.close()


def pg_cluster() -> tuple[str, str] | None:
    """(version, cluster) of the machine's own PostgreSQL, which a test may restart; None where it cannot
    (not root, or no Debian cluster)."""
    if os.geteuid() != 0 or not shutil.which("pg_ctlcluster") or not os.path.isdir("/etc/postgresql"):
        return None
    versions = sorted(os.listdir("/etc/postgresql"))
    return (versions[-1], "main") if versions else None


def restart_postgresql() -> None:
    """Restart the machine's PostgreSQL (fast shutdown: every session is cut, as in a crash of the server)
    and wait until the test's own connection is back."""
    from django.db import connection

    version, cluster = pg_cluster()
    connection.close()
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", version, cluster, "restart", "-m", "fast"],
        check=True,
        capture_output=True,
    )
    for _ in range(100):
        try:
            connection.close()
            connection.ensure_connection()
            return
        except Exception:
            time.sleep(0.2)
