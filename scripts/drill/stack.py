"""The drill's processes, host by host: PostgreSQL, Redis and the fake provider on the database host (where
this orchestrator runs too), and on each app host the web server, the item worker, the control worker
(and beat on the first), started as production starts them (relay.webserver, relay.processes).

Every process is a child of this one, in its own process group, inside a namespace scripts/drill.sh made;
stopping one signals its group. scripts/drill.sh kills whatever is left in its namespaces on any exit."""

import logging
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis
import requests

from drill import topology as t

log = logging.getLogger(__name__)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    logfile: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)  # its own group: start_new_session
        except ProcessLookupError:
            pass

    def stop(self, grace: float = 10.0) -> None:
        if self.alive():
            self.signal_group(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.popen.wait(10)
        # A group's forks (gunicorn's and prefork's children) may outlive their parent for a moment.
        self.signal_group(signal.SIGKILL)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.logfile.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def spawn(name: str, argv: list[str], logdir: Path, env: dict | None = None) -> Proc:
    logdir.mkdir(parents=True, exist_ok=True)
    logfile = logdir / f"{name}.log"
    with open(logfile, "ab") as out:
        popen = subprocess.Popen(
            argv,
            env=env if env is not None else os.environ.copy(),
            cwd=t.ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Proc(name, popen, logfile)


def wait_for(what: str, check, timeout: float = 60.0, every: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
        except Exception:
            result = None
        if result:
            return result
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not ready after {timeout:.0f} s")
        time.sleep(every)


def as_postgres(*argv: str) -> list[str]:
    """PostgreSQL refuses to run as root: exec as the `postgres` user (setpriv execs; su and runuser fork)."""
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--", *argv]


class DatabaseHost:
    """PostgreSQL (initdb into the drill's temporary directory), Redis with its AOF, and the fake provider."""

    def __init__(self, topo: t.Topology, delay_ms: float):
        self.topo = topo
        self.delay_ms = delay_ms
        self.dir = topo.tmp / "db"
        self.pgdata = self.dir / "pg" / "data"
        self.pgsock = self.dir / "pg" / "sock"
        self.redis_dir = self.dir / "redis"
        self.postgres: Proc | None = None
        self.redis: Proc | None = None
        self.upstream: Proc | None = None
        self.pgbouncer: Proc | None = None

    # --- PostgreSQL ---

    def init_postgres(self) -> None:
        (self.dir / "pg").mkdir(parents=True, exist_ok=True)
        self.pgsock.mkdir(parents=True, exist_ok=True)
        os.chmod(self.dir, 0o755)
        subprocess.run(["chown", "-R", "postgres:postgres", str(self.dir / "pg")], check=True)
        bin_ = self.topo.pgbin
        subprocess.run(
            as_postgres(
                f"{bin_}/initdb",
                "-D",
                str(self.pgdata),
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--locale=C",
                "--auth-local=trust",
                "--auth-host=scram-sha-256",
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        with open(self.pgdata / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {t.DB_IP.rsplit('.', 1)[0]}.0/24 scram-sha-256\n")
        self.start_postgres()
        for sql in (
            f"CREATE ROLE {t.DB_USER} LOGIN CREATEDB PASSWORD '{t.DB_PASSWORD}'",
            f"CREATE DATABASE {t.DB_NAME} OWNER {t.DB_USER}",
        ):
            subprocess.run(
                as_postgres(f"{bin_}/psql", "-h", str(self.pgsock), "-U", "postgres", "-qAtc", sql),
                check=True,
                stdout=subprocess.DEVNULL,
            )

    def start_postgres(self) -> None:
        self.postgres = spawn(
            "postgres",
            as_postgres(
                f"{self.topo.pgbin}/postgres",
                "-D",
                str(self.pgdata),
                "-p",
                str(t.PG_PORT),
                "-c",
                f"listen_addresses={t.DB_IP}",
                "-c",
                f"unix_socket_directories={self.pgsock}",
                "-c",
                "max_connections=200",
                "-c",
                "shared_buffers=64MB",
            ),
            self.dir,
        )
        wait_for(
            "postgres",
            lambda: (
                subprocess.run(
                    [f"{self.topo.pgbin}/pg_isready", "-q", "-h", t.DB_IP, "-p", str(t.PG_PORT)], check=False
                ).returncode
                == 0
            ),
        )

    def stop_postgres(self) -> None:
        """A fast shutdown (SIGINT): sessions are cut, the data is checkpointed."""
        if self.postgres is not None and self.postgres.alive():
            self.postgres.popen.send_signal(signal.SIGINT)
            self.postgres.popen.wait(60)

    # --- PgBouncer (DRILL_POOLER=pgbouncer) ---

    def start_pgbouncer(self) -> None:
        """PgBouncer in transaction mode in front of this PostgreSQL, as `postgres` (it refuses root). After a
        failed server login (PostgreSQL restarting) it waits server_login_retry before the next: 2 s here,
        not its default 15 s, which the postgres_restart scenario would otherwise add to its recovery."""
        conf_dir = self.dir / "pgbouncer"
        conf_dir.mkdir(parents=True, exist_ok=True)
        (conf_dir / "userlist.txt").write_text(f'"{t.DB_USER}" "{t.DB_PASSWORD}"\n')
        (conf_dir / "pgbouncer.ini").write_text(
            f"""[databases]
{t.DB_NAME} = host={t.DB_IP} port={t.PG_PORT} dbname={t.DB_NAME}
[pgbouncer]
listen_addr = {t.DB_IP}
listen_port = {t.PGBOUNCER_PORT}
unix_socket_dir = {conf_dir}
auth_type = scram-sha-256
auth_file = {conf_dir}/userlist.txt
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 40
server_reset_query =
server_login_retry = 2
ignore_startup_parameters = extra_float_digits
"""
        )
        subprocess.run(["chown", "-R", "postgres:postgres", str(conf_dir)], check=True)
        self.pgbouncer = spawn("pgbouncer", as_postgres("pgbouncer", str(conf_dir / "pgbouncer.ini")), self.dir)
        wait_for(
            "pgbouncer",
            lambda: (
                subprocess.run(
                    [f"{self.topo.pgbin}/pg_isready", "-q", "-h", t.DB_IP, "-p", str(t.PGBOUNCER_PORT)], check=False
                ).returncode
                == 0
            ),
        )

    # --- Redis ---

    def start_redis(self) -> None:
        self.redis_dir.mkdir(parents=True, exist_ok=True)
        self.redis = spawn(
            "redis",
            [
                "redis-server",
                "--bind",
                t.DB_IP,
                "--port",
                str(t.REDIS_PORT),
                "--protected-mode",
                "no",
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
                "--save",
                "",
                "--dir",
                str(self.redis_dir),
                "--maxmemory-policy",
                "noeviction",
                "--daemonize",
                "no",
            ],
            self.dir,
        )
        wait_for("redis", lambda: redis.Redis(host=t.DB_IP, port=t.REDIS_PORT, socket_timeout=1).ping())

    def stop_redis(self) -> None:
        """SIGTERM: Redis fsyncs its AOF and exits; the restart replays it."""
        if self.redis is not None and self.redis.alive():
            self.redis.popen.send_signal(signal.SIGTERM)
            self.redis.popen.wait(30)

    # --- the provider ---

    def start_upstream(self) -> None:
        self.upstream = spawn(
            "upstream",
            [
                t.PY,
                "-m",
                "drill.upstream",
                "--host",
                t.DB_IP,
                "--port",
                str(t.UPSTREAM_PORT),
                "--delay-ms",
                str(self.delay_ms),
            ],
            self.dir,
            env={**t.app_env(self.topo), "PYTHONPATH": f"{t.ROOT / 'scripts'}:{t.ROOT}"},
        )
        wait_for("upstream", lambda: requests.get(f"{self.topo.upstream_url}/_drill/calls", timeout=1).ok)

    def calls(self) -> dict:
        return requests.get(f"{self.topo.upstream_url}/_drill/calls", timeout=10).json()["calls"]

    def stop(self) -> None:
        for proc in (self.upstream, self.redis, self.pgbouncer):
            if proc is not None:
                proc.stop(2.0)
        if self.postgres is not None and self.postgres.alive():
            self.postgres.popen.send_signal(signal.SIGQUIT)  # immediate: the drill's data is thrown away
            try:
                self.postgres.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.postgres.signal_group(signal.SIGKILL)


class AppProcesses:
    """One app host: web, item worker, control worker (and beat), each in the host's namespace with its
    own hostname (a UTS namespace), so lease owners and worker names say which host holds what."""

    def __init__(self, topo: t.Topology, host: t.AppHost):
        self.topo = topo
        self.host = host
        self.procs: list[Proc] = []
        self.starts = 0

    def _in_host(self, argv: list[str]) -> list[str]:
        return [
            "ip",
            "netns",
            "exec",
            self.host.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.host.name,
            *argv,
        ]

    def start(self) -> None:
        self.starts += 1
        h = self.host
        h.tmp.mkdir(parents=True, exist_ok=True)
        env = t.app_env(self.topo, h.tmp / "payloads")
        roles = [
            ("web", [t.PY, "-m", "relay.webserver", "--bind", f"{h.ip}:{t.WEB_PORT}"]),
            ("worker", [t.PY, "-m", "relay.processes", "worker", "--name", h.name]),
            ("control", [t.PY, "-m", "relay.processes", "control", "--name", h.name]),
            # The webhook lane, as compose declares it on every app host (relay.processes.fleet).
            ("webhooks", [t.PY, "-m", "relay.processes", "webhooks", "--name", h.name]),
        ]
        if h.beat:
            roles.append(
                ("beat", [t.PY, "-m", "relay.processes", "beat", "--schedule", str(h.tmp / "celerybeat-schedule")])
            )
        for role, argv in roles:
            self.procs.append(spawn(f"{role}-{self.starts}", self._in_host(argv), h.tmp, env))
        wait_for(f"{h.name} web", lambda: requests.get(f"{h.web_url}/healthz", timeout=2).ok, timeout=120)
        worker = next(p for p in self.procs if p.name.startswith("worker") and p.alive())
        r = redis.Redis.from_url(self.topo.redis_url)
        wait_for(
            f"{h.name} item worker",
            lambda: r.exists(f"relay:worker_slots:{h.name}:{worker.popen.pid}"),
            timeout=120,
        )

    def pids(self) -> list[int]:
        """Every process in the host's namespace (ip netns pids): the host, seen from outside."""
        out = subprocess.run(["ip", "netns", "pids", self.host.netns], capture_output=True, text=True, check=True)
        return [int(p) for p in out.stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process of the host at once, as a power cut would."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            proc.popen.wait(30)
        self.procs = []
        return len(pids)

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds: the drill's work is thrown away at its end."""
        for proc in reversed(self.procs):
            proc.stop(grace)
        self.procs = []

    def logs(self) -> list[Path]:
        return sorted(self.host.tmp.glob("*.log"))


def set_link(topo: t.Topology, host: t.AppHost, up: bool) -> None:
    """The host's port on the database host's bridge, down (the cut) or up."""
    subprocess.run(["ip", "-n", topo.db_netns, "link", "set", host.link, "up" if up else "down"], check=True)


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def connections_by_role(app: AppProcesses, port: int) -> dict[str, int]:
    """Established TCP connections from the host's processes to the database host's `port`, by role (web,
    worker, control, beat: a process's forks count for it), from `ss` inside the host's namespace."""
    out = subprocess.run(
        ["ip", "netns", "exec", app.host.netns, "ss", "-Htnp", "state", "established", "dst", f"{t.DB_IP}:{port}"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    roots = {p.popen.pid: p.name.split("-")[0] for p in app.procs if p.alive()}
    counts: dict[str, int] = {}
    for pid_text in re.findall(r"pid=(\d+)", out):
        pid, role = int(pid_text), None
        for _ in range(4):  # a gunicorn worker, a prefork child: up to their parent
            role = roots.get(pid)
            if role or pid <= 1:
                break
            pid = _parent(pid)
        counts[role or "other"] = counts.get(role or "other", 0) + 1
    return counts
