"""LiteLLM against the relay, end to end: a client nobody here wrote.

(a) The LiteLLM SDK streams through the relay (OpenAI chat under `/v1` and `/openai/v1`, Anthropic
    messages), and each stream's usage event is recorded with the tokens the stream reported.
(b) The LiteLLM proxy, configured with the relay as its upstream, forwards files and batches to it
    under either prefix: the official `openai` SDK, pointed at the proxy, uploads a file, creates a
    batch, polls it to its end and downloads the results, which the relay's workers produced.

LiteLLM is not a dev dependency (its tree is large and is not the relay's): it lives in the benchmark's
own virtualenv, made by `bash scripts/bench-litellm-venv.sh` (`.bench-venv-litellm`, or
`BENCH_LITELLM_VENV`). Without it these tests skip, saying so. LiteLLM runs in its own interpreter
(a subprocess); the relay is the production web server (gunicorn) on the test database, with its
access log kept so the paths LiteLLM called can be checked; the fake upstream runs in this process.
"""

import json
import os
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import openai
import pytest
import requests

from batches.models import Batch
from devkit.upstream import canned
from tests.workers import ROOT, free_port, production_web, stop_process_group, wait_for
from usage.models import UsageEvent

VENV = Path(os.environ.get("BENCH_LITELLM_VENV") or ROOT / ".bench-venv-litellm")
PYTHON, PROXY = VENV / "bin" / "python", VENV / "bin" / "litellm"
MASTER_KEY = "sk-litellm-peer-master"

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not (PYTHON.exists() and PROXY.exists()),
        reason=f"LiteLLM is not installed in {VENV}: run `bash scripts/bench-litellm-venv.sh` first",
    ),
]

MESSAGES = [{"role": "user", "content": "stream this to me through litellm"}]
CLAUDE = [{"role": "user", "content": "hello claude, via litellm"}]

# What LiteLLM needs to run offline and quietly (no cost-map fetch, no telemetry), and nothing of the
# relay's settings (no DATABASE_URL: the proxy would try to run Prisma on it).
LITELLM_ENV = {
    **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")},
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_LOG": "ERROR",
    "LITELLM_TELEMETRY": "False",
    "DISABLE_SCHEMA_UPDATE": "True",
    "NO_PROXY": "*",
    "PYTHONUNBUFFERED": "1",
}


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker):
    """The production web server (relay.webserver's argv) on the test database, its access log kept."""
    from django.db import connection

    with production_web(connection.settings_dict, log_prefix="relay-web-litellm-", access_log=True) as server:
        yield server.url, server.log


def access_lines(log: Path, since: int) -> list[str]:
    """The access-log lines written after byte `since`: `METHOD /path` and the status."""
    with open(log, "rb") as f:
        f.seek(since)
        return [line for line in f.read().decode(errors="replace").splitlines() if '"' in line and " HTTP/" in line]


def run_litellm(script: str, *args: str, timeout: float = 120) -> dict:
    """A script in LiteLLM's own interpreter; it prints one JSON object, its results."""
    done = subprocess.run(
        [str(PYTHON), "-c", textwrap.dedent(script), *args],
        env=LITELLM_ENV,
        cwd=tempfile.gettempdir(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"LiteLLM script failed ({done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def event_of(request_id: str, timeout: float = 10) -> UsageEvent:
    wait_for(
        lambda: UsageEvent.objects.filter(request_id=request_id).exists(),
        timeout,
        interval=0.05,
        what=f"the usage event of {request_id}",
    )
    return UsageEvent.objects.get(request_id=request_id)


# --- (a) the LiteLLM SDK streams through the relay ----------------------------------------------------

SDK_SCRIPT = """
    import json, sys
    import litellm

    litellm.telemetry = False
    relay, key, messages, claude = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])


    def drain(stream):
        chunks = list(stream)
        usage = next((c.usage for c in reversed(chunks) if getattr(c, "usage", None)), None)
        headers = (getattr(stream, "_hidden_params", None) or {}).get("additional_headers") or {}
        return {
            "chunks": len(chunks),
            "text": "".join((c.choices[0].delta.content or "") for c in chunks if c.choices),
            "usage": usage and {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens},
            "request_id": headers.get("llm_provider-x-request-id"),
        }


    out = {
        "openai_v1": drain(litellm.completion(
            model="openai/gpt-4o", api_base=relay + "/v1", api_key=key, messages=messages,
            stream=True, stream_options={"include_usage": True}, num_retries=0,
        )),
        "openai_prefixed": drain(litellm.completion(
            model="openai/gpt-4o", api_base=relay + "/openai/v1", api_key=key, messages=messages,
            stream=True, num_retries=0,
        )),
        "anthropic": drain(litellm.completion(
            model="anthropic/claude-sonnet", api_base=relay, api_key=key, messages=claude,
            max_tokens=64, stream=True, stream_options={"include_usage": True}, num_retries=0,
        )),
    }
    print(json.dumps(out))
"""


def test_litellm_sdk_streams_through_the_relay_and_usage_is_recorded(web, catalog, fake):
    url, log = web
    mark = log.stat().st_size
    started = time.monotonic()
    out = run_litellm(SDK_SCRIPT, url, catalog.key, json.dumps(MESSAGES), json.dumps(CLAUDE))
    print(f"LiteLLM SDK script: {time.monotonic() - started:.1f} s")  # noqa: T201 - the time, for the report

    paths = [line.split('"')[1] for line in access_lines(log, mark)]
    assert "POST /v1/chat/completions HTTP/1.1" in paths, paths
    assert "POST /openai/v1/chat/completions HTTP/1.1" in paths, paths
    assert "POST /v1/messages HTTP/1.1" in paths, paths

    chat = canned("/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
    for name in ("openai_v1", "openai_prefixed"):
        got = out[name]
        assert got["text"] == chat["choices"][0]["message"]["content"], (name, got)
        assert got["chunks"] > 5, (name, got)  # word by word, as the provider sent it
    # The client that asked for usage got the provider's usage chunk.
    want = chat["usage"]
    assert out["openai_v1"]["usage"] == {
        "prompt_tokens": want["prompt_tokens"],
        "completion_tokens": want["completion_tokens"],
    }
    message = canned("/v1/messages", {"model": "claude-sonnet", "max_tokens": 64, "messages": CLAUDE})
    assert out["anthropic"]["text"] == message["content"][0]["text"]
    assert out["anthropic"]["chunks"] > 5
    assert out["anthropic"]["usage"] == {
        "prompt_tokens": message["usage"]["input_tokens"],
        "completion_tokens": message["usage"]["output_tokens"],
    }

    # Every stream was billed from its own usage: one event each, with the stream's tokens.
    wait_for(lambda: UsageEvent.objects.count() >= 3, 10, interval=0.05, what="the three streams' usage events")
    events = list(UsageEvent.objects.order_by("ts"))
    assert len(events) == 3, events
    for event in events:
        assert (event.status, event.error_kind, event.attempts) == (200, "", 1), event.__dict__
    gpt = [e for e in events if e.model == "gpt-4o"]
    assert len(gpt) == 2
    for event in gpt:
        assert (event.input_tokens, event.output_tokens) == (want["prompt_tokens"], want["completion_tokens"])
        assert event.cost_nano_usd == want["prompt_tokens"] * 2_500 + want["completion_tokens"] * 10_000
    (claude,) = [e for e in events if e.model == "claude-sonnet"]
    assert (claude.input_tokens, claude.output_tokens) == (
        message["usage"]["input_tokens"],
        message["usage"]["output_tokens"],
    )
    # The relay's request id reaches LiteLLM (as `llm_provider-x-request-id`) and is the event's.
    models = {"openai_v1": "gpt-4o", "openai_prefixed": "gpt-4o", "anthropic": "claude-sonnet"}
    assert {event_of(out[name]["request_id"]).model for name in models} == set(models.values())
    assert len({out[name]["request_id"] for name in models}) == 3
    # The client that did not ask for usage got no usage chunk (the relay asked upstream, and kept it).
    assert out["openai_prefixed"]["usage"] is None


# --- (b) the LiteLLM proxy forwards files and batches to the relay --------------------------------------

# Both prefixes, one deployment each; `x-litellm-model` (or `?model=`) picks the deployment whose
# credentials a file or batch call uses, and LiteLLM encodes that model into the ids it returns, so
# later calls (retrieve, content) go back to the same deployment. Calls naming no model use
# `files_settings` (an upload) or the first deployment of the `openai` provider (batch calls).
PREFIXES = {"relay-v1": "/v1", "relay-openai-v1": "/openai/v1"}


def proxy_config(relay: str, key: str) -> str:
    deployments = "".join(
        f"  - model_name: {name}\n"
        "    litellm_params:\n"
        "      model: openai/gpt-4o\n"
        f"      api_base: {relay}{prefix}\n"
        f"      api_key: {key}\n"
        for name, prefix in PREFIXES.items()
    )
    return (
        "model_list:\n" + deployments + "files_settings:\n"
        "  - custom_llm_provider: openai\n"
        f"    api_base: {relay}/openai/v1\n"
        f"    api_key: {key}\n"
        "general_settings:\n"
        f"  master_key: {MASTER_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        "  set_verbose: false\n"
    )


@pytest.fixture
def litellm_proxy(web, catalog, tmp_path):
    """LiteLLM's proxy (`litellm --config`, no database: a master key only) with the relay upstream."""
    url, _ = web
    config = tmp_path / "litellm.yaml"
    config.write_text(proxy_config(url, catalog.key))
    port = free_port()
    log = open(tmp_path / "litellm.log", "w+b")  # noqa: SIM115 - closed below
    env = dict(LITELLM_ENV)
    args = [str(PROXY), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(
        [*args, "--num_workers", "1", "--telemetry", "False"],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    proxy = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, f"LiteLLM exited with {proc.returncode}: {output()}"
        try:
            return requests.get(proxy + "/health/liveliness", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def output() -> str:
        log.flush()
        return (tmp_path / "litellm.log").read_text(errors="replace")[-4000:]

    started = time.monotonic()
    try:
        wait_for(up, 240, interval=0.5, what="the LiteLLM proxy to answer /health/liveliness")
        print(f"LiteLLM proxy ready in {time.monotonic() - started:.1f} s")  # noqa: T201 - for the report
        yield proxy, output
    finally:
        stop_process_group(proc)
        log.close()


def jsonl(records) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def chat(custom_id: str, content: str) -> dict:
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": content}]}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def batch_round_trip(sdk: openai.OpenAI, tag: str) -> dict:
    """Upload, create, poll to the end, download: the results by custom_id."""
    records = [chat(f"{tag}-{i}", f"question {i} for {tag}") for i in range(3)]
    uploaded = sdk.files.create(file=(f"{tag}.jsonl", jsonl(records)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(records)), uploaded
    batch = sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status in ("validating", "in_progress"), batch

    def ended():
        b = sdk.batches.retrieve(batch.id)
        return b if b.status in ("completed", "failed", "expired", "cancelled") else None

    done = wait_for(ended, 60, interval=0.3, what=f"batch {batch.id} ({tag}) to end")
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed) == (3, 3), done
    lines = [json.loads(line) for line in sdk.files.content(done.output_file_id).text.splitlines()]
    results = {line["custom_id"]: line for line in lines}
    assert set(results) == {r["custom_id"] for r in records}
    for record in records:
        response = results[record["custom_id"]]["response"]
        assert response["status_code"] == 200
        assert record["body"]["messages"][0]["content"] in response["body"]["choices"][0]["message"]["content"]
    return results


def test_litellm_proxy_forwards_files_and_batches_under_either_prefix(web, worker, litellm_proxy, catalog, fake):
    assert worker.alive(), worker.output()
    url, log = web
    proxy, proxy_output = litellm_proxy
    started = time.monotonic()
    for model, prefix in PREFIXES.items():
        mark = log.stat().st_size
        with openai.OpenAI(
            base_url=proxy + "/v1", api_key=MASTER_KEY, max_retries=0, default_headers={"x-litellm-model": model}
        ) as sdk:
            try:
                batch_round_trip(sdk, model)
            except (openai.APIError, AssertionError) as e:
                raise AssertionError(f"{model} ({prefix}): {e}\n--- LiteLLM ---\n{proxy_output()}") from e
        calls = [line.split('"')[1] for line in access_lines(log, mark)]
        # LiteLLM called the relay under this deployment's prefix, and nothing under the other.
        for call in ("POST {}/files ", "POST {}/batches ", "GET {}/batches/batch_", "GET {}/files/file-"):
            assert any(c.startswith(call.format(prefix)) for c in calls), (prefix, call, calls)
        other = "/v1/" if prefix == "/openai/v1" else "/openai/"
        assert not [c for c in calls if c.split(" ")[1].startswith(other)], (prefix, calls)

    # No model named: LiteLLM sends the upload with `files_settings` (under /openai/v1 here) and the batch
    # calls with the first `openai` deployment's credentials (relay-v1, under /v1): a file uploaded under
    # one prefix is a batch's input under the other, as the relay serves the same objects under both.
    mark = log.stat().st_size
    with openai.OpenAI(base_url=proxy + "/v1", api_key=MASTER_KEY, max_retries=0) as sdk:
        try:
            batch_round_trip(sdk, "fallback")
        except (openai.APIError, AssertionError) as e:
            raise AssertionError(f"fallback: {e}\n--- LiteLLM ---\n{proxy_output()}") from e
    calls = [line.split('"')[1] for line in access_lines(log, mark)]
    assert any(c.startswith("POST /openai/v1/files ") for c in calls), calls
    assert any(c.startswith("POST /v1/batches ") for c in calls), calls

    # The relay ran them: three batches, nine items billed to the relay key's service account.
    assert Batch.objects.count() == 3
    assert UsageEvent.objects.exclude(batch_id="").count() == 9

    # And the proxy streams chat through the relay, with usage recorded.
    with openai.OpenAI(base_url=proxy + "/v1", api_key=MASTER_KEY, max_retries=0) as sdk:
        chunks = list(
            sdk.chat.completions.create(
                model="relay-openai-v1", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
            )
        )
    want = canned("/v1/chat/completions", {"model": "gpt-4o", "messages": MESSAGES})
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == want["choices"][0]["message"]["content"]
    )
    usage = next(c.usage for c in reversed(chunks) if c.usage)
    assert usage.prompt_tokens == want["usage"]["prompt_tokens"]
    wait_for(
        lambda: UsageEvent.objects.filter(batch_id="").exists(), 10, interval=0.05, what="the stream's usage event"
    )
    live = UsageEvent.objects.get(batch_id="")
    tokens = (want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"])
    assert (live.input_tokens, live.output_tokens) == tokens
    print(f"three batch round trips and a stream through the LiteLLM proxy: {time.monotonic() - started:.1f} s")  # noqa: T201
