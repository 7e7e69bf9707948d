"""The pieces of `make bench-kinds` (bench/kinds.py): the host kinds measured, the catalog (deploy/demo-catalog.yaml
on the fake, with a provider-mode and a relay-mode twin of each kind's batch binding), each kind's live call through
the relay and straight to the fake, one batch on the kind's surface (OpenAI or Anthropic), the fake's batch-API
requests, and the cost from the usage API. Over HTTP and /proc only: nothing of the relay is imported here.
"""

import json
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import requests

from bench import catalog, harness
from bench.provider_batch_parts import max_in, upload_and_create, write_jsonl

DEMO_CATALOG = harness.ROOT / "deploy" / "demo-catalog.yaml"
UPSTREAM_KEY = "demo-upstream-key"  # RELAY_HOSTKEY_DEMO: every demo host key's value, and Bedrock's secret
BEDROCK_ACCESS_KEY_ID = "AKIARELAYDEMO0000001"
ADMIN_TOKEN = "bench-admin-token"  # harness.Stack's RELAY_ADMIN_TOKEN
FAR = 1_000_000_000
# Bindings without a price in the demo catalog (Gemini, the vLLM server) get this one, so every kind has a cost.
BENCH_PRICING = {"name": "kinds-bench", "input": "0.15", "output": "0.60"}


@dataclass(frozen=True)
class Kind:
    name: str  # the host kind
    binding: str  # the demo catalog's binding (its model) that the kind's twins copy, and that live calls use
    surface: str  # the batch surface its adapter takes: openai (Files + Batches) or anthropic (Message Batches)
    upstream: str  # the model the relay sends upstream (the binding's upstream_name)
    provider_mode: bool = True  # False: the kind's batch records run in the relay whatever the binding says
    why_relay: str = ""

    def model(self, mode: str) -> str:
        return f"kinds-{self.name}-{mode}"


KINDS = [
    Kind("openai", "gpt-4o-mini-batch", "openai", "gpt-4o-mini"),
    Kind("anthropic", "claude-3-5-haiku-batch", "anthropic", "claude-3-5-haiku-latest"),
    Kind("azure_openai", "azure-gpt-4o-mini", "openai", "gpt-4o-mini"),
    Kind("openai_compatible", "llama-3.1-8b", "openai", "meta-llama/Llama-3.1-8B-Instruct"),
    Kind("bedrock", "bedrock-claude-3-5-haiku", "anthropic", "anthropic.claude-3-5-haiku-20241022-v1:0"),
    Kind("vertex", "vertex-claude-3-5-haiku", "anthropic", "claude-3-5-haiku@20241022"),
    Kind(
        "gemini",
        "gemini-2.5-flash",
        "openai",
        "gemini-2.5-flash",
        provider_mode=False,
        why_relay="Gemini's Batch API takes only Gemini's own request shape, which the relay never translates: "
        "`relay apply` refuses batch_mode provider/auto on a gemini host (docs/providers/gemini.md)",
    ),
]


# --- the catalog -------------------------------------------------------------------------------------------


def on_upstream(doc: dict, upstream: str) -> dict:
    """Every host's URLs on the fake's origin, keeping each URL's path (devkit/demo.py's on_upstream, restated
    here because that module loads Django)."""
    for host in doc.get("hosts", []):
        for name in ["base_url", *(k for k in host if k.endswith("_url") and k != "base_url")]:
            path = urlsplit(host.get(name) or "").path.rstrip("/")
            host[name] = upstream.rstrip("/") + path
    return doc


def document(upstream: str) -> dict:
    """The demo catalog on the fake, its rate limit far above what a run spends, plus per kind a relay-mode twin
    of its batch binding (`kinds-<kind>-relay`) and, where the kind has a batch API, a provider-mode one
    (`kinds-<kind>-provider`): same host, adapter, upstream model and price, only batch_mode differs."""
    import yaml

    doc = on_upstream(yaml.safe_load(DEMO_CATALOG.read_text()), upstream)
    for rl in doc["rate_limits"]:
        rl["rules"] = [{"meter": "requests", "amount": FAR, "window": 60, "strategy": "sliding-window"}]
    doc["pricing"].append(dict(BENCH_PRICING))
    models = {m["name"]: m for m in doc["models"]}
    bindings = {b["model"]: b for b in doc["bindings"]}
    for kind in KINDS:
        source = bindings[kind.binding]
        for mode in ("provider", "relay") if kind.provider_mode else ("relay",):
            doc["models"].append({"name": kind.model(mode), "provider": models[kind.binding]["provider"]})
            twin = {**source, "model": kind.model(mode), "batch_mode": mode}
            twin.setdefault("pricing", BENCH_PRICING["name"])
            doc["bindings"].append(twin)
    return doc


def apply(stack: harness.Stack, upstream: str) -> str:
    path = stack.tmp / "kinds-catalog.yaml"
    path.write_text(json.dumps(document(upstream), indent=1))  # JSON is YAML
    out = stack.manage("relay", "apply", "-f", str(path)).strip()
    return out.splitlines()[-1] if out else ""


def relay_key(stack: harness.Stack) -> str:
    return stack.manage("relay", "key", "create", "--service-account", "demo/demo-client", "--name", "bench").strip()


# --- live calls: through the relay, and straight to the fake in the kind's own wire ------------------------


@dataclass
class Target:
    name: str
    url: str
    headers: dict
    data: bytes


def _chat(i: int = 1) -> tuple[str, str]:
    msgs = catalog.chat_body(i)["messages"]
    return msgs[0]["content"], msgs[1]["content"]


def openai_body(model: str, i: int = 1, size: int = 0) -> dict:
    return catalog.chat_body(i, size, model=model)


def anthropic_body(model: str | None, i: int = 1, size: int = 0) -> dict:
    """The same request as Anthropic's Messages body (the system prompt apart); `model` None: left out."""
    chat = catalog.chat_body(i, size, model=model or "")
    body = {"system": chat["messages"][0]["content"], "messages": chat["messages"][1:], "max_tokens": 256}
    body["temperature"] = 0.2
    return {"model": model, **body} if model else body


def relay_target(kind: Kind, web_url: str, key: str) -> Target:
    path = "/v1/messages" if kind.surface == "anthropic" else "/v1/chat/completions"
    body = anthropic_body(kind.binding) if kind.surface == "anthropic" else openai_body(kind.binding)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    return Target("relay", web_url + path, headers, json.dumps(body).encode())


def direct_target(kind: Kind, up: str, doc: dict) -> Target:
    """The call the relay makes for the kind, made by hand: its URL scheme, its auth, its envelope."""
    host = next(h for h in doc["hosts"] if h["name"] == _binding(doc, kind)["host"])
    json_ct = {"Content-Type": "application/json"}
    if kind.name in ("openai", "openai_compatible", "gemini", "azure_openai"):
        data = json.dumps(openai_body(kind.upstream)).encode()
        if kind.name == "azure_openai":
            url = f"{up}/openai/deployments/{quote(kind.upstream, safe='')}/chat/completions"
            url += f"?api-version={host['api_version']}"
            return Target("direct", url, {"api-key": UPSTREAM_KEY, **json_ct}, data)
        if kind.name == "gemini":
            url = f"{host['base_url']}/chat/completions"
            return Target("direct", url, {"x-goog-api-key": UPSTREAM_KEY, **json_ct}, data)
        url = f"{host['base_url'].rstrip('/').removesuffix('/v1')}/v1/chat/completions"
        return Target("direct", url, {"Authorization": f"Bearer {UPSTREAM_KEY}", **json_ct}, data)
    if kind.name == "anthropic":
        data = json.dumps(anthropic_body(kind.upstream)).encode()
        headers = {"x-api-key": UPSTREAM_KEY, "anthropic-version": "2023-06-01", **json_ct}
        return Target("direct", f"{up}/v1/messages", headers, data)
    if kind.name == "bedrock":
        data = json.dumps({"anthropic_version": "bedrock-2023-05-31", **anthropic_body(None)}).encode()
        url = f"{up}/model/{quote(kind.upstream, safe='')}/invoke"
        return Target("direct", url, _sigv4(url, data, host["region"]), data)
    if kind.name == "vertex":
        data = json.dumps({"anthropic_version": "vertex-2023-10-16", **anthropic_body(None)}).encode()
        token = requests.post(f"{up}/_bench/vertex_token", json={}, timeout=10).json()["token"]
        where = f"projects/{host['project']}/locations/{host['region']}"
        url = f"{up}/v1/{where}/publishers/anthropic/models/{quote(kind.upstream, safe='')}:rawPredict"
        return Target("direct", url, {"Authorization": f"Bearer {token}", **json_ct}, data)
    raise ValueError(kind.name)


def _binding(doc: dict, kind: Kind) -> dict:
    return next(b for b in doc["bindings"] if b["model"] == kind.binding)


def _sigv4(url: str, data: bytes, region: str) -> dict:
    """Headers of one SigV4-signed InvokeModel call (signed once: the fake checks the signature, not its age, and
    the sequential rounds send the same bytes, so the signing stays out of the timed calls)."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    req = AWSRequest(method="POST", url=url, data=data, headers={"Content-Type": "application/json"})
    SigV4Auth(Credentials(BEDROCK_ACCESS_KEY_ID, UPSTREAM_KEY), "bedrock", region).add_auth(req)
    return dict(req.headers.items())


def sequential(targets: list[Target], n: int, warmup: int) -> dict[str, list[float]]:
    """bench/live_overhead.py's rounds with pre-encoded bodies: `warmup` rounds, then `n` rounds of one call to
    each target in turn on its own keep-alive session; the seconds of every measured call by target."""
    sessions = {t.name: requests.Session() for t in targets}
    times: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for i in range(warmup + n):
            for t in targets:
                t0 = time.perf_counter()
                resp = sessions[t.name].post(t.url, data=t.data, headers=t.headers, timeout=60)
                elapsed = time.perf_counter() - t0
                if resp.status_code != 200:
                    raise RuntimeError(f"{t.name} {t.url} answered {resp.status_code}: {resp.text[:300]}")
                if i >= warmup:
                    times[t.name].append(elapsed)
    finally:
        for s in sessions.values():
            s.close()
    return times


# --- one batch on the kind's surface ---------------------------------------------------------------------


def submit(kind: Kind, model: str, web_url: str, key: str, tmp: Path, n: int, item_bytes: int) -> str:
    """A batch of `n` records for `model` on the kind's surface; its id."""
    auth = {"Authorization": f"Bearer {key}"}
    if kind.surface == "openai":
        path = tmp / f"kinds-{model}.jsonl"
        write_jsonl(path, n, item_bytes, model)
        try:
            return upload_and_create(harness.Web(web_url, None), key, path)["public_id"]
        finally:
            path.unlink()
    reqs = [{"custom_id": f"r-{i}", "params": anthropic_body(model, i, item_bytes)} for i in range(n)]
    resp = requests.post(f"{web_url}/v1/messages/batches", json={"requests": reqs}, headers=auth, timeout=900)
    if resp.status_code != 200:
        raise RuntimeError(f"POST /v1/messages/batches answered {resp.status_code}: {resp.text[:500]}")
    return resp.json()["id"]


def wait(kind: Kind, batch_id: str, web_url: str, key: str, timeout: float) -> dict:
    """Poll the batch (every 0.5 s) until it ended; its last object."""
    auth = {"Authorization": f"Bearer {key}"}
    path = f"/v1/messages/batches/{batch_id}" if kind.surface == "anthropic" else f"/v1/batches/{batch_id}"
    deadline = time.monotonic() + timeout
    while True:
        resp = requests.get(web_url + path, headers=auth, timeout=60)
        body = resp.json() if resp.status_code == 200 else {}
        status = body.get("processing_status") or body.get("status")
        if status in ("ended", "completed", "failed", "expired", "cancelled"):
            return body
        if time.monotonic() > deadline:
            counts = body.get("request_counts")
            raise RuntimeError(f"batch {batch_id} not ended after {timeout:.0f} s ({status}, {counts})")
        time.sleep(0.5)


def succeeded(body: dict, n: int) -> tuple[int, str]:
    """(records that succeeded, a problem worth reporting or '')."""
    counts = body.get("request_counts") or {}
    ok = counts.get("succeeded", counts.get("completed", 0))
    status = body.get("processing_status") or body.get("status")
    problem = "" if ok == n and status in ("ended", "completed") else f"{status}, request_counts {counts}"
    return ok, problem


# --- the fake's batch-API requests, and cost --------------------------------------------------------------


def upstream_log(up: str) -> list[dict]:
    return requests.get(f"{up}/_bench/kinds_log", timeout=30).json()["log"]


def polls(entries: list[dict]) -> dict:
    """Per job created in `entries`: its polls (retrieves; Vertex's gets) per minute from its create to its last
    poll, and the most requests about it (create, polls, results) in any 60 s."""
    jobs = {e["job"] for e in entries if e["op"] == "create" and e["job"] and e["status"] == 200}
    out = []
    for job in sorted(jobs):
        about = sorted(e["t"] for e in entries if e["job"] == job)
        got = sorted(e["t"] for e in entries if e["job"] == job and e["op"] in ("retrieve", "get"))
        created = min(e["t"] for e in entries if e["job"] == job and e["op"] == "create")
        # Over the job's polled life, from its create to its last poll (the first poll comes one interval in).
        span = got[-1] - created if got else 0.0
        out.append(
            {
                "job": job,
                "polls": len(got),
                "span_s": span,
                "per_minute": len(got) / span * 60 if span else float("nan"),
                "max_60s": max_in(about, 60.0),
            }
        )
    apis = sorted({e["api"] for e in entries if e["op"] == "create"})
    return {"jobs": out, "apis": apis, "requests": len(entries)}


def batch_costs(web_url: str) -> dict[str, tuple[int, int, int]]:
    """model → (cost_nano_usd, batch events, unpriced) of the batch usage events of the last day, from the usage
    API with the admin token."""
    resp = requests.get(
        f"{web_url}/api/usage/summary",
        params={"group_by": "model", "source": "batch", "since": "24h"},
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        timeout=120,
    )
    resp.raise_for_status()
    return {
        row["group"]["model"]: (row["cost_nano_usd"], row["requests"], row["unpriced"]) for row in resp.json()["rows"]
    }
