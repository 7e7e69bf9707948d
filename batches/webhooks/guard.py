"""Where a webhook may be delivered: the SSRF guard the tool executors use (batches/tools/netguard.py).

A webhook URL comes from a tenant, so it is checked like an executor's: https only, a host, no user
info, every address public (netguard's address tables), and the POST pinned to the checked addresses (no
second lookup: no DNS rebinding), no redirects followed, no proxies. The check runs when an endpoint is
created or updated (a 400) and again before deliveries (a failed attempt), at least every PIN_SECONDS: the
name may point somewhere else by then.

RELAY_WEBHOOK_ALLOWED_HOSTS names hosts exempt from the address check, for development and tests (embedded
mode lists 127.0.0.1, so a receiver on the same machine works): a listed host may be on any address and
may use plain http.

A delivery reuses a checked destination for PIN_SECONDS (`pinned`): the look-up, its thread and the check cost
about as much CPU as the POST itself on a keep-alive connection, and a receiver gets many deliveries a second.
The pin is kept per URL and per allowed-hosts listing, never a refusal: a URL whose name stops resolving or
starts pointing at an internal address is refused at the first attempt after its pin's age passes (at most
PIN_SECONDS late). The lane's pooled connections (delivery.py) are bound to one pin, so every connection goes
to an address that was checked at most PIN_SECONDS before the attempt that uses it.
"""

import ipaddress
import logging
import socket
import threading
import time

import httpcore2
import httpx2
from django.conf import settings

from batches.tools import netguard

log = logging.getLogger(__name__)

Blocked = netguard.Blocked
Unresolvable = netguard.Unresolvable

_DEFAULT_PORTS = {"https": 443, "http": 80}
# How long a resolved and checked destination is used before its name is resolved and checked again. A DNS
# TTL would be better, but getaddrinfo does not return one; 30 s is what browsers' and JVMs' caches keep.
PIN_SECONDS = 30.0
# Pins kept at most (one per endpoint URL in use); past it the cache starts again.
PIN_CACHE_SIZE = 10_000
_pins: dict = {}  # (url, listed) -> (Pin, monotonic time it expires)
_pins_lock = threading.Lock()


def _getaddrinfo(host: str, port: int, timeout: float) -> list:
    """socket.getaddrinfo within `timeout` seconds. It has no timeout of its own (the system resolver may wait
    5 s per name server, and try again), so it runs in a thread of its own and the caller stops waiting; a
    look-up given up on ends in the background when the resolver gives up. A thread per look-up, not a shared
    pool: one tenant's names on a dead name server must not fill a pool that other tenants' look-ups wait for."""
    box: dict = {}
    done = threading.Event()

    def look_up():
        try:
            box["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
        except BaseException as exc:  # handed to the caller
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=look_up, name="webhook-dns", daemon=True).start()
    if not done.wait(timeout):
        raise Unresolvable(f"host {host} did not resolve within {timeout:g} s")
    if "error" in box:
        raise box["error"]
    return box["infos"]


def allowed_hosts() -> set[str]:
    return {h.strip().lower().strip("[]") for h in settings.RELAY_WEBHOOK_ALLOWED_HOSTS if h.strip()}


def parse(url: str) -> tuple[netguard.Target, bool]:
    """(target, listed in RELAY_WEBHOOK_ALLOWED_HOSTS). Raises Blocked naming the problem."""
    if not isinstance(url, str) or not url.strip():
        raise Blocked("must be a non-empty URL")
    if len(url) > 2000:
        raise Blocked("is longer than 2000 characters")
    try:
        parsed = httpx2.URL(url)
    except (httpx2.InvalidURL, TypeError, ValueError) as exc:
        raise Blocked(f"is not a valid URL: {exc}") from exc
    if not parsed.raw_host:
        raise Blocked("has no host")
    host = parsed.raw_host.decode("ascii").lower()
    listed = host.strip("[]") in allowed_hosts()
    if parsed.scheme != "https" and not (listed and parsed.scheme == "http"):
        raise Blocked(f"must use https (got {parsed.scheme or 'no scheme'})")
    if parsed.userinfo:
        raise Blocked("must not contain user info (user:password@)")
    if parsed.fragment:
        raise Blocked("must not contain a fragment")
    if "%" in host:
        raise Blocked("must not carry an IPv6 zone index: scoped addresses are link-local")
    port = parsed.port or _DEFAULT_PORTS[parsed.scheme]
    if not 0 < port < 65536:
        raise Blocked(f"has an invalid port {port}")
    return netguard.Target(url=url, host=host, port=port), listed


def resolve(url: str) -> netguard.Pin:
    """Parse `url`, resolve its host once (within RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS), and refuse unless every
    address is public (or the host is listed).

    Raises Blocked (a bad URL, an internal address) or Unresolvable (DNS, or no answer in time).
    """
    target, listed = parse(url)
    host = target.host.strip("[]")
    try:
        infos = _getaddrinfo(host, target.port, settings.RELAY_WEBHOOK_DNS_TIMEOUT_SECONDS)
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(f"host {host} could not be resolved: {exc}") from exc
    addresses: list[str] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        ip = str(sockaddr[0]).split("%", 1)[0]
        if family in (socket.AF_INET, socket.AF_INET6) and ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise Unresolvable(f"host {host} has no IPv4 or IPv6 address")
    if not listed:
        for ip in addresses:
            reason = netguard.refusal(ipaddress.ip_address(ip))
            if reason is not None:
                shown = host if host == ip else f"{host} resolves to {ip}, which"
                raise Blocked(f"{shown} is {reason}; webhook endpoints must be on public addresses")
    return netguard.Pin(target=target, addresses=tuple(addresses))


def pinned(url: str) -> netguard.Pin:
    """`resolve`, reusing the last check of `url` for PIN_SECONDS. A refusal is never kept: it is raised again,
    and the next call looks again."""
    _target, listed = parse(url)
    key, now = (url, listed), time.monotonic()
    hit = _pins.get(key)
    if hit is not None and hit[1] > now:
        return hit[0]
    pin = resolve(url)
    with _pins_lock:
        if len(_pins) >= PIN_CACHE_SIZE:
            _pins.clear()
        _pins[key] = (pin, now + PIN_SECONDS)
    return pin


def forget() -> None:
    """Drop every kept pin (tests, and a process whose allowed hosts changed)."""
    with _pins_lock:
        _pins.clear()


class _RequestBudgetStream(netguard._BudgetStream):
    """A pooled connection's byte budget counts per request, not per connection: the next request's first write
    starts it again (HTTP/1.1 without pipelining: a request is written only once the previous answer is done)."""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._budget.used = 0
        await self._inner.write(buffer, timeout)

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None):
        return _RequestBudgetStream(await self._inner.start_tls(ssl_context, server_hostname, timeout), self._budget)


class _PooledBackend(netguard._PinnedBackend):
    """netguard's pinned backend (connects to the pin's checked addresses only), with a budget per connection."""

    def __init__(self, pin: netguard.Pin, max_bytes: int):
        super().__init__(pin, netguard.ByteBudget(limit=max_bytes))
        self._max_bytes = max_bytes

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = await super().connect_tcp(host, port, timeout, local_address, socket_options)
        return _RequestBudgetStream(stream._inner, netguard.ByteBudget(limit=self._max_bytes))


class _PooledTransport(netguard._PinnedTransport):
    def __init__(self, pin: netguard.Pin, max_bytes: int, max_connections: int, keepalive: float):
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=netguard._ssl_context(pin.test_ca),
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=keepalive,
            http1=True,
            http2=False,
            retries=0,
            network_backend=_PooledBackend(pin, max_bytes),
        )


def pooled_client(
    pin: netguard.Pin, *, max_bytes: int, max_connections: int, keepalive: float, headers: dict
) -> httpx2.AsyncClient:
    """A keep-alive client bound to `pin` (no other address, no redirects, no proxies), each request's answer
    capped at `max_bytes` read off the wire. Use it on one event loop; close it with `aclose`."""
    return httpx2.AsyncClient(
        transport=_PooledTransport(pin, max_bytes, max_connections, keepalive),
        headers={"Accept-Encoding": "identity", **headers},
        follow_redirects=False,
        max_redirects=0,
        trust_env=False,
    )


def check(url: str) -> None:
    """At create and update: the URL is well formed and resolves to addresses a delivery may reach."""
    resolve(url)
