"""Embedded mode end to end: the stack `make run` starts (`python -m relay.embedded`: SQLite, the embedded
redis-server, the demo upstream, gunicorn, the item worker, the control worker and beat), driven over HTTP
on the three batch surfaces — the native API, the official `openai` SDK and the official `anthropic` SDK:
batches to their final state with the demo upstream's canned replies, cancels while items are pending,
and batches whose completion window closes. The rest of the suite runs on PostgreSQL; this module is the
one that runs the SQLite paths of the lifecycle (claim, finish, stop, dispatch, the worker).

Isolation: the launcher keeps its state in `<checkout>/.relay-embedded` (relay/embedded.py, devkit/demo.py
and the settings' SQLite default all derive it from the source tree), so the stack runs from a temporary
copy of the source packages: its database, secrets, demo key, payloads, beat schedule and gunicorn
control socket go to that copy's `.relay-embedded`, never to the checkout's (a developer's `make run`
state stays untouched). It gets free ports of its own, and none of the suite's DATABASE_URL, REDIS_URL,
CELERY_*, secrets or RELAY_* settings: it never touches the test PostgreSQL or the test Redis.

Short windows come from the environment of the embedded process: RELAY_BATCH_COMPLETION_WINDOW_SECONDS,
RELAY_BATCH_SWEEP_SECONDS and RELAY_BATCH_HEARTBEAT_SECONDS. Requests holding SLOW wait a minute in the
demo upstream (RELAY_DEMO_UPSTREAM_DELAY_MS / RELAY_DEMO_UPSTREAM_DELAY_MATCH): such an item ends only
when a cancel or the window's close stops it, which makes items pending and running observable.
"""

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import anthropic
import openai
import pytest
import redis
import requests

from devkit.upstream import DEMO_BANNER

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
# What the demo upstream holds for a minute (RELAY_DEMO_UPSTREAM_DELAY_MATCH): far longer than this module
# runs, so an item carrying it ends only when a cancel or an expiry stops it.
SLOW = "embedded-tier-slow"
SLOW_MS = 60_000
WINDOW_SECONDS = 8  # RELAY_BATCH_COMPLETION_WINDOW_SECONDS: long enough for a batch of quick items
POLL = 0.2
# The environment variable (only in the stack's environment) that finds every process of the stack.
TAG = "RELAY_EMBEDDED_TIER_RUN"
# Never handed to the stack: the suite's database, Redis, broker, secrets and settings.
_SUITE_ENV = ("DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DEBUG", "LOG_LEVEL")
_SUITE_PREFIXES = ("RELAY_", "CELERY_", "DB_", "DJANGO_", "PYTEST_")


def wait_for(predicate, timeout: float, what: str):
    """predicate()'s first truthy value, polled every POLL seconds; AssertionError after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(POLL)


def canned_answer(prompt: str) -> str:
    """The demo upstream's reply to a one-message prompt (devkit/upstream.py `canned`)."""
    return f"{DEMO_BANNER} you said: {prompt}"


# --- the stack -------------------------------------------------------------------------------------------


def _copy_sources(tree: Path) -> None:
    """The source packages (every top-level directory with an __init__.py but the tests), the demo catalog
    and manage.py: real copies, since the launcher, the settings and the demo seed find the state directory
    from their own resolved path."""
    for entry in ROOT.iterdir():
        if entry.is_dir() and entry.name != "tests" and (entry / "__init__.py").exists():
            shutil.copytree(entry, tree / entry.name)
    shutil.copytree(ROOT / "deploy", tree / "deploy")
    shutil.copy2(ROOT / "manage.py", tree / "manage.py")


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tagged(tag: str) -> list[int]:
    """Every live process started with TAG=tag in its environment: the launcher and all it started,
    whatever session or parent they have now."""
    needle = f"\0{TAG}={tag}\0".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in b"\0" + (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            continue
    return found


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class Stack:
    url: str
    key: str
    redis_port: int
    state_dir: Path
    log_path: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def native(self, method: str, path: str, **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {self.key}"}
        return requests.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.key, max_retries=0, timeout=30)

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key=self.key, max_retries=0, timeout=30)


def _stop(proc: subprocess.Popen, tag: str) -> list[str]:
    """SIGTERM the launcher's process group (it stops each child's group: SIGTERM, up to 15 s, then SIGKILL),
    SIGKILL it if it is still there after 30 s, then SIGKILL whatever of the stack outlived it (each child
    leads a session of its own, so it is not in the launcher's group). Returns what went wrong."""
    problems = []
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        problems.append("the launcher did not stop within 30 s of SIGTERM")
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()
    survivors = _tagged(tag)
    if survivors:
        problems.append(f"processes outlived the launcher: {survivors}")
    deadline = time.monotonic() + 10
    while survivors and time.monotonic() < deadline:
        for pid in survivors:
            try:
                if os.getpgid(pid) != os.getpgid(0):  # never the suite's own group
                    _signal_group(os.getpgid(pid), signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
        survivors = _tagged(tag)
    if survivors:
        problems.append(f"still running after SIGKILL: {survivors}")
    return problems


@pytest.fixture(scope="module")
def stack():
    """`make run`'s stack, from a temporary copy of the sources, on free ports, with short windows; up once
    /healthz answers and the item worker has run a batch. Stopped, every process of it, at the end."""
    tree = Path(tempfile.mkdtemp(prefix="relay-emb-"))
    tag = uuid.uuid4().hex
    api_port, redis_port, demo_port = _free_ports(3)
    env = {k: v for k, v in os.environ.items() if k not in _SUITE_ENV and not k.startswith(_SUITE_PREFIXES)} | {
        TAG: tag,
        "RELAY_EMBEDDED": "1",
        "RELAY_PORT": str(api_port),
        "RELAY_EMBEDDED_REDIS_PORT": str(redis_port),
        "RELAY_DEMO_UPSTREAM_PORT": str(demo_port),
        "RELAY_DEMO_UPSTREAM_DELAY_MS": str(SLOW_MS),
        "RELAY_DEMO_UPSTREAM_DELAY_MATCH": SLOW,
        "RELAY_BATCH_COMPLETION_WINDOW_SECONDS": str(WINDOW_SECONDS),
        "RELAY_BATCH_SWEEP_SECONDS": "1",
        "RELAY_BATCH_HEARTBEAT_SECONDS": "0.5",
    }
    log_path = tree / "embedded.log"
    proc = None
    try:
        with log_path.open("wb") as log:
            _copy_sources(tree)
            proc = subprocess.Popen(
                [sys.executable, "-m", "relay.embedded"],
                cwd=tree,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            state_dir = tree / ".relay-embedded"
            s = Stack(f"http://127.0.0.1:{api_port}", "", redis_port, state_dir, log_path)

            def healthy():
                if proc.poll() is not None:
                    raise AssertionError(f"the launcher exited with {proc.returncode}:\n{s.log_tail()}")
                try:
                    return requests.get(s.url + "/healthz", timeout=2).status_code == 200
                except requests.RequestException:
                    return False

            wait_for(healthy, 120, "the embedded stack's /healthz")
            s.key = (state_dir / "demo-relay-key.txt").read_text().strip()
            # The item worker boots alongside gunicorn: a first batch through it, so the windows below
            # are not spent waiting for a process to start.
            r = s.native("POST", "/v1/batches", json={"shape": "openai", "requests": [chat("warm-up")]})
            assert r.status_code == 202, r.text
            wait_for(lambda: native_status(s, r.json()["id"])["Status"] == "completed", 60, "the warm-up batch")
            yield s
    finally:
        problems = _stop(proc, tag) if proc is not None else []
        shutil.rmtree(tree, ignore_errors=True)
    assert not problems, problems  # reached only when nothing else failed first


def chat(prompt: str) -> dict:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": prompt}]}


def native_status(stack: Stack, batch_id: str) -> dict:
    r = stack.native("GET", f"/v1/batches/{batch_id}")
    assert r.status_code == 200, r.text
    return r.json()


def openai_record(custom_id: str, prompt: str) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": chat(prompt)}


def openai_batch(client: openai.OpenAI, records: list[dict]):
    jsonl = "".join(json.dumps(record) + "\n" for record in records).encode()
    uploaded = client.files.create(file=("requests.jsonl", jsonl), purpose="batch")
    assert uploaded.bytes == len(jsonl) and uploaded.purpose == "batch"
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")


def openai_final(client: openai.OpenAI, batch_id: str, timeout: float):
    def final():
        batch = client.batches.retrieve(batch_id)
        return batch if batch.status in ("completed", "failed", "expired", "cancelled") else None

    return wait_for(final, timeout, f"OpenAI batch {batch_id} to end")


def file_lines(client: openai.OpenAI, file_id: str | None) -> dict:
    """A result file's records by custom_id (none when the batch has no such file)."""
    if file_id is None:
        return {}
    rows = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {row["custom_id"]: row for row in rows}
    assert len(by_id) == len(rows), rows  # every record once
    return by_id


def anthropic_request(custom_id: str, prompt: str) -> dict:
    return {
        "custom_id": custom_id,
        "params": {"model": "claude-3-5-haiku", "max_tokens": 64, "messages": [{"role": "user", "content": prompt}]},
    }


def anthropic_ended(client: anthropic.Anthropic, batch_id: str, timeout: float):
    def ended():
        batch = client.messages.batches.retrieve(batch_id)
        return batch if batch.processing_status == "ended" else None

    return wait_for(ended, timeout, f"Anthropic batch {batch_id} to end")


# --- batches whose window closes: created first, so the window runs out while the other tests run -------


@dataclass
class Expiring:
    openai_id: str
    anthropic_id: str


@pytest.fixture(scope="module", autouse=True)
def expiring(stack) -> Expiring:
    """An OpenAI batch and an Anthropic batch, each with one quick request and one SLOW one: the quick one
    finishes, the slow one is still running when the window closes."""
    oa = openai_batch(
        stack.openai(),
        [openai_record("quick", "expiry quick openai"), openai_record("slow", f"{SLOW} expiry openai")],
    )
    an = stack.anthropic().messages.batches.create(
        requests=[anthropic_request("quick", "expiry quick anthropic"), anthropic_request("slow", f"{SLOW} x")]
    )
    return Expiring(openai_id=oa.id, anthropic_id=an.id)


# --- the stack is the embedded one ----------------------------------------------------------------------


def test_the_stack_keeps_to_its_own_sqlite_redis_and_state_directory(stack):
    from core.redis import get_redis

    r = stack.native("POST", "/v1/batches", json={"shape": "openai", "requests": [chat("where am I stored?")]})
    assert r.status_code == 202, r.text
    batch_id = r.json()["id"]
    wait_for(lambda: native_status(stack, batch_id)["Status"] == "completed", 30, "the native batch to complete")
    # Its rows are in the SQLite file of the stack's own state directory (SQLite keeps UUIDs as hex) ...
    with closing(sqlite3.connect(f"file:{stack.state_dir / 'relay.sqlite3'}?mode=ro", uri=True)) as db:
        row = db.execute(
            "SELECT surface, status, total_items FROM batches_batch WHERE id = ?", [uuid.UUID(batch_id).hex]
        ).fetchone()
    assert row == ("native", "completed", 1)
    # ... its broker is the embedded redis-server, and the suite's Redis (emptied before each test) got nothing.
    assert redis.Redis(port=stack.redis_port).exists("_kombu.binding.batch")
    assert get_redis().dbsize() == 0
    # The key the launcher printed is the one it wrote to the state directory.
    banner = wait_for(lambda: "export RELAY_KEY=" in (text := stack.log_tail(100_000)) and text, 10, "the banner")
    assert f"export RELAY_KEY={stack.key}\n" in banner


# --- to the end, with the demo upstream's replies -------------------------------------------------------


def test_native_batch_completes_with_the_demo_upstreams_replies(stack):
    prompts = [f"native question {i}" for i in range(3)]
    r = stack.native("POST", "/v1/batches", json={"shape": "openai", "requests": [chat(p) for p in prompts]})
    assert r.status_code == 202, r.text
    submitted = r.json()
    assert submitted["status"] == "queued" and submitted["total_items"] == 3
    status = wait_for(
        lambda: (s := native_status(stack, submitted["id"]))["Status"] == "completed" and s,
        30,
        "the native batch to complete",
    )
    assert status["counts"] == {"completed": 3}
    assert status["TotalItems"] == 3 and status["CompletedAt"]
    assert status["items"] == [{"idx": i, "state": "completed"} for i in range(3)]
    r = stack.native("GET", f"/v1/batches/{submitted['id']}/results")
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [row["idx"] for row in results] == [0, 1, 2]
    for row, prompt in zip(results, prompts, strict=True):
        assert row["state"] == "completed" and "error" not in row, row
        assert row["response"]["choices"][0]["message"]["content"] == canned_answer(prompt)
        assert row["response"]["usage"]["prompt_tokens"] == len(prompt.split())


def test_openai_batch_through_the_openai_sdk(stack):
    client = stack.openai()
    prompts = {"q-0": "What is a relay?", "q-1": "Name a prime number.", "q-2": "Say hello."}
    batch = openai_batch(client, [openai_record(cid, prompt) for cid, prompt in prompts.items()])
    assert batch.id.startswith("batch_") and batch.status == "validating"
    batch = openai_final(client, batch.id, 30)
    assert batch.status == "completed", batch
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.error_file_id is None
    output = file_lines(client, batch.output_file_id)
    assert output.keys() == prompts.keys()
    for cid, prompt in prompts.items():
        row = output[cid]
        assert row["error"] is None and row["response"]["status_code"] == 200, row
        assert row["response"]["body"]["choices"][0]["message"]["content"] == canned_answer(prompt)
    # Usage rolled up from the records' usage events: the demo upstream counts words.
    prompt_tokens = sum(len(p.split()) for p in prompts.values())
    answer_tokens = sum(len(canned_answer(p).split()) for p in prompts.values())
    assert batch.usage.input_tokens == prompt_tokens
    assert batch.usage.output_tokens == answer_tokens
    assert batch.usage.total_tokens == prompt_tokens + answer_tokens


def test_anthropic_batch_through_the_anthropic_sdk(stack):
    client = stack.anthropic()
    prompts = {"a-0": "What is a relay?", "a-1": "Name a prime number."}
    batch = client.messages.batches.create(requests=[anthropic_request(c, p) for c, p in prompts.items()])
    assert batch.id.startswith("msgbatch_") and batch.processing_status == "in_progress"
    batch = anthropic_ended(client, batch.id, 30)
    counts = batch.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 2, 0, 0, 0)
    assert batch.ended_at and batch.results_url
    results = {row.custom_id: row.result for row in client.messages.batches.results(batch.id)}
    assert results.keys() == prompts.keys()
    for cid, prompt in prompts.items():
        assert results[cid].type == "succeeded", results[cid]
        assert results[cid].message.content[0].text == canned_answer(prompt)
        assert results[cid].message.usage.input_tokens == len(prompt.split())


def test_provider_batch_mode_in_the_demo(stack):
    """The demo catalog's `gpt-4o-mini-batch` (batch_mode: provider) and `claude-3-5-haiku-batch` (auto) run
    at the demo provider's batch APIs, on SQLite: same results, usage events executed_by the provider."""
    client = stack.openai()
    records = [openai_record("p-0", "What is a relay?"), openai_record("p-1", "Name a prime number.")]
    for record in records:
        record["body"]["model"] = "gpt-4o-mini-batch"
    batch = openai_final(client, openai_batch(client, records).id, 60)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    lines = file_lines(client, batch.output_file_id)
    assert lines["p-0"]["response"]["body"]["choices"][0]["message"]["content"] == canned_answer("What is a relay?")
    a = stack.anthropic()
    request = anthropic_request("c-0", "What is a relay?")
    request["params"]["model"] = "claude-3-5-haiku-batch"
    ended = anthropic_ended(a, a.messages.batches.create(requests=[request]).id, 60)
    assert ended.request_counts.succeeded == 1, ended
    r = stack.native("GET", "/api/usage/events?limit=20")
    ran = {e["model"]: e["executed_by"] for e in r.json()["events"] if e["model"].endswith("-batch")}
    assert ran == {"gpt-4o-mini-batch": "provider", "claude-3-5-haiku-batch": "provider"}, r.json()


# --- cancel while items are pending ---------------------------------------------------------------------


def test_a_native_batch_cancelled_with_items_pending_ends_cancelled(stack):
    # 12 SLOW items and 8 slots: once some run, the others wait; none can finish on its own.
    r = stack.native(
        "POST", "/v1/batches", json={"shape": "openai", "requests": [chat(f"{SLOW} {i}") for i in range(12)]}
    )
    assert r.status_code == 202, r.text
    batch_id = r.json()["id"]
    # On SQLite a claim and its batch's queued → running are two statements (batches/lifecycle/claim.py
    # `_claim_embedded`): a poll between them sees a running item in a queued batch. Wait for both.
    before = wait_for(
        lambda: (s := native_status(stack, batch_id))["counts"].get("running") and s["Status"] == "running" and s,
        30,
        "items of the native batch to run",
    )
    assert before["counts"]["available"] > 0 and sum(before["counts"].values()) == 12, before["counts"]
    r = stack.native("POST", f"/v1/batches/{batch_id}/cancel")
    assert r.status_code == 200 and r.json() == {"status": "cancelled"}, r.text
    # Pending items at once, running ones at their next heartbeat: within 20 s, where the upstream would
    # have held them a minute. CompletedAt is stamped once the last item's finish has committed (its
    # on_commit completion check), so a poll may see every item final just before it.
    after = wait_for(
        lambda: (s := native_status(stack, batch_id))["CompletedAt"] and s,
        20,
        "the cancelled native batch to end",
    )
    assert after["Status"] == "cancelled" and after["counts"] == {"cancelled": 12}
    results = stack.native("GET", f"/v1/batches/{batch_id}/results").json()["results"]
    assert len(results) == 12
    assert all(row["state"] == "cancelled" and "response" not in row for row in results), results


def test_an_openai_batch_cancelled_with_records_pending_ends_cancelled(stack):
    client = stack.openai()
    records = [openai_record(f"c-{i}", f"{SLOW} cancel {i}") for i in range(12)]
    batch = openai_batch(client, records)
    # Once validated, 12 records share at most 8 slots: some must wait. None can finish on its own.
    wait_for(lambda: client.batches.retrieve(batch.id).status == "in_progress", 30, "the batch to be validated")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    assert cancelling.cancelling_at
    batch = openai_final(client, batch.id, 20)  # the running ones stopped: the upstream holds them a minute
    assert batch.status == "cancelled" and batch.cancelled_at, batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (12, 0, 12)
    assert batch.output_file_id is None
    errors = file_lines(client, batch.error_file_id)
    assert errors.keys() == {r["custom_id"] for r in records}
    assert {row["error"]["code"] for row in errors.values()} == {"batch_cancelled"}
    assert all(row["response"] is None for row in errors.values())


# --- the completion window closes -----------------------------------------------------------------------


def test_batches_whose_completion_window_closes_end_expired(stack, expiring):
    # The window is WINDOW_SECONDS; the sweeper (every second) expires the batch, the running SLOW request
    # stops at its next heartbeat, and the batch ends.
    client = stack.openai()
    batch = openai_final(client, expiring.openai_id, WINDOW_SECONDS + 30)
    assert batch.status == "expired", batch
    assert batch.expires_at == batch.created_at + WINDOW_SECONDS
    assert batch.expired_at and batch.expired_at >= batch.expires_at
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (2, 1, 1)
    output, errors = file_lines(client, batch.output_file_id), file_lines(client, batch.error_file_id)
    assert output.keys() == {"quick"} and errors.keys() == {"slow"}
    assert output["quick"]["response"]["body"]["choices"][0]["message"]["content"] == canned_answer(
        "expiry quick openai"
    )
    assert errors["slow"]["error"]["code"] == "batch_expired" and errors["slow"]["response"] is None

    an_client = stack.anthropic()
    an = anthropic_ended(an_client, expiring.anthropic_id, WINDOW_SECONDS + 30)
    counts = an.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 1, 0, 0, 1)
    assert an.ended_at >= an.expires_at
    assert (an.expires_at - an.created_at).total_seconds() == WINDOW_SECONDS
    results = {row.custom_id: row.result for row in an_client.messages.batches.results(an.id)}
    assert results["quick"].type == "succeeded"
    assert results["quick"].message.content[0].text == canned_answer("expiry quick anthropic")
    assert results["slow"].type == "expired"
