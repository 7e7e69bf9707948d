"""SSRF guard for tool executors: the one way the relay opens a connection to a user-supplied URL.

Executors are not providers (those go through `gateway.upstream`): their URL comes
from whoever submitted the batch, so every executor call goes through here:

1. `parse_url`: https only, a host, no userinfo, a sane port.
2. `resolve`: ONE `socket.getaddrinfo` per executor call. Every address it
   returns must be public (`refusal`), or the call is refused. Numeric spellings
   (`2130706433`, `0x7f000001`, `0177.0.0.1`, `127.1`) are resolved by
   getaddrinfo with inet_aton semantics, so they are judged as the address they
   really are; IPv6 forms that carry an IPv4 address (IPv4-mapped, 6to4, Teredo,
   NAT64, IPv4-compatible) are unwrapped and the embedded address is judged too.
   Python's `is_private`/`is_global` alone are not enough (multicast and 6to4
   of 127.0.0.1 count as global, CGNAT as not private), so the tables below are
   explicit and `is_global` is only the last backstop.
3. `pinned_client`: an httpx2 client whose network backend connects only to the
   checked addresses (no second lookup, so no DNS rebinding) while TLS SNI, the
   certificate check and the Host header keep the hostname. Redirects are not
   followed, proxy variables are ignored, compressed answers are refused (no
   decompression bombs) and the bytes read per call are capped.

The MCP client library takes an httpx2.AsyncClient, so both executors share
this client. httpx2 has no public hook for a network backend: `_PinnedTransport`
sets the transport's connection pool itself (see its docstring).

Test-only escape hatch: `RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA` (settings). When
it names a CA bundle, loopback addresses are allowed and are verified against
that CA alone, so the test suite can run real HTTPS executors on 127.0.0.1.
It must never be set in production.
"""

import ipaddress
import logging
import socket
import ssl
import threading
from dataclasses import dataclass, field
from functools import lru_cache
from urllib.parse import urlsplit

import httpcore2
import httpx2
from django.conf import settings

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

_V4 = ipaddress.IPv4Network
_V6 = ipaddress.IPv6Network

# First match wins, so a more specific range comes before the block that contains it.
_IPV4_REFUSED: tuple[tuple[ipaddress.IPv4Network, str], ...] = (
    (_V4("0.0.0.0/32"), "the unspecified address"),
    (_V4("0.0.0.0/8"), "a 'this network' address (0.0.0.0/8)"),
    (_V4("10.0.0.0/8"), "a private address (RFC 1918)"),
    (_V4("100.64.0.0/10"), "a carrier-grade NAT address (100.64.0.0/10, RFC 6598)"),
    (_V4("127.0.0.0/8"), "a loopback address"),
    (_V4("169.254.169.254/32"), "the cloud metadata address (link-local)"),
    (_V4("169.254.0.0/16"), "a link-local address"),
    (_V4("172.16.0.0/12"), "a private address (RFC 1918)"),
    (_V4("192.0.0.0/24"), "an IETF protocol assignment address (192.0.0.0/24)"),
    (_V4("192.0.2.0/24"), "a documentation address (TEST-NET-1)"),
    (_V4("192.88.99.0/24"), "a 6to4 relay anycast address (deprecated)"),
    (_V4("192.168.0.0/16"), "a private address (RFC 1918)"),
    (_V4("198.18.0.0/15"), "a benchmarking address (198.18.0.0/15)"),
    (_V4("198.51.100.0/24"), "a documentation address (TEST-NET-2)"),
    (_V4("203.0.113.0/24"), "a documentation address (TEST-NET-3)"),
    (_V4("224.0.0.0/4"), "a multicast address"),
    (_V4("255.255.255.255/32"), "the broadcast address"),
    (_V4("240.0.0.0/4"), "a reserved address (240.0.0.0/4)"),
)

_IPV6_REFUSED: tuple[tuple[ipaddress.IPv6Network, str], ...] = (
    (_V6("::/128"), "the unspecified address"),
    (_V6("::1/128"), "a loopback address"),
    (_V6("100::/64"), "a discard-only address (100::/64)"),
    (_V6("2001:2::/48"), "a benchmarking address (2001:2::/48)"),
    (_V6("2001:db8::/32"), "a documentation address (2001:db8::/32)"),
    (_V6("2001::/23"), "an IETF protocol assignment address (2001::/23)"),
    (_V6("3fff::/20"), "a documentation address (3fff::/20)"),
    (_V6("5f00::/16"), "a segment-routing address (5f00::/16)"),
    (_V6("fd00:ec2::254/128"), "the cloud metadata address (unique-local)"),
    (_V6("fc00::/7"), "a unique-local address (fc00::/7)"),
    (_V6("fe80::/10"), "a link-local address"),
    (_V6("fec0::/10"), "a site-local address (deprecated)"),
    (_V6("ff00::/8"), "a multicast address"),
    (_V6("::/8"), "a reserved address (::/8)"),
)

_MAPPED = _V6("::ffff:0:0/96")
_COMPAT = _V6("::/96")
_NAT64 = _V6("64:ff9b::/96")
_NAT64_LOCAL = _V6("64:ff9b:1::/48")
_SIXTOFOUR = _V6("2002::/16")
_TEREDO = _V6("2001::/32")
_LOOPBACK = (_V4("127.0.0.0/8"), _V6("::1/128"))

DEFAULT_PORT = 443
MAX_HEADER_BYTES = 64 * 1024  # allowance for status line and headers on top of a body cap


class Blocked(Exception):
    """The executor URL or one of its addresses is not allowed; `message` says which and why."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class Unresolvable(Exception):
    """The executor's host name has no usable address (a lookup failure, not a policy refusal)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


# --- address policy ---------------------------------------------------------------


def _embedded(addr: ipaddress.IPv6Address) -> tuple[str, list[ipaddress.IPv4Address], bool] | None:
    """(wrapper name, embedded IPv4 addresses, refused even when they are public) for IPv6 forms carrying IPv4."""
    if addr in _MAPPED:
        return "IPv4-mapped", [addr.ipv4_mapped], False
    if addr in _NAT64:
        return "NAT64 (64:ff9b::/96)", [ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)], False
    if addr in _NAT64_LOCAL:
        # Local-use NAT64 (RFC 8215): the translator is site-specific, so never a public destination.
        return "local-use NAT64 (64:ff9b:1::/48)", [ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)], True
    if addr in _SIXTOFOUR:
        return "6to4 (2002::/16)", [addr.sixtofour], False
    if addr in _TEREDO:
        server, client = addr.teredo
        return "Teredo (2001::/32)", [server, client], True
    if addr in _COMPAT and int(addr) > 1:
        return "IPv4-compatible (::/96, deprecated)", [ipaddress.IPv4Address(int(addr) & 0xFFFFFFFF)], True
    return None


def _table_refusal(addr: IPAddress) -> str | None:
    table = _IPV4_REFUSED if addr.version == 4 else _IPV6_REFUSED
    for network, reason in table:
        if addr in network:
            return reason
    if not addr.is_global:
        return "not a globally routable address"
    return None


def refusal(address: str | IPAddress) -> str | None:
    """Why an executor may not connect to `address`, or None when it is a public address.

    Accepts an address object or a literal (an IPv6 scope such as `%eth0` is
    ignored). Test-only loopback allowance is not applied here; see `resolve`.
    """
    addr = ipaddress.ip_address(address.split("%", 1)[0] if isinstance(address, str) else address)
    if addr.version == 6:
        wrapped = _embedded(addr)
        if wrapped is not None:
            name, inner, always = wrapped
            for v4 in inner:
                reason = _table_refusal(v4)
                if reason is not None:
                    return f"{reason} ({v4}) inside the {name} address {addr}"
            if always:
                return f"the {name} address {addr}, which is not a public destination"
            return None
    return _table_refusal(addr)


def _is_loopback(addr: IPAddress) -> bool:
    if addr.version == 6 and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return any(addr in net for net in _LOOPBACK if net.version == addr.version)


def loopback_test_ca() -> str:
    """The TEST-ONLY CA bundle path that opens loopback to executors, or "" (the default: off)."""
    return getattr(settings, "RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA", "") or ""


# --- URL and resolution ---------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    url: str
    host: str  # ASCII (IDNA) host as the connection pool sees it; SNI and Host use it
    port: int


def parse_url(url: str) -> Target:
    """Syntax checks that need no DNS. Raises Blocked with a message naming the problem."""
    try:
        parsed = httpx2.URL(url)
    except (httpx2.InvalidURL, TypeError, ValueError) as exc:
        raise Blocked(f"is not a valid URL: {exc}{_numeric_note(url)}") from exc
    if parsed.scheme != "https":
        raise Blocked(f"must use https (got {parsed.scheme or 'no scheme'}): the request carries your authorization")
    if not parsed.raw_host:
        raise Blocked("has no host")
    if parsed.userinfo:
        raise Blocked("must not contain user info (user:password@); send credentials in authorization")
    if parsed.fragment:
        raise Blocked("must not contain a fragment")
    if "%" in parsed.raw_host.decode("ascii"):
        raise Blocked("must not carry an IPv6 zone index (%25...): scoped addresses are link-local")
    port = parsed.port or DEFAULT_PORT
    if not 0 < port < 65536:
        raise Blocked(f"has an invalid port {port}")
    host = parsed.raw_host.decode("ascii").lower()
    return Target(url=url, host=host, port=port)


def _numeric_note(url: str) -> str:
    """Name the address behind a host the URL parser refused but inet_aton reads (e.g. 0177.0.0.1)."""
    try:
        host = urlsplit(url).hostname or ""
        ip = ipaddress.IPv4Address(socket.inet_aton(host))
    except (ValueError, OSError):
        return ""
    reason = refusal(ip)
    if reason is None:
        return f" ({host} is a non-standard spelling of {ip}; write {ip})"
    return (
        f" ({host} is a non-standard spelling of {ip}, which is {reason}; tool executors must be on public addresses)"
    )


@dataclass(frozen=True)
class Pin:
    """A checked executor endpoint: connect only to `addresses`, speak TLS to `target.host`."""

    target: Target
    addresses: tuple[str, ...]  # every address getaddrinfo returned, each checked, in its order
    test_ca: str = ""  # set only when the test-only loopback allowance was used


def resolve(url: str) -> Pin:
    """Parse `url`, resolve its host exactly once, and refuse unless every address is public.

    Raises Blocked (policy: bad URL, internal address) or Unresolvable (DNS).
    """
    target = parse_url(url)
    try:
        infos = socket.getaddrinfo(target.host, target.port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise Unresolvable(f"host {target.host} could not be resolved: {exc}") from exc
    addresses: list[str] = []
    for family, _type, _proto, _canon, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        ip = str(sockaddr[0]).split("%", 1)[0]
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise Unresolvable(f"host {target.host} has no IPv4 or IPv6 address")
    test_ca = loopback_test_ca()
    used_test_ca = False
    for ip in addresses:
        addr = ipaddress.ip_address(ip)
        if test_ca and _is_loopback(addr):
            used_test_ca = True
            continue
        reason = refusal(addr)
        if reason is not None:
            shown = target.host if target.host == ip else f"{target.host} resolves to {ip}, which"
            raise Blocked(f"{shown} is {reason}; tool executors must be on public addresses")
    if used_test_ca:
        log.warning("tool executor %s reached on loopback through the TEST-ONLY CA %s", target.host, test_ca)
    return Pin(target=target, addresses=tuple(addresses), test_ca=test_ca if used_test_ca else "")


# --- the pinned client ---------------------------------------------------------------------


@dataclass
class ByteBudget:
    """Bytes one executor call may read off the wire (headers + body, after TLS)."""

    limit: int
    used: int = 0
    exceeded: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def spend(self, n: int) -> None:
        with self._lock:
            self.used += n
            if self.used > self.limit:
                self.exceeded = True
                raise httpcore2.ReadError(f"the executor sent more than {self.limit} bytes")


class _BudgetStream(httpcore2.AsyncNetworkStream):
    """A network stream that charges every byte read to the call's ByteBudget."""

    def __init__(self, inner: httpcore2.AsyncNetworkStream, budget: ByteBudget):
        self._inner = inner
        self._budget = budget

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        data = await self._inner.read(max_bytes, timeout)
        self._budget.spend(len(data))
        return data

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._inner.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore2.AsyncNetworkStream:
        return _BudgetStream(await self._inner.start_tls(ssl_context, server_hostname, timeout), self._budget)

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _PinnedBackend(httpcore2.AnyIOBackend):
    """Connects to the pin's checked addresses only; the hostname never reaches a resolver again."""

    def __init__(self, pin: Pin, budget: ByteBudget):
        self._pin = pin
        self._budget = budget

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        target = self._pin.target
        if host.lower() != target.host or port != target.port:
            # Only reachable if something tried another origin (a redirect is never followed).
            raise httpcore2.ConnectError(f"refused to connect to {host}:{port}: only {target.host} was checked")
        errors = []
        for ip in self._pin.addresses:
            try:
                # An IP literal: anyio and asyncio connect to it without any name lookup.
                stream = await super().connect_tcp(ip, port, timeout, None, socket_options)
            except (httpcore2.ConnectError, httpcore2.ConnectTimeout) as exc:
                errors.append(f"{ip}: {exc or type(exc).__name__}")
                continue
            return _BudgetStream(stream, self._budget)
        raise httpcore2.ConnectError(f"could not connect to {target.host}:{port} ({'; '.join(errors)})")

    async def connect_unix_socket(self, path, timeout=None, socket_options=None):
        raise httpcore2.ConnectError("unix sockets are not tool executors")


class CompressedAnswer(Exception):
    """The executor compressed its answer although we asked for identity."""


class _PinnedTransport(httpx2.AsyncHTTPTransport):
    """httpx2's transport over a connection pool that uses `_PinnedBackend`.

    httpx2 2.16 takes no network backend, so instead of calling the parent
    constructor (which would build an unpinned pool) this sets `_pool`, the one
    attribute the parent's request, close and context-manager methods use.
    `tests/test_netguard.py` proves the connect step goes through the backend.
    """

    def __init__(self, pin: Pin, budget: ByteBudget):  # the parent's __init__ is skipped on purpose, see above
        self._pool = httpcore2.AsyncConnectionPool(
            ssl_context=_ssl_context(pin.test_ca),
            max_connections=4,
            max_keepalive_connections=4,
            http1=True,
            http2=False,
            retries=0,
            network_backend=_PinnedBackend(pin, budget),
        )

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        response = await super().handle_async_request(request)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            await response.aclose()
            raise CompressedAnswer(f"the executor answered with Content-Encoding {encoding}; only identity is accepted")
        return response


@lru_cache(maxsize=8)
def _ssl_context(test_ca: str) -> ssl.SSLContext:
    if test_ca:
        # TEST-ONLY: trust exactly the test CA, and only for loopback (see resolve()).
        return ssl.create_default_context(cafile=test_ca)
    return ssl.create_default_context()


def pinned_client(pin: Pin, *, timeout: float, max_bytes: int, headers: dict | None = None):
    """An httpx2.AsyncClient bound to `pin`, and the ByteBudget it charges. Use it as `async with`.

    The budget is shared by every connection of the client, so a multi-request
    exchange (MCP) is capped as a whole; `budget.exceeded` tells a size refusal
    from other read errors.
    """
    budget = ByteBudget(limit=max_bytes)
    merged = {"Accept-Encoding": "identity", "User-Agent": "relay-tool-executor"}
    merged.update(headers or {})
    client = httpx2.AsyncClient(
        transport=_PinnedTransport(pin, budget),
        headers=merged,
        timeout=httpx2.Timeout(timeout),
        follow_redirects=False,
        max_redirects=0,  # the MCP transport follows same-origin redirects itself unless this is 0
        trust_env=False,  # HTTP(S)_PROXY and friends must not reroute executor traffic
    )
    return client, budget
