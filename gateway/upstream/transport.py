"""The wire: one keep-alive `requests.Session` per process, its urllib3 pools and connections (watched, so
the watchdog can shut a call's socket down), and the POST itself with its answer read within its budget."""

import os
import socket
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import requests
from django.conf import settings
from requests.adapters import HTTPAdapter
from requests.utils import default_user_agent
from urllib3 import Timeout
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import (
    ConnectTimeoutError,
    HTTPError,
    MaxRetryError,
    NewConnectionError,
    ReadTimeoutError,
    SSLError,
)

from core.upstream_types import _CHUNK, MAX_RESPONSE_BYTES, UpstreamError, UpstreamResponse
from gateway.upstream.watch import _local, _own


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
            super().request(*args, **kwargs)
        except BaseException:
            self._relay_held = None  # never half a request: the caller closes the connection
            raise
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

_POOL_MAXSIZE = 256
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
            # Idle connections kept per host: as many as a web worker has threads (relay.webserver), since
            # each may hold a stream to one provider; past it urllib3 drops connections with a warning each.
            s.mount("http://", _Adapter(pool_connections=16, pool_maxsize=_POOL_MAXSIZE, max_retries=0))
            s.mount("https://", _Adapter(pool_connections=16, pool_maxsize=_POOL_MAXSIZE, max_retries=0))
            _session, _session_pid = s, os.getpid()
        return _session


# Sent with every call. `identity`: the answer is read as raw bytes and passed on as it came,
# so it must not come compressed (requests' default would have asked for gzip).
_BASE_HEADERS = {"User-Agent": default_user_agent(), "Accept-Encoding": "identity", "Connection": "keep-alive"}
_BASE_NAMES = {name.lower(): name for name in _BASE_HEADERS}


@dataclass(frozen=True)
class _Target:
    """An upstream URL as requests prepares it (quoted, IDNA host), split for its connection pool."""

    scheme: str
    host: str
    port: int | None
    path: str  # with the query, what the request line carries


_targets: dict[str, _Target] = {}  # operator-configured hosts x a handful of paths


def _target(url: str) -> _Target:
    target = _targets.get(url)
    if target is None:
        req = requests.PreparedRequest()
        req.prepare_url(url, None)
        parsed = urlsplit(req.url)
        target = _Target(parsed.scheme.lower(), parsed.hostname, parsed.port, req.path_url)
        if len(_targets) < 4096:
            _targets[url] = target
    return target


def _pool(session: requests.Session, url: str, target: _Target):
    """The keep-alive pool for the URL's host, from the session's adapter, set up for TLS as requests'
    own `HTTPAdapter.send` sets it up (certificate verification against the session's CA bundle)."""
    adapter = session.get_adapter(url)
    pool_kwargs = {"cert_reqs": "CERT_REQUIRED" if session.verify is not False else "CERT_NONE"}
    pool = adapter.poolmanager.connection_from_host(target.host, target.port, target.scheme, pool_kwargs=pool_kwargs)
    if target.scheme == "https" and not getattr(pool, "_relay_verified", False):
        adapter.cert_verify(pool, url, session.verify, session.cert)  # once per pool: it reads the disk
        pool._relay_verified = True
    return adapter, pool


def _headers(headers: dict, length: int) -> dict:
    """The base headers, the caller's (a caller's name replaces a base one whatever its case), the length."""
    out = dict(_BASE_HEADERS)
    for name, value in headers.items():
        base = _BASE_NAMES.get(name.lower())
        if base is not None:
            del out[base]
        out[name] = value
    out["Content-Length"] = str(length)
    return out


def _do_post(url: str, headers: dict, body: bytes, deadline: float) -> UpstreamResponse:
    """The POST and its whole answer (see `_send`)."""
    resp = _send(url, headers, body, deadline)
    return UpstreamResponse(status=resp.status, headers=dict(resp.headers), body=_read_whole(resp, deadline))


def _send(url: str, headers: dict, body: bytes, deadline: float):
    """The POST through urllib3's pool under requests' adapter, up to the answer's status and headers:
    what `HTTPAdapter.send` does for it (the pool chosen by host and TLS settings, verification set up,
    no retries, no redirects, raw body), without building a requests `PreparedRequest` and `Response`
    per call (cookie jar, hooks, header dicts). Measured on this machine: adapter.send ~330 us of CPU
    per call, this ~200 us; http.client alone ~130 us. The body is left unread (`preload_content=False`)."""
    read_timeout = min(settings.RELAY_UPSTREAM_READ_TIMEOUT, max(0.01, deadline - time.monotonic()))
    try:
        target = _target(url)
        adapter, pool = _pool(_shared_session(), url, target)
        return pool.urlopen(
            "POST",
            target.path,
            body=body,
            headers=_headers(headers, len(body)),
            redirect=False,
            assert_same_host=False,
            preload_content=False,
            decode_content=False,
            retries=adapter.max_retries,
            timeout=Timeout(connect=settings.RELAY_UPSTREAM_CONNECT_TIMEOUT, read=read_timeout),
            chunked=False,
        )
    except (HTTPError, OSError, ValueError) as exc:
        raise _failure(exc) from exc


def _read_whole(resp, deadline: float) -> bytes:
    """The rest of the answer's body, within MAX_RESPONSE_BYTES and the deadline. Its connection goes back
    to the pool when the whole answer was read and the call was not stopped, and is closed otherwise."""
    complete = False
    try:
        chunks, size = [], 0
        while True:
            if time.monotonic() >= deadline:
                raise UpstreamError("timeout", "upstream call exceeded its deadline")
            _cap_socket_timeout(resp, deadline)
            chunk = resp.read1(_CHUNK)
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
            resp.release_conn()
        else:
            # Anything else (stopped, broken, too large): close it, never reuse it.
            resp.close()
    return b"".join(chunks)


def _failure(exc: Exception) -> UpstreamError:
    """urllib3's exception as the call's failure (live calls and the batch APIs alike): a connection never
    made (refused, DNS, TLS, connect timeout) is `unreachable`, which no request can cause; anything after
    the request was sent (a read timeout, a reset, a dropped connection) is `network`, which the request
    itself may have caused (a long generation). policies.breaker.RULES scores the two accordingly."""
    reason = exc.reason if isinstance(exc, MaxRetryError) and exc.reason is not None else exc
    if isinstance(reason, ConnectTimeoutError) and not isinstance(reason, NewConnectionError):
        return UpstreamError("unreachable", f"connect timeout: {exc}")
    if isinstance(reason, NewConnectionError | SSLError) or _is_connect_failure(reason):
        return UpstreamError("unreachable", f"{type(reason).__name__}: {exc}")
    if isinstance(reason, ReadTimeoutError):
        return UpstreamError("network", f"read timeout: {exc}", read_timeout=True)
    return UpstreamError("network", f"{type(reason).__name__}: {exc}")


def _cap_socket_timeout(resp, deadline: float) -> None:
    """Cap the next socket read at the time left, so a stalled body cannot outlive the deadline. Only
    when the time left is shorter than the socket's timeout already is: `settimeout` is a system call
    (fcntl), and the call's start set it to min(read timeout, time left) already."""
    conn = getattr(resp, "_connection", None)
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
