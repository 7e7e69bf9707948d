"""The one HTTP choke point: every call to a provider goes through `call()`.

Budget: an explicit connect timeout, a per-read timeout, and a total deadline
that is enforced even against an upstream that drips bytes forever.

The request runs on the caller's own thread over a keep-alive connection from a
per-process pool (one `requests.Session`, pools per host). No thread per call:
one watchdog thread per process looks at every call in flight each `_POLL`
seconds, and when a call's cancel callback says stop or its deadline passes it
shuts the call's socket down (`shutdown(SHUT_RDWR)`). The blocked read in the
caller's thread returns at once, the connection is closed (never handed back to
the pool), and only then does `call()` raise `cancelled` / `timeout`: the
provider sees the connection end, and no request outlives its caller.

`cancel` is called from the watchdog thread, so it must be cheap and
thread-safe (the batch runner's is a flag read).
"""

import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests
from django.conf import settings
from requests.adapters import HTTPAdapter
from requests.structures import CaseInsensitiveDict
from requests.utils import default_user_agent
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_CHUNK = 64 * 1024
_POLL = 0.1  # seconds between the watchdog's cancel/deadline checks


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


# --- the watchdog -------------------------------------------------------------------------------


class _Watch:
    """One call in flight: what the watchdog checks and the connection it may shut down."""

    __slots__ = ("cancel", "deadline", "reason", "conn")

    def __init__(self, cancel, deadline: float):
        self.cancel = cancel
        self.deadline = deadline
        self.reason: str | None = None  # "cancelled" | "timeout" once the watchdog stopped the call
        self.conn = None  # the urllib3 connection carrying the request, once there is one


_lock = threading.Condition()
_watches: set[_Watch] = set()
_local = threading.local()
_watchdog_pid: int | None = None


def _shutdown(watch: _Watch) -> None:
    """Called with `_lock` held. Shut the socket down; the owning thread closes it."""
    conn = watch.conn
    sock = getattr(conn, "sock", None) if conn is not None else None
    if sock is not None and getattr(conn, "_relay_watch", None) is watch:
        try:
            # socket.socket.shutdown, not SSLSocket's: that one also drops the TLS
            # object under the reading thread's feet.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:
            pass  # already closed


def _watchdog() -> None:
    while True:
        with _lock:
            while not _watches:
                _lock.wait()
            watches = list(_watches)
        now = time.monotonic()
        for watch in watches:
            reason = watch.reason
            if reason is None:
                if now >= watch.deadline:
                    reason = "timeout"
                elif watch.cancel is not None:
                    try:
                        if watch.cancel():
                            reason = "cancelled"
                    except Exception:  # a failing cancel check must not kill the watchdog
                        reason = None
            if reason is not None:
                with _lock:
                    if watch in _watches:
                        watch.reason = reason
                        # Repeated every tick until the caller unregisters: a call that was
                        # still connecting when stopped gets its socket shut on the next tick.
                        _shutdown(watch)
        nearest = min((w.deadline for w in watches), default=now + _POLL)
        time.sleep(max(0.005, min(_POLL, nearest - time.monotonic())))


def _register(watch: _Watch) -> None:
    with _lock:
        _start_watchdog()
        _watches.add(watch)
        _lock.notify()


def _start_watchdog() -> None:
    """The process's watchdog thread, at its first call (called with `_lock` held)."""
    global _watchdog_pid
    if _watchdog_pid != os.getpid():  # first call in this process (or a forked child)
        _watchdog_pid = os.getpid()
        threading.Thread(target=_watchdog, name="upstream-watchdog", daemon=True).start()


def warm() -> None:
    """What a process's first call would start: its session and its watchdog (a batch worker's warm-up)."""
    _shared_session()
    with _lock:
        _start_watchdog()


def _unregister(watch: _Watch) -> None:
    with _lock:
        _watches.discard(watch)
        conn = watch.conn
        if conn is not None and getattr(conn, "_relay_watch", None) is watch:
            conn._relay_watch = None


def _own(conn) -> None:
    """The connection is about to carry the current thread's call: let the watchdog see it."""
    watch = getattr(_local, "watch", None)
    if watch is None:
        return
    with _lock:
        conn._relay_watch = watch
        watch.conn = conn
        if watch.reason is not None:
            _shutdown(watch)


class _OneSend:
    """The request's header block and its body in one `sendall`, not two (urllib3 sends the headers at
    `endheaders()`, then the body): one system call less per call, and the provider's side reads one
    segment. (http.client joins them itself only when it is handed the body at `endheaders`.)"""

    _relay_watch = None
    _relay_held: bytes | None = None
    _relay_holding = False

    def request(self, *args, **kwargs):
        _own(self)
        try:
            return super().request(*args, **kwargs)
        finally:
            self._relay_holding = False
            held, self._relay_held = self._relay_held, None
            if held is not None:  # no body followed the headers
                super().send(held)

    def endheaders(self, *args, **kwargs):
        self._relay_holding = True
        try:
            return super().endheaders(*args, **kwargs)
        finally:
            self._relay_holding = False

    def send(self, data):
        if self._relay_holding and self._relay_held is None and isinstance(data, bytes):
            self._relay_held = data  # the header block, sent with the first piece of the body
            return
        held, self._relay_held = self._relay_held, None
        if held is not None:
            if isinstance(data, bytes | bytearray):
                data = held + data
            else:
                super().send(held)
        super().send(data)


class _WatchedHTTPConnection(_OneSend, HTTPConnection):
    pass


class _WatchedHTTPSConnection(_OneSend, HTTPSConnection):
    pass


class _HTTPPool(HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _HTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


class _Adapter(HTTPAdapter):
    def init_poolmanager(self, *args, **kwargs):
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = {"http": _HTTPPool, "https": _HTTPSPool}


# --- the session --------------------------------------------------------------------------------

_session_lock = threading.Lock()
_session: requests.Session | None = None
_session_pid: int | None = None


def _shared_session() -> requests.Session:
    """One keep-alive session per process (a forked child gets its own: sockets are not shared)."""
    global _session, _session_pid
    with _session_lock:
        if _session is None or _session_pid != os.getpid():
            s = requests.Session()
            # Proxy variables in the worker's environment must not reroute provider traffic.
            s.trust_env = False
            s.mount("http://", _Adapter(pool_connections=16, pool_maxsize=64, max_retries=0))
            s.mount("https://", _Adapter(pool_connections=16, pool_maxsize=64, max_retries=0))
            _session, _session_pid = s, os.getpid()
        return _session


def call(
    url: str,
    headers: dict,
    body: bytes,
    *,
    deadline: float,
    cancel: Callable[[], bool] | None = None,
) -> UpstreamResponse:
    """POST `body` to `url`; `deadline` is a time.monotonic() value.

    Returns or raises only once the call's connection is back in the pool (a whole
    answer was read) or closed (anything else)."""
    if time.monotonic() >= deadline:
        raise UpstreamError("timeout", "deadline passed before the upstream call")
    if cancel is not None and cancel():
        raise UpstreamError("cancelled", "cancelled before the upstream call")
    watch = _Watch(cancel, deadline)
    _local.watch = watch
    _register(watch)
    try:
        try:
            resp = _do_post(url, headers, body, deadline)
        except UpstreamError as exc:
            if watch.reason is not None:
                raise _stopped(watch) from exc
            if exc.kind == "network" and time.monotonic() >= deadline - 0.05:
                # A socket timeout capped at the time left: the deadline, seen first by the socket.
                raise UpstreamError("timeout", "upstream call exceeded its deadline") from exc
            raise
        if watch.reason is not None:
            # The answer completed while the watchdog stopped the call: the stop wins.
            raise _stopped(watch)
        return resp
    finally:
        _local.watch = None
        _unregister(watch)


def _stopped(watch: _Watch) -> UpstreamError:
    if watch.reason == "timeout":
        return UpstreamError("timeout", "upstream call exceeded its deadline")
    return UpstreamError("cancelled", "cancelled while waiting for the upstream")


# Sent with every call. `identity`: the answer is read as raw bytes and passed on as it came,
# so it must not come compressed (requests' default would have asked for gzip).
_BASE_HEADERS = {"User-Agent": default_user_agent(), "Accept-Encoding": "identity", "Connection": "keep-alive"}
_NO_PROXIES: dict = {}
_prepared_urls: dict[str, str] = {}  # an upstream URL -> requests' prepared (quoted, IDNA) form


def _prepare(url: str, headers: dict, body: bytes) -> requests.PreparedRequest:
    """The request as requests' own `Session.request` would prepare it for this call, without its
    per-call merging of session settings, cookies, proxies from the environment and hooks (about a
    third of the relay's CPU per call in a profile): the session has none of them. The URL is
    prepared once per distinct URL."""
    req = requests.PreparedRequest()
    prepared_url = _prepared_urls.get(url)
    if prepared_url is None:
        req.prepare_url(url, None)
        if len(_prepared_urls) < 4096:  # operator-configured hosts x a handful of paths
            _prepared_urls[url] = req.url
    else:
        req.url = prepared_url
    req.method = "POST"
    req.headers = CaseInsensitiveDict(_BASE_HEADERS)
    req.headers.update(headers)
    req.headers["Content-Length"] = str(len(body))
    req.body = body
    return req


def _do_post(url: str, headers: dict, body: bytes, deadline: float) -> UpstreamResponse:
    read_timeout = min(settings.RELAY_UPSTREAM_READ_TIMEOUT, max(0.01, deadline - time.monotonic()))
    try:
        session = _shared_session()
        resp = session.get_adapter(url).send(
            _prepare(url, headers, body),
            stream=True,
            timeout=(settings.RELAY_UPSTREAM_CONNECT_TIMEOUT, read_timeout),
            verify=session.verify,
            cert=session.cert,
            proxies=_NO_PROXIES,
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
    except requests.exceptions.RequestException as exc:
        raise UpstreamError("network", f"{type(exc).__name__}: {exc}") from exc
    complete = False
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
        complete = True
    except UpstreamError:
        raise
    except Exception as exc:  # urllib3/socket errors mid-body: the connection broke
        raise UpstreamError("network", f"reading the upstream answer failed: {type(exc).__name__}: {exc}") from exc
    finally:
        watch = getattr(_local, "watch", None)
        if complete and (watch is None or watch.reason is None):
            # The whole answer was read: the connection goes back to the pool (keep-alive).
            resp.raw.release_conn()
        else:
            # Anything else (stopped, broken, too large): close it, never reuse it.
            resp.raw.close()
        resp.close()
    return UpstreamResponse(status=resp.status_code, headers=dict(resp.headers), body=b"".join(chunks))


def _cap_socket_timeout(resp, deadline: float) -> None:
    """Cap the next socket read at the time left, so a stalled body cannot outlive the deadline. Only
    when the time left is shorter than the socket's timeout already is: `settimeout` is a system call
    (fcntl), and the call's start set it to min(read timeout, time left) already."""
    conn = getattr(resp.raw, "_connection", None)
    sock = getattr(conn, "sock", None)
    if isinstance(sock, socket.socket):
        left = max(0.01, deadline - time.monotonic())
        current = sock.gettimeout()
        if current is None or left < current:
            sock.settimeout(min(settings.RELAY_UPSTREAM_READ_TIMEOUT, left))


def _is_connect_failure(exc: Exception) -> bool:
    text = repr(exc)
    return any(
        marker in text
        for marker in ("NewConnectionError", "NameResolutionError", "Failed to establish", "ConnectTimeout", "SSLError")
    )
