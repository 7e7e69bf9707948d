"""The one HTTP choke point: every call to a provider goes through `call()`.

Budget: an explicit connect timeout, a per-read timeout, and a total deadline
that is enforced even against an upstream that drips bytes forever.

The request runs on the caller's own thread over a keep-alive connection from a
per-process pool (one `requests.Session`, pools per host). No thread per call:
one watchdog thread per process looks at every call in flight (at the nearest
deadline, at `poke()`, and each `_CANCEL_POLL` seconds for cancel callbacks),
and when a call's cancel callback says stop or its deadline passes it
shuts the call's socket down (`shutdown(SHUT_RDWR)`). The blocked read in the
caller's thread returns at once, the connection is closed (never handed back to
the pool), and only then does `call()` raise `cancelled` / `timeout`: the
provider sees the connection end, and no request outlives its caller.

`cancel` is called from the watchdog thread, so it must be cheap and
thread-safe (the batch runner's is a flag read; a live stream's polls its
client's socket for an end, gateway.streaming.client_gone).

`open_stream()` is `call()` for a streamed answer: the same budget, failures and
watchdog up to the status and headers; a 2xx comes back with its body unread
(`UpstreamStream`, watched until closed), anything else read whole, so the
pipeline fails over on it as on any answer.

The package, imports one way (each module imports only those above it):
base (UpstreamResponse, UpstreamError), watch (the watchdog), transport (the session, pools and the POST),
stream (`open_stream`), batch_api (`exchange`); `call()` and `warm()` are here.
"""

import time
from collections.abc import Callable

from core.upstream_types import MAX_RESPONSE_BYTES, UpstreamError, UpstreamResponse
from gateway.upstream.batch_api import BATCH_API_TIMEOUT, exchange
from gateway.upstream.stream import UpstreamStream, open_stream
from gateway.upstream.transport import _do_post, _shared_session
from gateway.upstream.watch import (
    _as_stopped,
    _local,
    _lock,
    _register,
    _start_watchdog,
    _stopped,
    _unregister,
    _Watch,
    poke,
)
from gateway.upstream.watch import _watches as _watches  # the calls in flight (tests look at it)

__all__ = [
    "BATCH_API_TIMEOUT",
    "MAX_RESPONSE_BYTES",
    "UpstreamError",
    "UpstreamResponse",
    "UpstreamStream",
    "call",
    "exchange",
    "open_stream",
    "poke",
    "warm",
]

# The watchdog's tunables (`_POLL`, `_CANCEL_POLL`) are read in gateway.upstream.watch: patch them there.


def warm() -> None:
    """What a process's first call would start: its session and its watchdog (a batch worker's warm-up)."""
    _shared_session()
    with _lock:
        _start_watchdog()


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
            raise _as_stopped(exc, watch, deadline) from exc
        if watch.reason is not None:
            # The answer completed while the watchdog stopped the call: the stop wins.
            raise _stopped(watch)
        return resp
    finally:
        _local.watch = None
        _unregister(watch)
