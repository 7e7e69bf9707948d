"""Streamed calls: `open_stream()` and the `UpstreamStream` it hands back, read piece by piece."""

import select
import time
from collections.abc import Callable

from core.upstream_types import _CHUNK, UpstreamError, UpstreamResponse
from gateway.upstream.transport import _cap_socket_timeout, _read_whole, _send
from gateway.upstream.watch import _as_stopped, _local, _register, _stopped, _unregister, _Watch


def open_stream(
    url: str,
    headers: dict,
    body: bytes,
    *,
    deadline: float,
    cancel: Callable[[], bool] | None = None,
) -> "UpstreamStream | UpstreamResponse":
    """POST `body` to `url` for an answer read as it arrives (a streamed call): `call()`'s budget, failures
    and watchdog, up to the answer's status and headers.

    A 2xx answer comes back as an `UpstreamStream` whose body is still unread, watched (deadline, cancel)
    until its `close()`. Any other status is read whole, as `call()` reads it, and comes back as an
    `UpstreamResponse`: the caller fails over on it exactly as on a non-streamed answer, since the
    client has not seen a byte yet."""
    if time.monotonic() >= deadline:
        raise UpstreamError("timeout", "deadline passed before the upstream call")
    if cancel is not None and cancel():
        raise UpstreamError("cancelled", "cancelled before the upstream call")
    watch = _Watch(cancel, deadline)
    _local.watch = watch
    _register(watch)
    handed_over = False
    try:
        try:
            resp = _send(url, headers, body, deadline)
            if not 200 <= resp.status < 300:
                return UpstreamResponse(resp.status, dict(resp.headers), _read_whole(resp, deadline))
        except UpstreamError as exc:
            raise _as_stopped(exc, watch, deadline) from exc
        if watch.reason is not None:
            resp.close()
            raise _stopped(watch)
        handed_over = True
        return UpstreamStream(resp, watch, deadline)
    finally:
        _local.watch = None
        if not handed_over:
            _unregister(watch)


class UpstreamStream:
    """A 2xx answer whose body is read piece by piece, as the provider sends it.

    `read()` returns the next piece as it came off the socket (b"" at the end) and raises `UpstreamError`
    as `call()` does; the watchdog keeps the call's deadline and cancel callback until `close()`. Close it
    exactly once, whatever happened: the connection goes back to the pool only when the body was read to
    its end; otherwise it is closed, so the provider sees its caller leave and stops generating."""

    def __init__(self, resp, watch: _Watch, deadline: float):
        self.status = resp.status
        self.headers = dict(resp.headers)
        self._resp = resp
        self._watch = watch
        self._deadline = deadline
        self._ended = False
        self._closed = False

    def read(self) -> bytes:
        if self._closed or self._ended:
            return b""
        watch = self._watch
        if watch.reason is not None:
            raise _stopped(watch)
        if time.monotonic() >= self._deadline:
            raise UpstreamError("timeout", "upstream call exceeded its deadline")
        try:
            _cap_socket_timeout(self._resp, self._deadline)
            piece = self._resp.read1(_CHUNK)
        except Exception as exc:  # urllib3/socket errors mid-body: the connection broke (or was shut down)
            failure = UpstreamError("network", f"reading the upstream stream failed: {type(exc).__name__}: {exc}")
            raise _as_stopped(failure, watch, self._deadline) from exc
        if not piece:
            if watch.reason is not None:  # a socket shut down by the watchdog reads as an end
                raise _stopped(watch)
            self._ended = True
        return piece

    def more_waiting(self) -> bool:
        """Whether more of the body has arrived already (the socket is readable now): a reader that fell
        behind takes it in the same piece instead of one write per event. Never waits."""
        sock = getattr(getattr(self._resp, "_connection", None), "sock", None)
        if self._closed or self._ended or sock is None:
            return False
        try:
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self._ended and self._watch.reason is None:
                self._resp.release_conn()  # read to its end: the connection is reusable
            else:
                self._resp.close()
        finally:
            _unregister(self._watch)
