"""The SSRF guard: every refused address form, one DNS lookup per call, and the connection pinned to it.

Refusals go through the real `socket.getaddrinfo` with numeric hosts only (no
DNS traffic). Names are answered by a fake resolver installed on
`socket.getaddrinfo`; the connect step is intercepted at `socket.socket.connect`,
so no test ever opens a connection to a non-loopback address.
"""

import socket

import pytest

from batches.tools import executors, netguard
from batches.tools.config import ToolError, parse_tool_config
from tests.tls.pki import EXECUTOR_NAME

pytest_plugins = ["tests.tls.fixtures"]
pytestmark = pytest.mark.usefixtures("loopback_only")

PUBLIC_V4 = "93.184.216.34"
CALLS = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]


# --- the address table ------------------------------------------------------------------

REFUSED = [
    # loopback
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("::1", "loopback"),
    # RFC 1918
    ("10.0.0.5", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.255", "private"),
    ("192.168.1.1", "private"),
    # link-local and cloud metadata
    ("169.254.169.254", "metadata"),
    ("169.254.1.1", "link-local"),
    ("fe80::1", "link-local"),
    ("fd00:ec2::254", "metadata"),
    # CGNAT
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.255", "carrier-grade NAT"),
    # unique-local
    ("fc00::1", "unique-local"),
    ("fdff:ffff::1", "unique-local"),
    # multicast
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("ff02::1", "multicast"),
    # unspecified, this network, broadcast, reserved
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "this network"),
    ("::", "unspecified"),
    ("255.255.255.255", "broadcast"),
    ("240.0.0.1", "reserved"),
    # protocol assignments, benchmarking, documentation, deprecated ranges
    ("192.0.0.8", "IETF protocol assignment"),
    ("198.18.0.1", "benchmarking"),
    ("198.19.255.255", "benchmarking"),
    ("192.0.2.1", "documentation"),
    ("198.51.100.7", "documentation"),
    ("203.0.113.9", "documentation"),
    ("192.88.99.1", "6to4 relay"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("2001:2::1", "benchmarking"),
    ("100::1", "discard-only"),
    ("fec0::1", "site-local"),
    ("5f00::1", "segment-routing"),
    # IPv4 hidden in IPv6: mapped, 6to4, Teredo, NAT64 (well-known and local-use), IPv4-compatible
    ("::ffff:127.0.0.1", "loopback address (127.0.0.1) inside the IPv4-mapped"),
    ("::ffff:169.254.169.254", "metadata address (link-local) (169.254.169.254) inside the IPv4-mapped"),
    ("::ffff:10.1.2.3", "private address (RFC 1918) (10.1.2.3) inside the IPv4-mapped"),
    ("2002:7f00:1::1", "(127.0.0.1) inside the 6to4"),
    ("2002:a9fe:a9fe::1", "(169.254.169.254) inside the 6to4"),
    ("2002:c0a8:101::", "(192.168.1.1) inside the 6to4"),
    ("2001:0:4136:e378:8000:63bf:3fff:fdd2", "Teredo"),  # public server and client: still not a destination
    ("2001:0:7f00:1:8000:63bf:80ff:fffe", "(127.0.0.1) inside the Teredo"),  # server field = 127.0.0.1
    ("2001:0:4136:e378:8000:63bf:f5ff:fffa", "(10.0.0.5) inside the Teredo"),  # client = ~0xf5fffffa
    ("64:ff9b::a9fe:a9fe", "(169.254.169.254) inside the NAT64"),
    ("64:ff9b::7f00:1", "(127.0.0.1) inside the NAT64"),
    ("64:ff9b::a00:5", "(10.0.0.5) inside the NAT64"),
    ("64:ff9b:1::a00:5", "(10.0.0.5) inside the local-use NAT64"),
    ("64:ff9b:1::5db8:d822", "local-use NAT64"),  # even a public IPv4 behind a site-local translator
    ("::7f00:1", "(127.0.0.1) inside the IPv4-compatible"),
    ("::a9fe:a9fe", "inside the IPv4-compatible"),
]


@pytest.mark.parametrize("address,reason", REFUSED, ids=[a for a, _ in REFUSED])
def test_refused_addresses(address, reason):
    why = netguard.refusal(address)
    assert why is not None, f"{address} must be refused"
    assert reason in why, why


ALLOWED = [
    PUBLIC_V4,
    "8.8.8.8",
    "1.1.1.1",
    "2606:4700:4700::1111",
    "2a00:1450:4001:80b::200e",
    "::ffff:93.184.216.34",  # IPv4-mapped public: it is that public address
    "64:ff9b::5db8:d822",  # NAT64 of a public IPv4
    "2002:5db8:d822::1",  # 6to4 of a public IPv4
    "100.63.255.255",  # just below CGNAT
    "100.128.0.0",  # just above CGNAT
    "172.15.255.255",
    "172.32.0.0",
]


@pytest.mark.parametrize("address", ALLOWED)
def test_public_addresses_are_allowed(address):
    assert netguard.refusal(address) is None


# --- URLs: every spelling is judged as the address getaddrinfo makes of it -------------------------


SPELLINGS = [
    ("https://2130706433/", "127.0.0.1"),  # dword
    ("https://0x7f000001/", "127.0.0.1"),  # hex dword
    ("https://017700000001/", "127.0.0.1"),  # octal dword
    ("https://0177.0.0.1/", "127.0.0.1"),  # octal dotted
    ("https://0x7f.0.0.1/", "127.0.0.1"),  # hex dotted
    ("https://127.1/", "127.0.0.1"),  # short form
    ("https://127.0.1/", "127.0.0.1"),
    ("https://0/", "0.0.0.0"),
    ("https://0x0a000005/", "10.0.0.5"),
    ("https://167772165/", "10.0.0.5"),
    ("https://0251.0376.0251.0376/", "169.254.169.254"),  # metadata in octal
    ("https://2852039166/", "169.254.169.254"),  # metadata as a dword
    ("https://0xa9fea9fe/", "169.254.169.254"),
    ("https://100.64.1/", "100.64.0.1"),
    ("https://[::1]/", "::1"),
    ("https://[::ffff:127.0.0.1]/", "::ffff:127.0.0.1"),
    ("https://[::ffff:7f00:1]/", "::ffff:127.0.0.1"),
    ("https://[::ffff:a9fe:a9fe]/", "::ffff:169.254.169.254"),
    ("https://[64:ff9b::a9fe:a9fe]/", "64:ff9b::a9fe:a9fe"),
    ("https://[2002:7f00:1::1]/", "2002:7f00:1::1"),
    ("https://[fd00:ec2::254]/", "fd00:ec2::254"),
    ("https://127.0.0.1:8443/run", "127.0.0.1"),
    ("https://localhost/", ("127.0.0.1", "::1")),
]


@pytest.mark.parametrize("url,address", SPELLINGS, ids=[u for u, _ in SPELLINGS])
def test_numeric_and_wrapped_spellings_are_refused(url, address):
    with pytest.raises(netguard.Blocked) as info:
        netguard.resolve(url)
    message = info.value.message
    assert any(a in message for a in (address if isinstance(address, tuple) else (address,))), message
    assert "tool executors must be on public addresses" in message


class FakeResolver:
    """Stands in for DNS: answers per name (a list of answers, one per lookup) and counts lookups."""

    def __init__(self, monkeypatch, answers: dict[str, list[list[str]]]):
        self.answers = answers
        self.calls: list[str] = []
        self._real = socket.getaddrinfo
        monkeypatch.setattr(socket, "getaddrinfo", self)

    def __call__(self, host, port, family=0, type=0, proto=0, flags=0):
        if host not in self.answers:
            return self._real(host, port, family, type, proto, flags)
        self.calls.append(host)
        queue = self.answers[host]
        ips = queue[min(len(self.calls_for(host)) - 1, len(queue) - 1)]
        out = []
        for ip in ips:
            if ":" in ip:
                out.append((socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port, 0, 0)))
            else:
                out.append((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (ip, port)))
        return out

    def calls_for(self, host) -> list[str]:
        return [h for h in self.calls if h == host]


@pytest.mark.parametrize(
    "answer",
    [
        [PUBLIC_V4, "10.0.0.5"],
        ["10.0.0.5", PUBLIC_V4],
        [PUBLIC_V4, "::1"],
        ["2606:4700:4700::1111", "fd00:ec2::254"],
        ["::ffff:169.254.169.254"],
        ["100.64.0.1"],
    ],
)
def test_a_name_is_refused_unless_every_address_is_public(monkeypatch, answer):
    FakeResolver(monkeypatch, {"mixed.example": [answer]})
    with pytest.raises(netguard.Blocked) as info:
        netguard.resolve("https://mixed.example/tools")
    assert "mixed.example resolves to" in info.value.message


def test_a_public_name_is_pinned_to_all_its_checked_addresses(monkeypatch):
    resolver = FakeResolver(monkeypatch, {"tools.example": [[PUBLIC_V4, "2606:4700:4700::1111"]]})
    pin = netguard.resolve("https://Tools.Example:8443/run?x=1")
    assert pin.target.host == "tools.example" and pin.target.port == 8443
    assert pin.addresses == (PUBLIC_V4, "2606:4700:4700::1111") and pin.test_ca == ""
    assert resolver.calls == ["tools.example"]


def test_unresolvable_name_is_an_executor_error(monkeypatch):
    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    with pytest.raises(netguard.Unresolvable, match="could not be resolved"):
        netguard.resolve("https://nowhere.example/")
    err = pytest.raises(
        ToolError, executors.execute, parse_tool_config({"url": "https://nowhere.example/"}), CALLS, custom_id="x"
    )
    assert err.value.code == "tool_executor_error" and "nowhere.example could not be resolved" in err.value.message


@pytest.mark.parametrize(
    "url,fragment",
    [
        ("http://93.184.216.34/", "must use https"),
        ("https://[fe80::1%25eth0]/", "zone index"),
        ("https://user:secret@tools.example/", "user info"),
        ("https:///path", "has no host"),
        ("https://tools.example/#frag", "fragment"),
    ],
)
def test_url_syntax(url, fragment):
    with pytest.raises(netguard.Blocked, match=fragment):
        netguard.parse_url(url)


# --- the TEST-ONLY loopback allowance ------------------------------------------------------------


def test_loopback_is_refused_by_default(settings):
    assert settings.RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA == ""
    with pytest.raises(netguard.Blocked, match="loopback"):
        netguard.resolve("https://127.0.0.1:9/")


def test_test_ca_setting_opens_loopback_only(trust_test_ca):
    pin = netguard.resolve("https://127.0.0.1:9/")
    assert pin.addresses == ("127.0.0.1",) and pin.test_ca == str(trust_test_ca.ca_cert)
    for url in ("https://10.0.0.5/", "https://169.254.169.254/", "https://[fd00:ec2::254]/", "https://100.64.0.1/"):
        with pytest.raises(netguard.Blocked):
            netguard.resolve(url)


# --- rebinding: one lookup per call, the connection goes to the checked address ----------------------


class ConnectSpy:
    """Records every connect target; refuses non-loopback ones so nothing ever leaves the machine."""

    def __init__(self, monkeypatch):
        self.targets: list[tuple] = []
        real = socket.socket.connect

        def connect(sock, address):
            self.targets.append(tuple(address[:2]))
            if not str(address[0]).startswith("127."):
                raise ConnectionRefusedError(111, "refused by the test's connect spy")
            return real(sock, address)

        monkeypatch.setattr(socket.socket, "connect", connect)

    def non_loopback(self) -> list[tuple]:
        return [t for t in self.targets if not str(t[0]).startswith("127.")]


@pytest.mark.parametrize("kind", ["http", "mcp"])
def test_rebinding_name_is_looked_up_once_and_the_checked_address_is_dialled(monkeypatch, executor, mcp_server, kind):
    # First answer public, every later answer loopback, where a real executor listens and the test CA is
    # trusted: a second lookup would reach it and succeed. Pinned, the call dials the public address,
    # which the spy refuses, so the round fails and the executor never hears from us.
    port = executor.port if kind == "http" else mcp_server.port
    resolver = FakeResolver(monkeypatch, {"rebind.example": [[PUBLIC_V4], ["127.0.0.1"]]})
    spy = ConnectSpy(monkeypatch)
    path = "/tools" if kind == "http" else "/mcp"
    cfg = parse_tool_config({"url": f"https://rebind.example:{port}{path}", "type": kind, "timeout_ms": 5000})
    with pytest.raises(ToolError) as info:
        executors.execute(cfg, CALLS, custom_id="r-1")
    assert info.value.code == "tool_executor_error", info.value.message
    assert "refused by the test's connect spy" in info.value.message or "could not connect" in info.value.message
    assert resolver.calls_for("rebind.example") == ["rebind.example"], "looked up exactly once"
    assert spy.non_loopback() == [(PUBLIC_V4, port)], "the connection targets the checked address"
    assert executor.received == [] and mcp_server.received == []


def test_pinned_connection_keeps_the_name_for_tls_and_host(monkeypatch, executor):
    # A name that resolves (once) to loopback, where the executor's certificate names it: the request lands
    # on the pinned address while SNI, certificate verification and the Host header all use the name.
    resolver = FakeResolver(monkeypatch, {EXECUTOR_NAME: [["127.0.0.1"]]})
    spy = ConnectSpy(monkeypatch)
    cfg = parse_tool_config({"url": f"https://{EXECUTOR_NAME}:{executor.port}/tools"})
    assert executors.execute(cfg, CALLS, custom_id="p-1")[0]["content"] == "3"
    assert resolver.calls_for(EXECUTOR_NAME) == [EXECUTOR_NAME]
    assert ("127.0.0.1", executor.port) in spy.targets and spy.non_loopback() == []
    seen = executor.received[-1]
    assert seen["sni"] == EXECUTOR_NAME
    assert seen["headers"]["Host"] == f"{EXECUTOR_NAME}:{executor.port}"


def test_certificate_must_match_the_name(monkeypatch, executor):
    # Same pinned loopback address, a name the certificate does not carry: the TLS check refuses it.
    FakeResolver(monkeypatch, {"not-in-the-cert.test": [["127.0.0.1"]]})
    cfg = parse_tool_config({"url": f"https://not-in-the-cert.test:{executor.port}/tools"})
    with pytest.raises(ToolError) as info:
        executors.execute(cfg, CALLS, custom_id="c-1")
    assert info.value.code == "tool_executor_error"
    assert "certificate" in info.value.message.lower() or "hostname" in info.value.message.lower()
    assert executor.received == []


def test_certificate_from_another_ca_is_refused(settings, executor, test_pki):
    settings.RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA = str(test_pki.other_ca_cert)
    cfg = parse_tool_config({"url": executor.url()})
    with pytest.raises(ToolError) as info:
        executors.execute(cfg, CALLS, custom_id="c-1")
    assert info.value.code == "tool_executor_error" and "certificate" in info.value.message.lower()
    assert executor.received == []


def test_proxy_variables_are_ignored(monkeypatch, executor):
    # A proxy on a private address would be dialled if the client honoured these; loopback_only would catch it.
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY"):
        monkeypatch.setenv(name, "http://10.255.255.1:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    cfg = parse_tool_config({"url": executor.url()})
    assert executors.execute(cfg, CALLS, custom_id="p-1")[0]["content"] == "3"
    assert executor.received[-1]["path"] == "/tools"
