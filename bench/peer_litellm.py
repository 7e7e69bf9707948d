"""The peer of the live benchmark: LiteLLM's proxy on the same fake upstream, in the same run.

Installed by scripts/bench-litellm-venv.sh into its own virtualenv (.bench-venv-litellm, pinned in
bench/requirements-litellm.txt), never into the relay's .venv. Started like its docs start it
(`litellm --config ... --num_workers 2`, no database: a master key only), with the one model the
relay serves (`gpt-4o` → `openai/gpt-4o-2024-08-06` at the fake upstream). Everything that could
reach the network at start (the model cost map, telemetry) is turned off.

`start()` returns a Peer or raises Skip with the reason, which the benchmark prints instead of
the peer's figures. BENCH_PEER=0 skips it on purpose.
"""

import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from bench import catalog, harness

VENV = Path(os.environ.get("BENCH_LITELLM_VENV") or harness.ROOT / ".bench-venv-litellm")
MASTER_KEY = "sk-litellm-bench-master"


class Skip(Exception):
    pass


@dataclass
class Peer:
    url: str
    headers: dict
    version: str
    proc: "harness.Proc"


def _free_port() -> int:
    # LiteLLM binds a port number itself (no inherited socket), so one is picked here.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(stack: "harness.Stack", upstream_url: str, workers: int = 2) -> Peer:
    if os.environ.get("BENCH_PEER", "1") == "0":
        raise Skip("BENCH_PEER=0")
    binary = VENV / "bin" / "litellm"
    if not binary.exists():
        raise Skip(f"LiteLLM is not installed in {VENV} (scripts/bench-litellm-venv.sh failed: see its message)")
    version = "?"
    stamp = next(iter(VENV.glob("lib/python*/site-packages/litellm-*.dist-info")), None)
    if stamp is not None:
        version = stamp.name.removeprefix("litellm-").removesuffix(".dist-info")
    config = stack.tmp / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        f"  - model_name: {catalog.MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{catalog.UPSTREAM_MODEL}\n"
        f"      api_base: {upstream_url}/v1\n"
        f"      api_key: {catalog.UPSTREAM_KEY}\n"
        "general_settings:\n"
        f"  master_key: {MASTER_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
    )
    port = _free_port()
    # Not the relay's settings: no DATABASE_URL (LiteLLM would try to run Prisma on it).
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env.update(
        LITELLM_LOCAL_MODEL_COST_MAP="True",
        LITELLM_LOG="ERROR",
        LITELLM_TELEMETRY="False",
        DISABLE_SCHEMA_UPDATE="True",
        NO_PROXY="*",
        PYTHONUNBUFFERED="1",
    )
    args = [str(binary), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--num_workers", str(workers), "--telemetry", "False"]
    proc = stack.spawn("litellm", args, env=env)
    url = f"http://127.0.0.1:{port}"
    import requests

    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise Skip(f"LiteLLM exited with {proc.popen.returncode}: {proc.tail(600)!r}")
        try:
            if requests.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                break
        except requests.RequestException:
            pass
        time.sleep(0.5)
    else:
        raise Skip(f"LiteLLM not ready after 180 s: {proc.tail(600)!r}")
    return Peer(url, {"Authorization": f"Bearer {MASTER_KEY}"}, version, proc)
