"""What of the web server's gunicorn set-up is Python rather than flags (decision 0014): the access log's
format and logger, and the check that recycles a worker that grew. relay.webserver's argv loads it
(`--config python:relay.gunicorn_config`), so embedded mode, compose and the tests all run with it.

Memory that comes back. CPython keeps much of what a process once allocated (arenas half in use,
fragmentation), so a worker that once parsed a hostile body would stay large. Two things bound it:

- what one request may make a worker build is capped where bodies are parsed
  (core.jsonguard.MAX_VALUES, per document and per batch element; bodies themselves are limited
  by RELAY_MAX_REQUEST_BYTES);
- after each request, a worker whose resident size is over RELAY_WEB_MAX_RSS_MB (default 300;
  0 turns the check off) stops taking connections, finishes the requests it has (up to the
  graceful timeout, which covers RELAY_UPSTREAM_DEADLINE) and exits; gunicorn starts a fresh one.
  No request is dropped. gunicorn's max_requests with jitter (relay.webserver) recycles every
  worker now and then as well, for growth too slow to cross the limit.

The access log keeps the client, time, method, path, status, size, duration and user agent, and
never a query string (a token sent as `?token=…` is not written down) nor the Referer (which can
hold another site's); the path is logged as it arrived, still percent-encoded, so a `%0A` cannot
start a forged line.
"""

import os
import resource
import sys

from gunicorn import glogging

access_log_format = '%(h)s %(t)s "%(m)s %(U)s %(H)s" %(s)s %(b)s %(M)sms "%(a)s"'

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def max_rss_bytes() -> int:
    """RELAY_WEB_MAX_RSS_MB in bytes (0: no limit); an unreadable value falls back to the default."""
    raw = os.environ.get("RELAY_WEB_MAX_RSS_MB", "300")
    return int(raw) * 1024 * 1024 if raw.isascii() and raw.isdigit() else 300 * 1024 * 1024


# (pid, an open descriptor of its /proc/<pid>/statm): read again with one pread per request, not an
# open, read and close (13 us a request before, 1.5 us now). A forked worker opens its own.
_statm: tuple[int, int] | None = None


def rss_bytes() -> int:
    """This process's resident size now (Linux); elsewhere its peak, which only makes a recycle sooner."""
    global _statm
    try:
        pid = os.getpid()
        if _statm is None or _statm[0] != pid:
            _statm = (pid, os.open(f"/proc/{pid}/statm", os.O_RDONLY))
        return int(os.pread(_statm[1], 128, 0).split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB elsewhere


def post_request(worker, req, environ, resp):
    limit = max_rss_bytes()
    if not limit or not worker.alive:
        return
    size = rss_bytes()
    if size > limit:
        worker.log.warning(
            "worker %s holds %d MB, over RELAY_WEB_MAX_RSS_MB=%d: it finishes its requests and a fresh worker "
            "takes over",
            os.getpid(),
            size // (1024 * 1024),
            limit // (1024 * 1024),
        )
        worker.alive = False  # what gunicorn's own max_requests does: stop accepting, drain, exit


def _without_query(target: str) -> str:
    return target.split("?", 1)[0] if target else target


class AccessLogger(glogging.Logger):
    """gunicorn's logger, whose access-log atoms hold no query string and no Referer, whatever the format."""

    def atoms(self, resp, req, environ, request_time):
        atoms = super().atoms(resp, req, environ, request_time)
        path = _without_query(environ.get("RAW_URI") or "") or "-"
        atoms["U"] = path
        atoms["q"] = "-"
        atoms["r"] = f"{environ.get('REQUEST_METHOD')} {path} {environ.get('SERVER_PROTOCOL')}"
        atoms["f"] = "-"
        atoms["u"] = "-"
        for name in [k for k in atoms if k.startswith("{")]:  # request headers, response headers, environ
            del atoms[name]
        return atoms


logger_class = AccessLogger
