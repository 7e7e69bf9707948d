"""What the drill asks of the relay: the catalog (`relay apply`), a relay key (`relay key create`), and per
scenario six batches — OpenAI (a file uploaded, then a batch), Anthropic (Message Batches) and native —
one of each through each app host's web server; then each batch's results read back through the API."""

import json
import logging
import subprocess
import uuid
from dataclasses import dataclass

import requests

from drill import topology as t

log = logging.getLogger(__name__)

PROJECT = "drill"
SERVICE_ACCOUNT = "drill"


def catalog_yaml(upstream_url: str) -> str:
    """The catalog: one team, project and service account; OpenAI and Anthropic hosts both on the fake
    provider, priced; a policy granting both with batches enabled."""
    return f"""# The multi-host drill's catalog (scripts/drill/workload.py).
teams: [{{name: drill}}]
projects: [{{name: {PROJECT}, team: drill, default_policy: drill}}]
service_accounts: [{{name: {SERVICE_ACCOUNT}, project: {PROJECT}, policy: drill}}]
hosts:
  - {{name: openai, base_url: "{upstream_url}"}}
  - {{name: anthropic, base_url: "{upstream_url}"}}
models:
  - {{name: gpt-4o, provider: openai}}
  - {{name: claude-sonnet-4, provider: anthropic}}
pricing:
  - {{name: gpt-4o, input: "2.50", output: "10.00"}}
  - {{name: claude-sonnet-4, input: "3.00", output: "15.00"}}
bindings:
  - {{model: gpt-4o, host: openai, adapter: openai, upstream_name: gpt-4o-2024-08-06, pricing: gpt-4o}}
  - {{model: claude-sonnet-4, host: anthropic, adapter: anthropic, upstream_name: claude-sonnet-4-20250514,
     pricing: claude-sonnet-4}}
host_keys:
  - {{name: openai-drill, host: openai, value: "sk-drill-openai"}}
  - {{name: anthropic-drill, host: anthropic, value: "sk-drill-anthropic"}}
policies:
  - name: drill
    project: {PROJECT}
    models: ["openai/*", "anthropic/*"]
    host_keys: [openai-drill, anthropic-drill]
    enabled: true
    batch_enabled: true
"""


def manage(topo: t.Topology, *args: str) -> str:
    """A manage.py command against the drill's database, straight to PostgreSQL (from the database host)."""
    out = subprocess.run(
        [t.PY, "manage.py", *args],
        cwd=t.ROOT,
        env=t.app_env(topo, direct=True),
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"manage.py {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def seed(topo: t.Topology) -> str:
    """Migrate, apply the catalog, create the relay key; returns the key."""
    manage(topo, "migrate", "--noinput")
    path = topo.tmp / "db" / "catalog.yaml"
    path.write_text(catalog_yaml(topo.upstream_url))
    log.info("%s", manage(topo, "relay", "apply", "-f", str(path)).strip().splitlines()[-1])
    key = manage(topo, "relay", "key", "create", "--service-account", f"{PROJECT}/{SERVICE_ACCOUNT}", "--name", "drill")
    return key.strip().splitlines()[-1]


@dataclass
class Submitted:
    surface: str  # openai | anthropic | native
    via: str  # the app host whose web server took it
    api_id: str
    db_id: str
    records: int
    custom_ids: list[str]


def _marker(scenario: str, surface: str, via: str, i: int) -> str:
    return f"drill-{scenario}-{surface}-{via}-{i}"


def submit_all(hosts, key: str, scenario: str, records: int) -> list[Submitted]:
    """Six batches: each surface through each app host's web server."""
    out = []
    for host in hosts:
        for surface in ("openai", "anthropic", "native"):
            out.append(SUBMIT[surface](host, key, scenario, records))
    return out


def _check(resp: requests.Response, what: str) -> dict:
    if resp.status_code >= 300:
        raise RuntimeError(f"{what}: HTTP {resp.status_code}: {resp.text[:500]}")
    return resp.json()


def _submit_openai(host: t.AppHost, key: str, scenario: str, records: int) -> Submitted:
    via = host.name.removeprefix("drill-")
    lines, ids = [], []
    for i in range(records):
        cid = f"o-{i}"
        ids.append(cid)
        body = {
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": f"{_marker(scenario, 'openai', via, i)} summarise ticket {i}"}],
            "max_tokens": 64,
        }
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}))
    auth = {"Authorization": f"Bearer {key}"}
    up = _check(
        requests.post(
            f"{host.web_url}/v1/files",
            headers=auth,
            data={"purpose": "batch"},
            files={"file": ("drill.jsonl", ("\n".join(lines) + "\n").encode(), "application/jsonl")},
            timeout=60,
        ),
        f"upload via {host.name}",
    )
    batch = _check(
        requests.post(
            f"{host.web_url}/v1/batches",
            headers=auth,
            json={"input_file_id": up["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            timeout=60,
        ),
        f"openai batch via {host.name}",
    )
    return Submitted("openai", host.name, batch["id"], str(uuid.UUID(batch["id"].removeprefix("batch_"))), records, ids)


def _submit_anthropic(host: t.AppHost, key: str, scenario: str, records: int) -> Submitted:
    via = host.name.removeprefix("drill-")
    reqs = [
        {
            "custom_id": f"a-{i}",
            "params": {
                "model": "claude-sonnet-4",
                "max_tokens": 64,
                "messages": [{"role": "user", "content": f"{_marker(scenario, 'anthropic', via, i)} classify {i}"}],
            },
        }
        for i in range(records)
    ]
    batch = _check(
        requests.post(
            f"{host.web_url}/v1/messages/batches",
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
            json={"requests": reqs},
            timeout=60,
        ),
        f"anthropic batch via {host.name}",
    )
    api_id = batch["id"]
    return Submitted(
        "anthropic",
        host.name,
        api_id,
        str(uuid.UUID(api_id.removeprefix("msgbatch_"))),
        records,
        [r["custom_id"] for r in reqs],
    )


def _submit_native(host: t.AppHost, key: str, scenario: str, records: int) -> Submitted:
    via = host.name.removeprefix("drill-")
    reqs = [
        {
            "model": "gpt-4o",
            "messages": [{"role": "user", "content": f"{_marker(scenario, 'native', via, i)} translate {i}"}],
            "max_tokens": 64,
        }
        for i in range(records)
    ]
    batch = _check(
        requests.post(
            f"{host.web_url}/v1/batches",
            headers={"Authorization": f"Bearer {key}"},
            json={"shape": "openai", "requests": reqs},
            timeout=60,
        ),
        f"native batch via {host.name}",
    )
    return Submitted(
        "native", host.name, batch["id"], str(uuid.UUID(batch["id"])), records, [str(i) for i in range(records)]
    )


SUBMIT = {"openai": _submit_openai, "anthropic": _submit_anthropic, "native": _submit_native}


def result_ids(host: t.AppHost, key: str, b: Submitted) -> list[str]:
    """The ids of the successful results the API hands back for batch `b` (custom_id, or idx for native),
    one per result row: a row missing is an item lost, a row twice an item finished twice."""
    auth = {"Authorization": f"Bearer {key}"}
    if b.surface == "native":
        rows = _check(
            requests.get(f"{host.web_url}/v1/batches/{b.api_id}/results", headers=auth, timeout=120), "native results"
        )["results"]
        return [str(r["idx"]) for r in rows if r.get("state") == "completed"]
    if b.surface == "anthropic":
        resp = requests.get(
            f"{host.web_url}/v1/messages/batches/{b.api_id}/results",
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
            timeout=120,
        )
        if resp.status_code >= 300:
            raise RuntimeError(f"anthropic results: HTTP {resp.status_code}: {resp.text[:300]}")
        rows = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
        return [r["custom_id"] for r in rows if r["result"]["type"] == "succeeded"]
    batch = _check(requests.get(f"{host.web_url}/v1/batches/{b.api_id}", headers=auth, timeout=60), "openai batch")
    if not batch.get("output_file_id"):
        return []
    resp = requests.get(f"{host.web_url}/v1/files/{batch['output_file_id']}/content", headers=auth, timeout=120)
    if resp.status_code >= 300:
        raise RuntimeError(f"openai output file: HTTP {resp.status_code}: {resp.text[:300]}")
    rows = [json.loads(line) for line in resp.text.splitlines() if line.strip()]
    return [r["custom_id"] for r in rows if r.get("error") is None and r["response"]["status_code"] == 200]
