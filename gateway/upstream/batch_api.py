"""The providers' batch APIs (Files, Batches): `exchange()`, the one HTTP exit of gateway/batch_apis/."""

import requests

from core.upstream_types import MAX_RESPONSE_BYTES, UpstreamError
from gateway.upstream.transport import _failure, _shared_session

# --- the batch APIs' calls (batches/provider/) ---------------------------------------------------
# Provider batch jobs talk to the providers' Files and Batches APIs from the control worker: uploads of up to
# 200 MB read from a file, results streamed line by line. They go through the same session (its pools, no
# proxies from the environment) with explicit timeouts; they are not a live call's budget or watchdog.

BATCH_API_TIMEOUT = (10.0, 120.0)  # (connect, per read) seconds


def exchange(method: str, url: str, *, headers: dict, data=None, stream: bool = False) -> requests.Response:
    """One call of a provider's batch API: `data` bytes or a file object (sent as it is read). With `stream`,
    the caller reads the body (`iter_lines`) and must close the response. Raises UpstreamError (unreachable:
    no connection; network: it broke after the request was sent) when no HTTP answer came; an HTTP error
    status is the caller's to read."""
    try:
        resp = _shared_session().request(
            method,
            url,
            headers=headers,
            data=data,
            timeout=BATCH_API_TIMEOUT,
            allow_redirects=False,
            stream=stream,
        )
    except requests.RequestException as exc:
        # Sorted as a live call's failure is (`_failure`): requests' ConnectionError also covers a connection
        # dropped after the request was sent, which may be the request's doing, not the host's.
        cause = exc.args[0] if exc.args and isinstance(exc.args[0], Exception) else exc
        raise _failure(cause) from exc
    if not stream and len(resp.content) > MAX_RESPONSE_BYTES:
        raise UpstreamError("too_large", f"upstream answer exceeds {MAX_RESPONSE_BYTES} bytes")
    return resp
