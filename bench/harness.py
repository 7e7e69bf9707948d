"""Shared plumbing of the benchmarks: a dedicated database and Redis db, the real processes
(gunicorn, Celery, the fake upstream) started as in production, memory sampling, statistics.

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
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from relay.processes import fleet

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
MiB = 1024 * 1024

# The production web command (Dockerfile / compose.yaml), bound to a socket we opened ourselves.
GUNICORN_ARGS = ["--workers", "2", "--threads", "8", "--timeout", "120"]


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
        """Drop and create the database, flush the Redis db, migrate (in this process)."""
        claim_redis(self.redis_url)
        self.redis_claimed = True
        drop_database(self.pg_base, self.db_name)
        create_database(self.pg_base, self.db_name)
        import django
        from django.core.management import call_command

        django.setup()
        call_command("migrate", "--noinput", verbosity=0)

    # --- processes ---

    def spawn(self, name: str, args: list, *, pass_fds=(), stdout=None, env: dict | None = None) -> "Proc":
        """`env`: the child's whole environment (default: ours plus the app's settings)."""
        logfile = self.tmp / f"{name}.log"
        out = open(logfile, "wb")  # noqa: SIM115 - closed in Proc.stop()
        popen = subprocess.Popen(
            args,
            env=env if env is not None else {**os.environ, **self.app_env()},
            cwd=ROOT,
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

    def start_web(self) -> "Web":
        """gunicorn as in production, on a socket bound to port 0 here and handed over (no port race)."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen(512)
        port = sock.getsockname()[1]
        fd = sock.fileno()
        proc = self.spawn(
            "web", [PY, "-m", "gunicorn", "relay.wsgi", "-b", f"fd://{fd}", *GUNICORN_ARGS], pass_fds=(fd,)
        )
        sock.close()
        web = Web(f"http://127.0.0.1:{port}", proc)
        web.wait_ready()
        return web

    def start_worker(self, name: str = "bench", beat: bool = True) -> "Proc":
        """An item worker as in production (relay.processes: 8 slots, threads of one process, on queue `batch`). With
        `beat` (the first of a fleet) also the control worker and beat, as compose.yaml declares them
        once per deployment. Returns the item worker."""
        started = {}
        for role, argv in fleet(PY, name, schedule=str(self.tmp / "celerybeat-schedule")):
            if role == "worker" or beat:
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
        before = [_cpu_s(pid) or 0.0 for pid in pids]
        time.sleep(0.5)
        return all((_cpu_s(pid) or 0.0) - cpu < 0.02 for pid, cpu in zip(pids, before, strict=True))


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


_ppid_cache: dict = {"at": 0.0, "map": {}}
_ppid_lock = threading.Lock()


def _ppid_map(max_age: float = 0.25) -> dict[int, int]:
    """pid -> parent pid of every process, from one pass over /proc (reused for `max_age` seconds)."""
    with _ppid_lock:
        if time.monotonic() - _ppid_cache["at"] < max_age:
            return _ppid_cache["map"]
        out = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            # pid (comm) state ppid …; comm may contain spaces, so split after the last ')'.
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        _ppid_cache.update(at=time.monotonic(), map=out)
        return out


def children_of(pid: int) -> list[int]:
    return sorted(p for p, parent in _ppid_map(max_age=0).items() if parent == pid)


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
        if keys:
            owner = client.get(REDIS_MARKER)
            if owner is None or _pid_alive(int(owner)):
                raise SystemExit(
                    f"Redis {url} holds {keys} keys that are not a finished benchmark's: another run or test "
                    "suite seems to use it. Pick a free db with BENCH_REDIS_DB_LIVE / BENCH_REDIS_DB_BATCH "
                    "(or flush it yourself if you know it is stale)."
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


# --- the catalog -----------------------------------------------------------------------------------


UPSTREAM_KEY = "bench-upstream-key"
MODEL = "gpt-4o"
UPSTREAM_MODEL = "gpt-4o-2024-08-06"
# The rate-limited provider: its own host and model, two keys the fake upstream limits per key.
RL_MODEL = "gpt-4o-rl"
RL_KEYS = ("sk-bench-rl-a", "sk-bench-rl-b")


def seed_catalog(upstream_url: str) -> str:
    """One team/project/service account, the openai host on the fake upstream, a priced binding,
    one host key, and a policy with a rate limit on every meter, set far above what a run can
    spend (so it is evaluated on every call but never trips). Returns the relay key (plaintext)."""
    from policies.models import Policy, PolicyHostKey, RateLimit, RateLimitRule
    from relay.models import Host, HostBinding, HostKey, LLMModel, Pricing, Project, ServiceAccount, Team
    from relay.services import create_relay_key

    team = Team.objects.create(name="bench")
    project = Project.objects.create(name="bench", team=team)
    sa = ServiceAccount.objects.create(project=project, name="bench")
    host = Host.objects.create(name="openai", base_url=upstream_url)
    price = Pricing.objects.create(
        name="gpt-4o",
        input_nanos_per_mtok=2_500_000_000,
        output_nanos_per_mtok=10_000_000_000,
        cache_read_nanos_per_mtok=1_250_000_000,
    )
    model = LLMModel.objects.create(name=MODEL, provider="openai")
    HostBinding.objects.create(model=model, host=host, adapter="openai", upstream_name=UPSTREAM_MODEL, pricing=price)
    key = HostKey(name="openai-bench", host=host)
    key.set_value(UPSTREAM_KEY)
    key.save()
    rl = RateLimit.objects.create(name="bench-inbound")
    for meter, amount, window, strategy in (
        ("requests", 1_000_000_000, 60, "sliding-window"),
        ("tokens", 1_000_000_000_000, 60, "sliding-window"),
        ("concurrency", 100_000, 60, "fixed-window"),
    ):
        RateLimitRule.objects.create(
            rate_limit=rl, meter=meter, amount=amount, window_seconds=window, strategy=strategy
        )
    policy = Policy.objects.create(name="bench", project=project, grants=["*"], rate_limit=rl)
    PolicyHostKey.objects.create(policy=policy, host_key=key, position=0)
    # The rate-limited provider (bench/fake_upstream.py limits keys named sk-bench-rl-*).
    rl_host = Host.objects.create(name="openai-rl", base_url=upstream_url)
    rl_model = LLMModel.objects.create(name=RL_MODEL, provider="openai")
    HostBinding.objects.create(
        model=rl_model, host=rl_host, adapter="openai", upstream_name=UPSTREAM_MODEL, pricing=price
    )
    for i, value in enumerate(RL_KEYS):
        rl_key = HostKey(name=f"openai-rl-{i}", host=rl_host)
        rl_key.set_value(value)
        rl_key.save()
        PolicyHostKey.objects.create(policy=policy, host_key=rl_key, position=1 + i)
    sa.policy = policy
    sa.save()
    _, plaintext = create_relay_key(service_account=sa, name="bench")
    return plaintext


# --- request bodies --------------------------------------------------------------------------------

_WORDS = (
    "summarise the following support ticket in two sentences and list any product names mentioned "
    "the customer reports that the export job stalls after the nightly sync and asks for a workaround"
).split()


def chat_body(i: int, size: int = 0) -> dict:
    """A realistic chat request; with `size`, padded so its compact JSON is about `size` bytes."""
    body = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. Answer briefly."},
            {"role": "user", "content": f"Ticket {i}: "},
        ],
        "max_tokens": 256,
        "temperature": 0.2,
    }
    if size:
        missing = size - len(json.dumps(body, separators=(",", ":")))
        words, n, k = [], 0, i
        while n < missing:
            w = _WORDS[k % len(_WORDS)]
            words.append(w)
            n += len(w) + 1
            k += 1
        body["messages"][1]["content"] += " ".join(words)[: max(0, missing)]
    return body


# --- memory ----------------------------------------------------------------------------------------


def _status_kib(pid: int, field_name: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    return 0


class MemWatch:
    """Peak RSS of some processes over a window: VmHWM after resetting it (clear_refs 5), plus
    VmRSS polled every 10 ms as a cross-check (and as the only source if the reset is refused)."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self.baseline = {pid: _status_kib(pid, "VmRSS") for pid in self.pids}
        self.polled = dict(self.baseline)
        self.hwm_reset = True
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/clear_refs", "w") as fh:
                    fh.write("5")
            except OSError:
                self.hwm_reset = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> "MemWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = {}
        for pid in self.pids:
            hwm = _status_kib(pid, "VmHWM") if self.hwm_reset else 0
            self.peak[pid] = max(hwm, self.polled[pid])

    def _poll(self) -> None:
        while not self._stop.wait(0.01):
            for pid in self.pids:
                with contextlib.suppress(OSError):
                    self.polled[pid] = max(self.polled[pid], _status_kib(pid, "VmRSS"))

    def summary(self) -> dict:
        """The worker that grew most is the one that served the request."""
        pid = max(self.pids, key=lambda p: self.peak[p] - self.baseline[p])
        return {
            "pid": pid,
            "baseline_mib": self.baseline[pid] / 1024,
            "peak_mib": self.peak[pid] / 1024,
            "growth_mib": (self.peak[pid] - self.baseline[pid]) / 1024,
            "baseline_all_mib": [self.baseline[p] / 1024 for p in self.pids],
            "source": "VmHWM (reset) + VmRSS poll" if self.hwm_reset else "VmRSS poll every 10 ms",
        }


def fmt_mem(m: dict) -> str:
    return f"peak {m['peak_mib']:.1f} MiB RSS (baseline {m['baseline_mib']:.1f} MiB, +{m['growth_mib']:.1f} MiB)"


# --- CPU -------------------------------------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants."""
    kids: dict[int, list[int]] = {}
    for p, parent in _ppid_map().items():
        kids.setdefault(parent, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime + stime


def _machine_ticks() -> tuple[int, int, int]:
    with open("/proc/stat") as fh:
        v = [int(x) for x in fh.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal …
    return v[0] + v[1] + v[2] + v[5] + v[6], v[7], sum(v[:8])


class CpuWatch:
    """CPU seconds used by groups of processes over a window, and how busy the whole machine was.

    `groups` maps a label to a function returning the pids of that group now. Processes come and go
    (PostgreSQL backends are recycled with CONN_MAX_AGE), so every group is sampled every second: a
    process counts from its value at the start (or from zero if it appeared later) to the last value
    seen, which loses at most the last second of a process that ended inside the window."""

    def __init__(self, groups: dict, interval: float = 1.0):
        self.groups = groups
        self.interval = interval
        self._first: dict = {name: {} for name in groups}
        self._last: dict = {name: {} for name in groups}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _sample(self, initial: bool) -> None:
        for name, fn in self.groups.items():
            for p in fn():
                value = _cpu_s(p)
                if value is None:
                    continue
                self._first[name].setdefault(p, value if initial else 0.0)
                self._last[name][p] = value

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(Exception):
                self._sample(False)

    def __enter__(self) -> "CpuWatch":
        self.t0 = time.monotonic()
        self.m0 = _machine_ticks()
        self._sample(True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample(False)
        self.elapsed = time.monotonic() - self.t0
        m1 = _machine_ticks()
        self.used = {
            name: sum(self._last[name][p] - self._first[name][p] for p in self._last[name]) for name in self.groups
        }
        self.machine_busy = (m1[0] - self.m0[0]) / _TICK / self.elapsed  # cores
        self.machine_steal = (m1[1] - self.m0[1]) / _TICK / self.elapsed

    def per_unit_ms(self, units: int) -> dict:
        return {name: used * 1000 / max(1, units) for name, used in self.used.items()}

    def describe(self, units: int, unit: str) -> str:
        parts = ", ".join(f"{name} {ms:.2f}" for name, ms in self.per_unit_ms(units).items())
        ours = sum(self.used.values()) / self.elapsed
        return (
            f"CPU ms per {unit}: {parts}; these processes used {ours:.2f} cores, the whole machine was "
            f"{self.machine_busy:.2f} of {os.cpu_count()} cores busy (steal {self.machine_steal:.2f})"
        )


_pg_local = threading.local()


def pg_backends(db_name: str) -> list[int]:
    """PIDs of the PostgreSQL backends connected to our database, read through a connection of our
    own to the `postgres` database (so the observer is not one of the observed)."""
    import psycopg2

    conn = getattr(_pg_local, "conn", None)
    if conn is None or conn.closed:
        conn = _pg_local.conn = psycopg2.connect(
            f"{os.environ.get('BENCH_PG_URL', 'postgres://postgres:postgres@127.0.0.1:5432').rstrip('/')}/postgres"
        )
        conn.autocommit = True
    with conn.cursor() as cur:
        cur.execute("SELECT pid FROM pg_stat_activity WHERE datname = %s", [db_name])
        return [row[0] for row in cur.fetchall()]


# --- statistics and output ---------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (q in 0..100)."""
    s = sorted(values)
    if not s:
        return float("nan")
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = []
    for n, r in enumerate(cells):
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
        lines.append("  ".join(padded))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def machine() -> str:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = _meminfo_gib()
    return f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {os.uname().release}"


def _meminfo_gib() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 1024 / 1024
    return 0.0


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


def load() -> str:
    """The machine's load as `uptime` prints it (1, 5, 15 min), with the number of cores."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} on {os.cpu_count()} cores"
