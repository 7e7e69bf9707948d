"""Where a webhook may be delivered: the SSRF guard the tool executors use (batches/tools/netguard.py).

A webhook URL comes from a tenant, so it is checked like an executor's: https only, a host, no user
info, resolved once per delivery, every address public (netguard's address tables), and the POST pinned
to the checked addresses (no second lookup: no DNS rebinding), no redirects followed, no proxies.
The check runs when an endpoint is created or updated (a 400) and again at every delivery (a failed
attempt): the name may point somewhere else by then.

RELAY_WEBHOOK_ALLOWED_HOSTS names hosts exempt from the address check, for development and tests (embedded
mode lists 127.0.0.1, so a receiver on the same machine works): a listed host may be on any address and
may use plain http.
"""

import ipaddress
import logging
import socket
import threading

import httpx2
from django.conf import settings

from batches.tools import netguard

log = logging.getLogger(__name__)

Blocked = netguard.Blocked
Unresolvable = netguard.Unresolvable

_DEFAULT_PORTS = {"https": 443, "http": 80}


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


def check(url: str) -> None:
    """At create and update: the URL is well formed and resolves to addresses a delivery may reach."""
    resolve(url)
