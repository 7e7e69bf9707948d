"""Real tool executors for the tests, on loopback over HTTPS with the throwaway test CA.

- `HttpsExecutor`: the `http` executor contract over a ThreadingHTTPServer.
  Unscripted calls are answered by `answer_tool_call` (deterministic tools);
  `script([Step(...)])` queues other behaviours (errors, garbage, delays).
  Every request is recorded with its headers, JSON body and TLS SNI name.
- `McpTestServer`: an MCP server built with the `mcp` package (MCPServer over
  Streamable HTTP) served by uvicorn with the test certificate, in a thread.
  Every HTTP request reaching it is recorded with its headers and body.
"""

import asyncio
import json
import socket
import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import uvicorn
from mcp.server.mcpserver import MCPServer

from tests.tls.pki import TestPKI


def answer_tool_call(call: dict) -> str:
    """What the test tools return: `add` adds, `get_weather` reports, anything else echoes."""
    function = call.get("function") or {}
    try:
        args = json.loads(function.get("arguments") or "{}")
    except ValueError:
        args = {}
    name = function.get("name")
    if name == "add":
        return str(args.get("a", 0) + args.get("b", 0))
    if name == "get_weather":
        return f"sunny in {args.get('city', 'nowhere')}"
    return json.dumps({"echo": name, "args": args})


@dataclass
class Step:
    status: int = 200
    body: object = None  # dict/list → JSON; bytes → sent raw; None → the normal answer
    headers: dict = field(default_factory=dict)
    delay: float = 0.0
    size: int = 0  # > 0: send a body of this many bytes (a huge answer)


class HttpsExecutor(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, pki: TestPKI):
        super().__init__(("127.0.0.1", 0), _ExecutorHandler)
        self.ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ssl_context.load_cert_chain(pki.server_cert, pki.server_key)
        self.ssl_context.sni_callback = _remember_sni
        self.lock = threading.Lock()
        self.steps: deque[Step] = deque()
        self.received: list[dict] = []
        self.handshake_failures = 0
        self.stopping = threading.Event()

    @property
    def port(self) -> int:
        return self.server_address[1]

    def url(self, path: str = "/tools", host: str = "localhost") -> str:
        return f"https://{host}:{self.port}{path}"

    def script(self, steps: list[Step]) -> None:
        with self.lock:
            self.steps.extend(steps)

    def reset(self) -> None:
        with self.lock:
            self.steps.clear()
            self.received.clear()
            self.handshake_failures = 0

    def next_step(self) -> Step:
        with self.lock:
            return self.steps.popleft() if self.steps else Step()

    def handle_error(self, request, client_address):  # a refused handshake is expected in some tests
        with self.lock:
            self.handshake_failures += 1

    def start(self) -> "HttpsExecutor":
        threading.Thread(target=self.serve_forever, name="https-executor", daemon=True).start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


def _remember_sni(ssl_socket, server_name, _context):
    ssl_socket.sni_name = server_name


class _ExecutorHandler(BaseHTTPRequestHandler):
    server: HttpsExecutor
    protocol_version = "HTTP/1.1"

    def setup(self):
        # TLS per connection, in the handler's thread, so a slow handshake never blocks the accept loop.
        self.request.settimeout(10)
        self.request = self.server.ssl_context.wrap_socket(self.request, server_side=True)
        super().setup()

    def log_message(self, fmt, *args):
        pass

    def do_POST(self):
        srv = self.server
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        with srv.lock:
            srv.received.append(
                {
                    "path": self.path,
                    "headers": dict(self.headers.items()),
                    "body": body,
                    "sni": getattr(self.request, "sni_name", None),
                }
            )
        step = srv.next_step()
        if step.delay:
            srv.stopping.wait(step.delay)
        if step.size:
            payload = b'{"results": [], "pad": "' + b"x" * step.size + b'"}'
        elif isinstance(step.body, bytes):
            payload = step.body
        elif step.body is not None:
            payload = json.dumps(step.body).encode()
        else:
            calls = (body or {}).get("tool_calls") or []
            results = [{"tool_call_id": c.get("id"), "content": answer_tool_call(c)} for c in calls]
            payload = json.dumps({"results": results}).encode()
        try:
            self.send_response(step.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in step.headers.items():
                self.send_header(name, str(value))
            self.end_headers()
            self.wfile.write(payload)
        except OSError:
            pass  # the client gave up (timeouts, size caps): expected in those tests


# --- MCP ------------------------------------------------------------------------------


def build_mcp_server() -> MCPServer:
    server = MCPServer("relay-test-tools")

    @server.tool()
    def add(a: int, b: int) -> str:
        """Add two integers."""
        return str(a + b)

    @server.tool()
    def get_weather(city: str) -> str:
        """Report the weather of a city."""
        return f"sunny in {city}"

    @server.tool()
    async def slow(seconds: float) -> str:
        """Answer after a while."""
        await asyncio.sleep(seconds)
        return "finally"

    @server.tool()
    def fail() -> str:
        """Always fails (a tool-level error, reported in the result)."""
        raise ValueError("the tool broke")

    @server.tool()
    def big(size: int) -> str:
        """Return `size` characters."""
        return "y" * size

    return server


class McpTestServer:
    """MCPServer's Streamable HTTP app under uvicorn (TLS, loopback) in a background thread."""

    def __init__(self, pki: TestPKI):
        self.received: list[dict] = []
        self.lock = threading.Lock()
        app = build_mcp_server().streamable_http_app(host="127.0.0.1")
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(
            self._recording(app),
            ssl_certfile=str(pki.server_cert),
            ssl_keyfile=str(pki.server_key),
            log_level="critical",
            lifespan="on",
            timeout_graceful_shutdown=0.2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    def url(self, path: str = "/mcp", host: str = "localhost") -> str:
        return f"https://{host}:{self.port}{path}"

    def reset(self) -> None:
        with self.lock:
            self.received.clear()

    def requests_with_method(self, method: str) -> list[dict]:
        """The JSON-RPC messages of that method the server received, in order."""
        with self.lock:
            return [
                r["json"]
                for r in self.received
                if isinstance(r.get("json"), dict) and r["json"].get("method") == method
            ]

    def _recording(self, app):
        async def wrapped(scope, receive, send):
            if scope["type"] != "http":
                return await app(scope, receive, send)
            entry = {
                "method": scope["method"],
                "path": scope["path"],
                "headers": {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]},
                "body": b"",
            }
            with self.lock:
                self.received.append(entry)
            if scope["path"] == "/mcp-redirect":
                location = f"https://localhost:{self.port}/mcp".encode()
                await send({"type": "http.response.start", "status": 307, "headers": [(b"location", location)]})
                await send({"type": "http.response.body", "body": b""})
                return None
            if scope["path"] == "/mcp-broken":
                await send(
                    {"type": "http.response.start", "status": 500, "headers": [(b"content-type", b"text/plain")]}
                )
                await send({"type": "http.response.body", "body": b"internal trouble"})
                return None

            async def recording_receive():
                message = await receive()
                if message["type"] == "http.request":
                    entry["body"] += message.get("body", b"")
                    if not message.get("more_body"):
                        try:
                            entry["json"] = json.loads(entry["body"])
                        except ValueError:
                            pass
                return message

            return await app(scope, recording_receive, send)

        return wrapped

    def start(self) -> "McpTestServer":
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the MCP test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        # force_exit: do not wait for the MCP sessions that timeout and cancel tests left open.
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(timeout=5)
