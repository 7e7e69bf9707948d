"""The side by side's catalog, applied to each tree through that tree's own operator CLI (`manage.py relay
apply -f`, `manage.py relay key create`) and API, so that neither tree's modules are imported here.

Two variants, applied in turn to the same database:
- plain: none of the features a deployment may leave out: no budget, `batch_share: 1.0` (no live-first
  reservation), no token rule or token-metered tier, no webhook endpoint. The policy's rate limit meters
  requests and concurrency, far above what a run spends.
- configured: all of them: a monthly budget on the project (far above what a run spends), `batch_share: 0.5`
  (live traffic is sent meanwhile by the figure), a tokens rule on the policy's rate limit and a host-key tier
  limit on requests and tokens, and a webhook endpoint for `batch.completed` at a loopback receiver.
"""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests

from bench import catalog
from bench.harness import Stack

PROVIDER_MODEL = "gpt-4o-provider"
FAR = 1_000_000_000  # every amount a run cannot reach


def document(upstream_url: str, configured: bool) -> dict:
    """The catalog as `relay apply` reads it (JSON is YAML)."""
    inbound = [
        {"meter": "requests", "amount": FAR, "window": 60, "strategy": "sliding-window"},
        {"meter": "concurrency", "amount": 100_000, "window": 60, "strategy": "fixed-window"},
    ]
    rate_limits = [{"name": "bench-inbound", "rules": inbound}]
    host_key = {"name": "openai-bench", "host": "openai", "value": catalog.UPSTREAM_KEY}
    policy = {
        "name": "bench",
        "project": "bench",
        "models": ["*"],
        "host_keys": ["openai-bench"],
        "rate_limit": "bench-inbound",
        "batch_share": "1.0",
    }
    budgets = []
    if configured:
        inbound.insert(1, {"meter": "tokens", "amount": FAR * 1000, "window": 60, "strategy": "sliding-window"})
        tier = [
            {"meter": "requests", "amount": FAR, "window": 60, "strategy": "sliding-window"},
            {"meter": "tokens", "amount": FAR * 1000, "window": 60, "strategy": "sliding-window"},
        ]
        rate_limits.append({"name": "bench-tier", "rules": tier})
        host_key["rate_limit"] = "bench-tier"
        policy["batch_share"] = "0.5"
        budgets.append({"name": "bench-monthly", "project": "bench", "usd": "1000000", "period": "month"})
    binding = {"host": "openai", "adapter": "openai", "upstream_name": catalog.UPSTREAM_MODEL, "pricing": "gpt-4o"}
    return {
        "teams": [{"name": "bench"}],
        "projects": [{"name": "bench", "team": "bench"}],
        "service_accounts": [{"name": "bench", "project": "bench", "policy": "bench"}],
        "hosts": [{"name": "openai", "base_url": upstream_url}],
        "models": [{"name": catalog.MODEL, "provider": "openai"}, {"name": PROVIDER_MODEL, "provider": "openai"}],
        "pricing": [
            {
                "name": "gpt-4o",
                "input": "2.50",
                "output": "10.00",
                "cache_read": "1.25",
                "batch_input": "1.25",
                "batch_output": "5.00",
            }
        ],
        "bindings": [
            {"model": catalog.MODEL, **binding, "batch_mode": "relay"},
            {"model": PROVIDER_MODEL, **binding, "batch_mode": "provider"},
        ],
        "rate_limits": rate_limits,
        "host_keys": [host_key],
        "policies": [policy],
        "budgets": budgets,
    }


def apply(stack: Stack, upstream_url: str, configured: bool) -> str:
    """`relay apply` of the variant in the stack's tree; what it printed last (its summary)."""
    path = stack.tmp / f"catalog-{'configured' if configured else 'plain'}.yaml"
    path.write_text(json.dumps(document(upstream_url, configured), indent=1))
    out = stack.manage("relay", "apply", "-f", str(path))
    return out.strip().splitlines()[-1] if out.strip() else ""


def relay_key(stack: Stack) -> str:
    """A relay key of the bench service account, made by the tree's CLI (the plaintext is its stdout)."""
    return stack.manage("relay", "key", "create", "--service-account", "bench/bench", "--name", "bench").strip()


# --- webhooks ------------------------------------------------------------------------------------------------


class Receiver:
    """A loopback webhook receiver in a thread of this process: answers 200, counts what arrived."""

    def __init__(self):
        self.count = 0
        lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    outer.count += 1
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def register_webhook(web_url: str, key: str, receiver_url: str) -> str:
    """An endpoint for `batch.completed` owned by the bench key (OpenAI's Webhook Endpoints API); '' when done,
    else why not (a release without the API)."""
    resp = requests.post(
        f"{web_url}/v1/webhook_endpoints",
        json={"url": receiver_url, "name": "bench", "event_types": ["batch.completed"]},
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )
    return "" if resp.status_code in (200, 201) else f"webhook endpoint: {resp.status_code} {resp.text[:200]}"
