"""What a provider call gives back: its answer (`UpstreamResponse`) or its failure (`UpstreamError`), and the
size an answer may reach. Shared by every module of the package; imports none of them."""

from dataclasses import dataclass, field

MAX_RESPONSE_BYTES = 64 * 1024 * 1024
_CHUNK = 64 * 1024


@dataclass
class UpstreamResponse:
    status: int
    headers: dict = field(default_factory=dict)
    body: bytes = b""


class UpstreamError(Exception):
    """No usable HTTP answer. `kind` drives breaker and failover decisions (policies.breaker.TRANSPORT
    maps it to a failure class, policies.breaker.RULES says whom that blames):

    - unreachable: connect refused or timed out, DNS or TLS failure: no byte of the request left, so it
      cannot be the request's doing — the key is benched for everyone;
    - network: the connection broke after the request was sent (read timeout, reset, cut answer), which
      the request may have caused — scored against the principal that sent it;
    - timeout: the total deadline passed;
    - cancelled: the caller's cancel callback said stop;
    - too_large: the answer exceeded MAX_RESPONSE_BYTES.
    """

    def __init__(self, kind: str, message: str, *, read_timeout: bool = False):
        super().__init__(message)
        self.kind = kind
        self.message = message
        # A `network` failure that is the provider still thinking past RELAY_UPSTREAM_READ_TIMEOUT: the call is
        # not tried on another key (each would bill the operator for the same long generation nobody gets).
        self.read_timeout = read_timeout
