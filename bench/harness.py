"""Shared plumbing of the benchmarks: a dedicated database and Redis db, and the real processes
(gunicorn, Celery, the fake upstream) started as in production. What they measure is in
bench/measure.py, the catalog and request bodies in bench/catalog.py.

Every process is started in its own session and stopped (SIGTERM, then SIGKILL to its whole process
group) when the benchmark ends — normally, on an error, on Ctrl-C or on SIGTERM. As a last resort
each child also gets SIGTERM from the kernel if the benchmark process dies (PR_SET_PDEATHSIG).
"""

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.measure import children_of, cpu_seconds

# The benchmarks that run the relay in process (scale, webhooks, scale_drain) load Django with its settings;
# relay.processes set this on import before its import here was deferred.
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relay.settings")

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# The production web command (Dockerfile / compose.yaml), bound to a socket we opened ourselves.
GUNICORN_ARGS = ["--workers", "2", "--threads", "8", "--timeout", "120"]
# application_name of the web server's PostgreSQL sessions in an isolated stack (PGAPPNAME).
WEB_APP_NAME = "relay-bench-web"


def env_int(name: str, default: int) -> int:
    return int(os.environ.get(name) or default)


def env_float(name: str, default: float) -> float:
    return float(os.environ.get(name) or default)


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def db_name(suffix: str = "") -> str:
    """relay_bench<suffix>; BENCH_DB_PREFIX replaces `relay_bench`, so two checkouts can run
    benchmarks on one PostgreSQL at once."""
    return _check_name(os.environ.get("BENCH_DB_PREFIX") or "relay_bench") + suffix


# --- configuration of the app processes -----------------------------------------------------------


@dataclass
class Stack:
    """The environment every process of one benchmark shares, and the processes themselves."""

    db_name: str
    redis_db: int
    tmp: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="relay-bench-")))
    procs: list = field(default_factory=list)
    keep_db: bool = False
    redis_claimed: bool = False
    # The checkout whose `relay` package the relay's processes run (their cwd and PYTHONPATH): this one, or
    # another release's worktree (bench/trees.py). The fake upstream and the client are always this checkout's.
    tree: Path = ROOT
    # Nothing of the relay imported here: migrations and the processes' argv come from subprocesses run in
    # `tree`, so the benchmark does not depend on the module layout of the code it measures.
    isolated: bool = False

    @property
    def pg_base(self) -> str:
        return os.environ.get("BENCH_PG_URL", "postgres://postgres:postgres@127.0.0.1:5432").rstrip("/")

    @property
    def redis_base(self) -> str:
        return os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379").rstrip("/")

    @property
    def database_url(self) -> str:
        return f"{self.pg_base}/{self.db_name}"

    @property
    def redis_url(self) -> str:
        return f"{self.redis_base}/{self.redis_db}"

    def app_env(self) -> dict:
        return {
            "DJANGO_SETTINGS_MODULE": "relay.settings",
            "DATABASE_URL": self.database_url,
            "REDIS_URL": self.redis_url,
            "CELERY_BROKER_URL": self.redis_url,
            "SECRET_KEY": "bench-secret-key",
            "RELAY_MASTER_KEY": "bench-master-key",
            "RELAY_ADMIN_TOKEN": "bench-admin-token",
            "DEBUG": "0",
            "RELAY_EMBEDDED": "0",
            "RELAY_BATCH_PAYLOAD_DIR": str(self.tmp / "payloads"),
            "RELAY_BATCH_PAYLOAD_STORE": "dir",
            "LOG_LEVEL": "WARNING",
            "PYTHONUNBUFFERED": "1",
        }

    # --- lifecycle ---

    def __enter__(self) -> "Stack":
        _install_signal_handlers()
        # This process uses the ORM too (migrate, seed, polling): same settings as the servers.
        os.environ.update(self.app_env())
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            log(f"stopping every process after {exc_type.__name__}; cleaning up")
        self.stop_all()
        with contextlib.suppress(Exception):
            from django.db import connections

            connections.close_all()
        if self.redis_claimed:
            with contextlib.suppress(Exception):
                release_redis(self.redis_url)
        if not self.keep_db:
            with contextlib.suppress(Exception):
                drop_database(self.pg_base, self.db_name)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fresh(self) -> None:
        """Drop and create the database, flush the Redis db, migrate (in this process; isolated: `manage.py
        migrate` run in the tree)."""
        claim_redis(self.redis_url)
        self.redis_claimed = True
        drop_database(self.pg_base, self.db_name)
        create_database(self.pg_base, self.db_name)
        if self.isolated:
            self.manage("migrate", "--noinput", "-v", "0", timeout=900)
            return
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", "--noinput", verbosity=0)

    # --- processes ---

    def tree_env(self, **extra) -> dict:
        """The environment of a process of the relay's: ours, the app's settings, the tree's code first."""
        return {**os.environ, **self.app_env(), "PYTHONPATH": str(self.tree), **extra}

    def manage(self, *args: str, timeout: float = 300) -> str:
        """`python manage.py ARGS` run in the tree with the app's settings; its stdout (raises on failure)."""
        done = subprocess.run(
            [PY, "manage.py", *args],
            cwd=self.tree,
            env=self.tree_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if done.returncode != 0:
            raise RuntimeError(f"manage.py {' '.join(args)} in {self.tree} failed:\n{done.stderr[-3000:]}")
        return done.stdout

    def spawn(
        self, name: str, args: list, *, pass_fds=(), stdout=None, env: dict | None = None, cwd: Path | None = None
    ) -> "Proc":
        """`env`: the child's whole environment (default: ours plus the app's settings). `cwd`: this checkout."""
        logfile = self.tmp / f"{name}.log"
        out = open(logfile, "wb")  # noqa: SIM115 - closed in Proc.stop()
        popen = subprocess.Popen(
            args,
            env=env if env is not None else {**os.environ, **self.app_env()},
            cwd=cwd or ROOT,
            stdout=stdout if stdout is not None else out,
            stderr=out,
            pass_fds=pass_fds,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        proc = Proc(name, popen, logfile, out)
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.procs.clear()

    def start_upstream(self, delay_ms: float = 0.0) -> "Upstream":
        proc = self.spawn(
            "upstream", [PY, "-m", "bench.fake_upstream", "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE
        )
        line = proc.popen.stdout.readline().decode().strip()
        if not line.startswith("READY "):
            raise RuntimeError(f"fake upstream did not start: {line!r}\n{proc.tail()}")
        return Upstream(line.split(" ", 1)[1], proc)

    def start_web(self, production: bool = False) -> "Web":
        """gunicorn on a socket bound to port 0 here and handed over (no port race). `production`: with
        relay.webserver's whole argv (worker class, threads, limits, as compose and embedded mode run
        it) rather than GUNICORN_ARGS."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        port = sock.getsockname()[1]
        fd = sock.fileno()
        if production and self.isolated:
            argv = self._tree_web_argv(f"fd://{fd}")
        elif production:
            from relay.webserver import gunicorn_argv

            argv = gunicorn_argv(PY, f"fd://{fd}", access_log=False)
        else:
            argv = [PY, "-m", "gunicorn", "relay.wsgi", "-b", f"fd://{fd}", *GUNICORN_ARGS]
        if self.isolated:
            # PGAPPNAME names the web's PostgreSQL sessions, so a figure can leave them out (measure.pg_backends).
            env = self.tree_env(PGAPPNAME=WEB_APP_NAME)
            proc = self.spawn("web", argv, pass_fds=(fd,), env=env, cwd=self.tree)
        else:
            proc = self.spawn("web", argv, pass_fds=(fd,))
        sock.close()
        web = Web(f"http://127.0.0.1:{port}", proc)
        web.wait_ready()
        return web

    def start_worker(self, name: str = "bench", beat: bool = True) -> "Proc":
        """An item worker as in production (relay.processes: 8 slots, threads of one process, on queue `batch`). With
        `beat` (the first of a fleet) also the control worker and beat, as compose.yaml declares them
        once per deployment. Returns the item worker."""
        started = {}
        for role, argv in self._fleet(name):
            if role == "worker" or beat:
                if self.isolated:
                    started[role] = self.spawn(f"{role}-{name}", argv, env=self.tree_env(), cwd=self.tree)
                else:
                    started[role] = self.spawn(f"{role}-{name}", argv)
        for role in ("worker", "control"):
            proc = started.get(role)
            if proc is None:
                continue
            deadline = time.monotonic() + 90
            while b" ready." not in proc.logfile.read_bytes():
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"celery {role} exited with {proc.popen.returncode}\n{proc.tail()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"celery {role} not ready after 90 s\n{proc.tail()}")
                time.sleep(0.2)
        return started["worker"]

    def _fleet(self, name: str) -> list[tuple[str, list]]:
        schedule = str(self.tmp / f"celerybeat-schedule-{name}")
        if not self.isolated:
            from relay.processes import fleet

            return fleet(PY, name, schedule=schedule)
        # Each role the tree's relay.processes knows (an older release may lack one), through its command line.
        return [
            (role, [PY, "-m", "relay.processes", role, "--name", name, "--schedule", schedule, "--loglevel", "INFO"])
            for role in self.tree_roles()
        ]

    def tree_roles(self) -> list[str]:
        """The roles of `python -m relay.processes` in the tree, from its usage line (`{worker,control,…}`)."""
        done = subprocess.run(
            [PY, "-m", "relay.processes", "-h"], cwd=self.tree, env=self.tree_env(), capture_output=True, text=True
        )
        usage = done.stdout.split("{", 1)[1].split("}", 1)[0] if "{" in done.stdout else ""
        if not usage:
            raise RuntimeError(f"python -m relay.processes -h in {self.tree}: no roles\n{done.stderr[-2000:]}")
        return usage.split(",")

    def _tree_web_argv(self, bind: str) -> list[str]:
        """relay.webserver's production argv, asked of the tree's own module."""
        code = (
            "import json, sys; from relay.webserver import gunicorn_argv; "
            f"print(json.dumps(gunicorn_argv(sys.executable, {bind!r}, access_log=False)))"
        )
        done = subprocess.run([PY, "-c", code], cwd=self.tree, env=self.tree_env(), capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"relay.webserver's argv from {self.tree}:\n{done.stderr[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    logfile: Path
    out: object

    def tail(self, n: int = 3000) -> str:
        try:
            return self.logfile.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.popen
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        # Children that outlived their leader (e.g. a pool process) share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        if p.stdout is not None:
            p.stdout.close()
        self.out.close()


@dataclass
class Upstream:
    url: str
    proc: Proc

    def configure(self, delay_ms: float) -> None:
        import requests

        requests.post(f"{self.url}/_bench/config", json={"delay_ms": delay_ms}, timeout=10).raise_for_status()

    def reset_stats(self) -> None:
        import requests

        requests.post(f"{self.url}/_bench/reset", json={}, timeout=10).raise_for_status()

    def stats(self) -> dict:
        import requests

        return requests.get(f"{self.url}/_bench/stats", timeout=10).json()


@dataclass
class Web:
    url: str
    proc: Proc

    def wait_ready(self, timeout: float = 90) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.popen.poll() is not None:
                raise RuntimeError(f"gunicorn exited with {self.proc.popen.returncode}\n{self.proc.tail()}")
            with contextlib.suppress(requests.RequestException):
                if (
                    requests.get(f"{self.url}/healthz", timeout=5).status_code == 200
                    and len(self.worker_pids()) >= 2
                    and self._workers_settled()
                ):
                    return
            time.sleep(0.2)
        raise RuntimeError(f"gunicorn not healthy after {timeout:.0f} s\n{self.proc.tail()}")

    def worker_pids(self) -> list[int]:
        return children_of(self.proc.popen.pid)

    def _workers_settled(self) -> bool:
        """No worker is still loading the app (relay.webserver.warm_up): /healthz answers as soon as one
        worker is up, and the other's ~2 s of CPU loading it would land in the first figure."""
        pids = self.worker_pids()
        before = [cpu_seconds(pid) or 0.0 for pid in pids]
        time.sleep(0.5)
        return all((cpu_seconds(pid) or 0.0) - cpu < 0.02 for pid, cpu in zip(pids, before, strict=True))


@contextlib.contextmanager
def profiled(web: "Web", label: str, pids=None, idle: bool = False):
    """With BENCH_PYSPY=<dir>: py-spy records every gunicorn worker (or `pids`) while the block runs (raw
    and speedscope files named after `label`); otherwise nothing. `idle`: also the samples of threads
    waiting (a socket, a lock), so the profile shows wall time, not only CPU."""
    out = os.environ.get("BENCH_PYSPY")
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if not out or not spy:
        yield
        return
    Path(out).mkdir(parents=True, exist_ok=True)
    procs = []
    for pid in web.worker_pids() if pids is None else pids:
        for fmt in ("raw", "speedscope"):
            argv = [spy, "record", "-p", str(pid), "--nonblocking", "-r", "250", "-f", fmt]
            argv += ["--idle"] if idle else []
            # BENCH_PYSPY_GIL=1: only the samples of the thread holding the GIL, the interpreter's real CPU time.
            argv += ["--gil"] if os.environ.get("BENCH_PYSPY_GIL") == "1" else []
            argv += ["-o", str(Path(out) / f"{label}-{pid}.{fmt}")]
            procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # let py-spy attach before the request starts
    try:
        yield
    finally:
        for p in procs:
            p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


# --- Postgres and Redis ------------------------------------------------------------------------------


def _admin_conn(pg_base: str):
    import psycopg2

    conn = psycopg2.connect(f"{pg_base}/postgres")
    conn.autocommit = True
    return conn


def _check_name(name: str) -> str:
    if not name.startswith("relay_bench") or not name.replace("_", "").isalnum():
        raise ValueError(f"refusing to touch database {name!r}: benchmark databases are named relay_bench*")
    return name


def drop_database(pg_base: str, name: str) -> None:
    conn = _admin_conn(pg_base)
    try:
        conn.cursor().execute(f'DROP DATABASE IF EXISTS "{_check_name(name)}" WITH (FORCE)')
    finally:
        conn.close()


def create_database(pg_base: str, name: str) -> None:
    conn = _admin_conn(pg_base)
    try:
        conn.cursor().execute(f'CREATE DATABASE "{_check_name(name)}"')
    finally:
        conn.close()


REDIS_MARKER = "relay-bench:owner"


def _redis(url: str):
    import redis

    db = url.rsplit("/", 1)[1]
    if db in ("", "0", "15"):
        raise ValueError(f"refusing to use {url}: db 0 is the app's default and 15 the test suite's")
    return redis.Redis.from_url(url)


def claim_redis(url: str) -> None:
    """Flush the benchmark's Redis db and mark it ours — unless it holds someone else's keys.

    Empty, or left over by a benchmark process that is gone: flushed and claimed. Anything else
    (a test run or another benchmark using the same db) stops the benchmark with a message, so it
    never wipes a db that another run is using."""
    client = _redis(url)
    try:
        keys = client.dbsize()
        if keys and os.environ.get("CI") == "true":
            # CI owns the machine (it runs after the session that used it has ended): what a db holds is left
            # over by an earlier run, never another run's live state.
            log(f"CI: flushing {keys} leftover keys in {url}")
        elif keys:
            owner = client.get(REDIS_MARKER)
            if owner is None or _pid_alive(int(owner)):
                raise SystemExit(
                    f"Redis {url} holds {keys} keys that are not a finished benchmark's: another run or test "
                    "suite seems to use it. Pick a free db with BENCH_REDIS_DB_LIVE / BENCH_REDIS_DB_BATCH "
                    "(the noisy drill: NOISY_REDIS_DB), or flush it yourself if you know it is stale."
                )
        client.flushdb()
        client.set(REDIS_MARKER, os.getpid())
    finally:
        client.close()


def release_redis(url: str) -> None:
    """Flush the db at the end if it is still ours (a test suite's flushdb would have removed our mark)."""
    client = _redis(url)
    try:
        owner = client.get(REDIS_MARKER)
        if owner is not None and int(owner) == os.getpid():
            client.flushdb()
        else:
            log(f"not flushing {url}: the benchmark's mark is gone (someone else flushed or uses that db)")
    finally:
        client.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --- signals and orphans ------------------------------------------------------------------------------


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


def _install_signal_handlers() -> None:
    # Also when started with SIGINT ignored (a background job of a non-interactive shell).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGHUP, _raise_exit)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM if the benchmark process dies without cleaning up."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def redis_server_pids(url: str) -> list[int]:
    """The Redis server's pid when it runs on this machine (its CPU is the whole server's, shared
    with anybody else using it)."""
    try:
        pid = int(_redis(url).info("server").get("process_id", 0))
    except Exception:
        return []
    return [pid] if pid and Path(f"/proc/{pid}").exists() else []
