"""The web server as embedded mode runs it: it listens on 127.0.0.1 unless RELAY_BIND says
otherwise, keeps gunicorn's control socket in its own state directory, writes no query string to
its access log, and recycles a worker that grew, without dropping a request.

gunicorn is started with relay.embedded.api_argv against the test database; every wait is bounded
and every process is stopped by the test itself.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import requests

from relay import embedded
from relay.webserver import MAX_REQUESTS, MAX_REQUESTS_JITTER, gunicorn_argv
from tests.workers import ROOT, database_url, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _other_address() -> str | None:
    """An address of this machine that is not loopback, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent, the route picks our address
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


class Web:
    def __init__(self, argv: list[str], env: dict, port: int):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(tempfile.mkstemp(prefix="relay-web-", suffix=".log")[1])
        self.log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            argv, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

        def up():
            try:
                return requests.get(self.url + "/healthz", timeout=5).status_code == 200
            except requests.RequestException:
                return False

        try:
            wait_for(up, 60, interval=0.3, what="gunicorn to answer /healthz")
        except BaseException:
            self.stop()
            raise

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.log.close()
        self.log_path.unlink(missing_ok=True)


def _env(**extra) -> dict:
    from django.db import connection

    return dict(os.environ, DATABASE_URL=database_url(connection.settings_dict), LOG_LEVEL="INFO", **extra)


@pytest.fixture
def state_dir(monkeypatch):
    # A short path: a Unix socket's path holds at most 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="rw-", dir="/tmp"))
    monkeypatch.setattr(embedded, "STATE_DIR", path)
    yield path
    for child in path.iterdir():
        child.unlink()
    path.rmdir()


def test_embedded_listens_on_loopback_keeps_its_control_socket_and_logs_no_query_string(state_dir):
    env = _env()
    env.pop("RELAY_BIND", None)
    port = _free_port()
    argv = embedded.api_argv(env, sys.executable, port)
    assert "127.0.0.1:" + str(port) in argv
    home = Path.home() / ".gunicorn" / "gunicorn.ctl"
    home_before = home.stat().st_mtime if home.exists() else None
    web = Web(argv, env, port)
    try:
        # The control socket is in the state directory, not in the home directory.
        assert (state_dir / "gunicorn.ctl").is_socket()
        assert (home.stat().st_mtime if home.exists() else None) == home_before
        # Loopback only: another address of this machine is not answered.
        other = _other_address()
        if other is not None:
            with pytest.raises(OSError), socket.create_connection((other, port), timeout=2):
                pass
        # The access log has method, path and status, and never the query string.
        secret = "sekrit-token-value-" + "9" * 8
        assert requests.get(f"{web.url}/healthz?token={secret}&api_key={secret}", timeout=10).status_code == 200
        assert requests.get(f"{web.url}/v1/models?key={secret}", timeout=10).status_code == 401
        assert requests.get(f"{web.url}/v1/models%0Aforged?x=1", timeout=10).status_code in (401, 404)

        def logged():
            text = web.text()
            return text if '"GET /v1/models HTTP/1.1" 401' in text and "%0Aforged" in text else None

        text = wait_for(logged, 10, interval=0.2, what="the access log lines")
        assert '"GET /healthz HTTP/1.1" 200' in text, text
        assert secret not in text and "token=" not in text and "api_key" not in text, text
        assert "/v1/models%0Aforged" in text and "\nforged" not in text  # the path as it came, still encoded
    finally:
        web.stop()


def test_relay_bind_opens_the_api(state_dir):
    assert embedded.api_bind({}, 8080) == "127.0.0.1:8080"
    assert embedded.api_bind({"RELAY_BIND": "0.0.0.0"}, 8080) == "0.0.0.0:8080"
    assert embedded.api_bind({"RELAY_BIND": "::"}, 8080) == "[::]:8080"
    other = _other_address()
    if other is None:
        pytest.skip("this machine has no address besides loopback")
    env = _env(RELAY_BIND="0.0.0.0")
    port = _free_port()
    web = Web(embedded.api_argv(env, sys.executable, port), env, port)
    try:
        assert requests.get(f"http://{other}:{port}/healthz", timeout=10).status_code == 200
    finally:
        web.stop()


def test_a_worker_that_grew_is_recycled_without_dropping_requests():
    # Every worker is over a 1 MB limit after its first request: each request recycles the worker that
    # served it, and every request is still answered.
    env = _env(RELAY_WEB_MAX_RSS_MB="1")
    port = _free_port()
    web = Web(gunicorn_argv(sys.executable, f"127.0.0.1:{port}", access_log=False), env, port)
    try:
        booted_before = len(re.findall(r"Booting worker", web.text()))
        with requests.Session() as session:  # keep-alive: the stopping worker answers, then closes
            for _ in range(4):
                assert session.get(web.url + "/healthz", timeout=60).status_code == 200
        assert requests.get(web.url + "/v1/models", timeout=60).status_code == 401

        def recycled():
            text = web.text()
            return text if len(re.findall(r"Booting worker", text)) >= booted_before + 2 else None

        text = wait_for(recycled, 60, interval=0.3, what="fresh workers")
        assert "over RELAY_WEB_MAX_RSS_MB=1" in text, text[-2000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        web.stop()


def test_workers_are_recycled_after_max_requests_with_jitter():
    argv = gunicorn_argv(sys.executable, "127.0.0.1:1")
    assert argv[argv.index("--max-requests") + 1] == str(MAX_REQUESTS) and MAX_REQUESTS > 0
    assert argv[argv.index("--max-requests-jitter") + 1] == str(MAX_REQUESTS_JITTER) and MAX_REQUESTS_JITTER > 0
    assert "--no-control-socket" in argv  # compose and the tests: no socket in a shared home directory
    assert argv[argv.index("--config") + 1] == "python:relay.gunicorn_config"
