"""Real Celery worker processes for end-to-end batch tests (no eager mode).

A worker is started exactly as in production (`celery -A relay worker -Q
batch,default -c 8`, prefork, with the sweeper embedded via -B), against the
test database and the test Redis, with short lease/heartbeat/sweep settings
so crash recovery is observable in seconds.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from relay.processes import worker_argv

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


class Worker:
    def __init__(self, db_url: str, name: str, extra_env: dict | None = None, beat: bool = True):
        self.name = name
        self.schedule = tempfile.mkdtemp(prefix="relay-beat-")
        env = dict(os.environ, DATABASE_URL=db_url, **TEST_BATCH_ENV, **(extra_env or {}))
        beat = os.path.join(self.schedule, "beat") if beat else None
        args = worker_argv(sys.executable, name, loglevel="WARNING", beat_schedule=beat)
        args += ["--without-gossip", "--without-mingle"]
        self.log = open(os.path.join(self.schedule, "worker.log"), "w+b")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole worker (pool children included), like an OOM kill or a lost node."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.alive():
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
            except ProcessLookupError:
                pass
        self.log.close()

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")[-5000:]


def wait_for(predicate, timeout: float, interval: float = 0.2, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
