"""The one HTTP choke point: every call to a provider goes through `call()`.

Budget: an explicit connect timeout, a per-read timeout, and a total deadline
that is enforced even against an upstream that drips bytes forever. The
request runs on a short-lived thread while the caller waits on a condition
with the deadline, polling a cancel callback; on deadline or cancel the caller
returns at once and the abandoned thread ends by its own socket timeouts (each
read is capped at the time that was left), closing its connection.
"""

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests
from django.conf import settings
from requests.adapters import HTTPAdapter

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_CHUNK = 64 * 1024
_POLL = 0.25  # seconds between cancel checks while waiting


@dataclass
class UpstreamResponse:
    status: int
    headers: dict = field(default_factory=dict)
    body: bytes = b""


class UpstreamError(Exception):
    """No usable HTTP answer. `kind` drives breaker and failover decisions:

    - unreachable: connect/DNS/TLS failure — never trips a key breaker;
    - network: the connection broke after it was made;
    - timeout: the total deadline passed;
    - cancelled: the caller's cancel callback said stop;
    - too_large: the answer exceeded MAX_RESPONSE_BYTES.
    """

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
        self.message = message


_session_lock = threading.Lock()
_session: requests.Session | None = None


def _shared_session() -> requests.Session:
    global _session
    with _session_lock:
        if _session is None:
            s = requests.Session()
            # Proxy variables in the worker's environment must not reroute provider traffic.
            s.trust_env = False
            s.mount("http://", HTTPAdapter(pool_connections=16, pool_maxsize=64, max_retries=0))
            s.mount("https://", HTTPAdapter(pool_connections=16, pool_maxsize=64, max_retries=0))
            _session = s
        return _session


def call(
    url: str,
    headers: dict,
    body: bytes,
    *,
    deadline: float,
    cancel: Callable[[], bool] | None = None,
) -> UpstreamResponse:
    """POST `body` to `url`; `deadline` is a time.monotonic() value."""
    if time.monotonic() >= deadline:
        raise UpstreamError("timeout", "deadline passed before the upstream call")
    done = threading.Event()
    box: dict = {}

    def run():
        try:
            box["resp"] = _do_post(url, headers, body, deadline)
        except BaseException as exc:  # handed to the waiting caller
            box["exc"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name="upstream-call", daemon=True).start()
    while not done.wait(min(_POLL, max(0.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            raise UpstreamError("timeout", "upstream call exceeded its deadline")
        if cancel is not None and cancel():
            raise UpstreamError("cancelled", "cancelled while waiting for the upstream")
    if "exc" in box:
        raise box["exc"]
    return box["resp"]


def _do_post(url: str, headers: dict, body: bytes, deadline: float) -> UpstreamResponse:
    read_timeout = min(settings.RELAY_UPSTREAM_READ_TIMEOUT, max(0.01, deadline - time.monotonic()))
    try:
        resp = _shared_session().post(
            url,
            data=body,
            headers=headers,
            timeout=(settings.RELAY_UPSTREAM_CONNECT_TIMEOUT, read_timeout),
            stream=True,
            allow_redirects=False,
        )
    except requests.exceptions.ConnectTimeout as exc:
        raise UpstreamError("unreachable", f"connect timeout: {exc}") from exc
    except requests.exceptions.ConnectionError as exc:
        # requests reports refused/DNS failures and mid-response resets alike;
        # a failure to establish the connection is "unreachable".
        kind = "unreachable" if _is_connect_failure(exc) else "network"
        raise UpstreamError(kind, f"{type(exc).__name__}: {exc}") from exc
    except requests.exceptions.Timeout as exc:
        raise UpstreamError("network", f"read timeout: {exc}") from exc
    try:
        chunks, size = [], 0
        while True:
            if time.monotonic() >= deadline:
                raise UpstreamError("timeout", "upstream call exceeded its deadline")
            _cap_socket_timeout(resp, deadline)
            chunk = resp.raw.read1(_CHUNK) if hasattr(resp.raw, "read1") else resp.raw.read(_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if size > MAX_RESPONSE_BYTES:
                raise UpstreamError("too_large", f"upstream answer exceeds {MAX_RESPONSE_BYTES} bytes")
            chunks.append(chunk)
    except UpstreamError:
        raise
    except Exception as exc:  # urllib3/socket errors mid-body: the connection broke
        raise UpstreamError("network", f"reading the upstream answer failed: {type(exc).__name__}: {exc}") from exc
    finally:
        resp.close()
    return UpstreamResponse(status=resp.status_code, headers=dict(resp.headers), body=b"".join(chunks))


def _cap_socket_timeout(resp, deadline: float) -> None:
    """Cap the next socket read at the time left, so a stalled body cannot outlive the deadline."""
    conn = getattr(resp.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        sock.settimeout(min(settings.RELAY_UPSTREAM_READ_TIMEOUT, max(0.01, deadline - time.monotonic())))


def _is_connect_failure(exc: Exception) -> bool:
    text = repr(exc)
    return any(
        marker in text
        for marker in ("NewConnectionError", "NameResolutionError", "Failed to establish", "ConnectTimeout", "SSLError")
    )
