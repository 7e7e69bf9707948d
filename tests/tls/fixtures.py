"""Pytest fixtures for the tool-calling tests (loaded with `pytest_plugins = ["tests.tls.fixtures"]`).

Nothing here is autouse: a module opts in to `loopback_only`, the guard that
makes any connection to a non-loopback address fail the test instead of
leaving the machine.
"""

import ipaddress
import socket

import pytest

from tests.tls.pki import TestPKI, make_pki
from tests.tls.servers import HttpsExecutor, McpTestServer


@pytest.fixture(scope="session")
def test_pki(tmp_path_factory) -> TestPKI:
    return make_pki(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def trust_test_ca(settings, test_pki) -> TestPKI:
    """Turn on the TEST-ONLY loopback allowance with the throwaway CA, for this test only."""
    settings.RELAY_TOOL_EXECUTOR_TEST_LOOPBACK_CA = str(test_pki.ca_cert)
    return test_pki


@pytest.fixture(scope="session")
def _https_executor(test_pki):
    server = HttpsExecutor(test_pki).start()
    yield server
    server.stop()


@pytest.fixture
def executor(_https_executor, trust_test_ca) -> HttpsExecutor:
    _https_executor.reset()
    return _https_executor


@pytest.fixture(scope="session")
def _mcp_server(test_pki):
    server = McpTestServer(test_pki).start()
    yield server
    server.stop()


@pytest.fixture
def mcp_server(_mcp_server, trust_test_ca) -> McpTestServer:
    _mcp_server.reset()
    return _mcp_server


class NonLoopbackConnect(AssertionError):
    """A test tried to open a connection that would leave the machine."""


def _check_loopback(address) -> None:
    if not isinstance(address, tuple):
        return  # AF_UNIX paths and the like stay on the machine
    host = str(address[0]).split("%", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise NonLoopbackConnect(f"connect() to an unresolved name {host!r}") from None
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if not ip.is_loopback:
        raise NonLoopbackConnect(f"connect() to non-loopback address {address!r}")


@pytest.fixture
def loopback_only(monkeypatch):
    """Every socket connect in the test must target loopback; anything else is stopped before it connects.

    The refusal may be swallowed by the code under test (it is a failed
    connection to it), so violations are also collected and fail the test at
    teardown.
    """
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    violations: list[str] = []

    def guard(address) -> None:
        try:
            _check_loopback(address)
        except NonLoopbackConnect as exc:
            violations.append(str(exc))
            raise

    def connect(self, address):
        guard(address)
        return real_connect(self, address)

    def connect_ex(self, address):
        guard(address)
        return real_connect_ex(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
    yield violations
    assert not violations, f"the test tried to leave loopback: {violations}"
