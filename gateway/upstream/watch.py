"""The watchdog: one thread per process looks at every call in flight and shuts down the socket of a call
whose deadline passed or whose cancel callback says stop (see the package docstring)."""

import math
import os
import socket
import threading
import time

from core.upstream_types import UpstreamError

_POLL = 0.1  # seconds between the watchdog's looks while a stopped call has not ended yet
_CANCEL_POLL = 1.0  # seconds between looks at cancel callbacks nobody `poke`s


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
_wake_at = 0.0  # when the watchdog looks next (time.monotonic(); inf: when a call is registered)
_poked = False
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
    global _poked, _wake_at
    while True:
        with _lock:
            while not _watches:
                _wake_at = math.inf
                _lock.wait()
            watches = list(_watches)
            _poked = False
        now = time.monotonic()
        stopping = False
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
                        stopping = True
                        # Repeated every tick until the caller unregisters: a call that was
                        # still connecting when stopped gets its socket shut on the next tick.
                        _shutdown(watch)
        with _lock:
            # Next look: at the nearest deadline; every _POLL while a stopped call has not ended; every
            # _CANCEL_POLL while a call has a cancel callback (at once when `poke`d). Registering a call
            # with an earlier deadline wakes it. Was every _POLL while any call was in flight: about one
            # wake-up per batch item at 100 ms upstream latency.
            poll = _POLL if stopping else _CANCEL_POLL if any(w.cancel is not None for w in _watches) else math.inf
            _wake_at = min(min((w.deadline for w in _watches), default=math.inf), time.monotonic() + poll)
            if not _poked and _watches:
                _lock.wait(max(0.005, _wake_at - time.monotonic()) if _wake_at < math.inf else None)


def poke() -> None:
    """A call's cancel callback may say stop now: the watchdog looks at once, not at its next poll (the
    batch runner's heartbeat calls this when it finds its item cancelled or its lease lost)."""
    global _poked
    with _lock:
        _poked = True
        _lock.notify()


def _register(watch: _Watch) -> None:
    with _lock:
        _start_watchdog()
        _watches.add(watch)
        due = watch.deadline if watch.cancel is None else min(watch.deadline, time.monotonic() + _CANCEL_POLL)
        if due < _wake_at:  # sooner than the watchdog's next look (or it waits for a call)
            _lock.notify()


def _start_watchdog() -> None:
    """The process's watchdog thread, at its first call (called with `_lock` held)."""
    global _watchdog_pid
    if _watchdog_pid != os.getpid():  # first call in this process (or a forked child)
        _watchdog_pid = os.getpid()
        threading.Thread(target=_watchdog, name="upstream-watchdog", daemon=True).start()


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


def _as_stopped(exc: UpstreamError, watch: _Watch, deadline: float) -> UpstreamError:
    """A failure as the caller should see it: the watchdog's stop when it stopped the call (shutting the
    socket down is what made the read fail), the deadline when a socket timeout capped at the time left
    fired first, else the failure itself."""
    if watch.reason is not None:
        return _stopped(watch)
    if exc.kind == "network" and time.monotonic() >= deadline - 0.05:
        return UpstreamError("timeout", "upstream call exceeded its deadline")
    return exc


def _stopped(watch: _Watch) -> UpstreamError:
    if watch.reason == "timeout":
        return UpstreamError("timeout", "upstream call exceeded its deadline")
    return UpstreamError("cancelled", "cancelled while waiting for the upstream")
