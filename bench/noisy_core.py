"""The noisy-neighbour drill's core: two tenants on one catalog, what each does, and what counts as contained.
bench/noisy.py runs it twice against a stack it starts (B alone, then A attacking) and prints the table;
tests/test_noisy_neighbour.py runs the attacked round against the suite's processes and asserts its counts.

Both tenants are projects of their own, with their own policy and relay keys, on the same models and the same
host keys (two OpenAI keys, one Anthropic key): the operator's shared account. Tenant A does its worst, each
attack from a service account of its own so its usage events are told apart:
- hooks:   WEBHOOK_ENDPOINTS endpoints on a loopback server that accepts and never answers, then HOOK_BATCHES
           one-record batches ending (each end a delivery per endpoint), and one `…/test` of an endpoint;
- slow:    SLOW_CALLS calls at a time, all through B's run, that the provider thinks about for longer than
           RELAY_UPSTREAM_READ_TIMEOUT;
- stream:  STREAMS streamed chat calls hung up after HANG_UP_AFTER content chunks;
- batch:   PROVIDER_BATCHES OpenAI batches of PROVIDER_RECORDS records on a provider-mode binding, from a
           service account whose budget is $0;
- headers: OpenAI-Organization, OpenAI-Project and anthropic-beta of its own choosing, on live calls and on
           its provider batches.
Tenant B runs LIVE_CALLS live calls one after another while one OpenAI, one Anthropic and one native batch
(BATCH_RECORDS records each) run.

The process running this has Django set up on the relay's database (the drill's stack, or the test's).
"""

import contextlib
import json
import socket
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field

import requests

from bench.noisy_upstream import SLOW_MARKER, STREAM_MARKER

WEBHOOK_ENDPOINTS = 40
HOOK_BATCHES = 3
SLOW_CALLS = 3
STREAMS = 3
HANG_UP_AFTER = 2
PROVIDER_BATCHES = 3
PROVIDER_RECORDS = 5
LIVE_CALLS = 40
BATCH_RECORDS = 2
# What B's batches may take with A attacking: the bound, 1.5x the quiet run and never under 10 s.
BATCH_RATIO, BATCH_FLOOR_S = 1.5, 10.0
# B's live p50 with A attacking: within 20% of the quiet run (printed; the machine's noise decides it too).
P50_RATIO = 1.2
STREAM_TOLERANCE = 0.25
TEST_ANSWER_BOUND_S = 5.0  # a delivery's timeout is 10 s: `test` must not hold a web thread that long
A_HEADERS = {
    "OpenAI-Organization": "org-tenant-a-steers",
    "OpenAI-Project": "proj_tenant_a_steers",
}
A_BETAS = "context-1m-2025-08-07,mcp-client-2025-04-04"
# Everything the drill's processes need besides the stack's own settings: a short read timeout (a slow answer
# is seen in seconds), loopback webhook endpoints allowed, provider jobs polled often.
DRILL_ENV = {
    "RELAY_UPSTREAM_READ_TIMEOUT": "2",
    "RELAY_WEBHOOK_ALLOWED_HOSTS": "127.0.0.1",
    "RELAY_PROVIDER_POLL_SECONDS": "0.5",
    "RELAY_PROVIDER_POLL_MAX_SECONDS": "1",
}
CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello from tenant b"}], "max_tokens": 16}
END_EVENTS = ["batch.completed", "batch.failed", "batch.expired", "batch.cancelled", "message_batch.ended"]


# --- the catalog: two tenants on shared host keys ------------------------------------------------------


@dataclass
class Tenants:
    b: str  # tenant B's relay key
    a: dict  # tenant A's relay keys by attack: hooks, slow, stream, batch, headers
    a_batch_sa: int
    a_batch_budget_nanos: int


def seed(upstream_url: str) -> Tenants:
    """The catalog through the ORM (as `relay apply` leaves it): one OpenAI and one Anthropic host on the fake,
    gpt-4o and claude-sonnet run by the relay, gpt-4o-batch sent to the provider's batch API, two OpenAI host
    keys and one Anthropic key shared by both tenants' policies."""
    from core.models import Host, HostBinding, HostKey, LLMModel, Pricing, Project, ServiceAccount, Team
    from core.services import create_relay_key
    from policies.models import Policy, PolicyHostKey
    from usage.models import Budget, Period

    openai = Host.objects.create(name="openai", base_url=upstream_url)
    anthropic = Host.objects.create(name="anthropic", base_url=upstream_url)
    gpt_price = Pricing.objects.create(
        name="gpt-4o", input_nanos_per_mtok=2_500_000_000, output_nanos_per_mtok=10_000_000_000
    )
    claude_price = Pricing.objects.create(
        name="claude-sonnet", input_nanos_per_mtok=3_000_000_000, output_nanos_per_mtok=15_000_000_000
    )
    gpt = LLMModel.objects.create(name="gpt-4o", provider="openai")
    HostBinding.objects.create(model=gpt, host=openai, adapter="openai", upstream_name="gpt-4o", pricing=gpt_price)
    claude = LLMModel.objects.create(name="claude-sonnet", provider="anthropic")
    HostBinding.objects.create(
        model=claude, host=anthropic, adapter="anthropic", upstream_name="claude-sonnet-4", pricing=claude_price
    )
    delegated = LLMModel.objects.create(name="gpt-4o-batch", provider="openai")
    HostBinding.objects.create(
        model=delegated, host=openai, adapter="openai", upstream_name="gpt-4o", pricing=gpt_price, batch_mode="provider"
    )
    keys = []
    for name, host, value in (
        ("openai-0", openai, "sk-shared-openai-0"),
        ("openai-1", openai, "sk-shared-openai-1"),
        ("anthropic-0", anthropic, "sk-ant-shared-0"),
    ):
        key = HostKey(name=name, host=host)
        key.set_value(value)
        key.save()
        keys.append(key)

    def tenant(name: str, accounts: list[str]) -> dict:
        team = Team.objects.create(name=f"team-{name}")
        project = Project.objects.create(name=f"tenant-{name}", team=team)
        policy = Policy.objects.create(name=f"policy-{name}", project=project, grants=["*"])
        for position, key in enumerate(keys):
            PolicyHostKey.objects.create(policy=policy, host_key=key, position=position)
        out = {}
        for account in accounts:
            sa = ServiceAccount.objects.create(project=project, name=account, policy=policy)
            out[account] = (sa, create_relay_key(service_account=sa, name=account)[1])
        return out

    b = tenant("b", ["app"])
    a = tenant("a", ["hooks", "slow", "stream", "batch", "headers"])
    budget = Budget.objects.create(name="tenant-a-batch", service_account=a["batch"][0], usd_nanos=0, period=Period.DAY)
    return Tenants(
        b=b["app"][1],
        a={k: v[1] for k, v in a.items()},
        a_batch_sa=a["batch"][0].pk,
        a_batch_budget_nanos=budget.usd_nanos,
    )


# --- a webhook receiver that accepts and never answers --------------------------------------------------


class DeadReceiver:
    """Accepts every connection and never reads or answers: the worst a tenant's endpoint can be."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1024)
        self.held: list[socket.socket] = []
        self.accepted = 0
        self.stopped = False
        self.thread = threading.Thread(target=self._accept, name="dead-receiver", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/hook"

    def _accept(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            self.accepted += 1

    def stop(self) -> None:
        self.stopped = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        for conn in self.held:
            with contextlib.suppress(OSError):
                conn.close()


# --- the calls -----------------------------------------------------------------------------------------


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _jsonl(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def openai_batch(url: str, key: str, model: str, n: int, tag: str, headers: dict | None = None) -> str:
    """Upload a JSONL file and create an OpenAI-surface batch; returns the batch id."""
    records = [
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {**CHAT, "model": model, "messages": [{"role": "user", "content": f"{tag} record {i}"}]},
        }
        for i in range(n)
    ]
    auth = {**_auth(key), **(headers or {})}
    up = requests.post(
        f"{url}/v1/files", files={"file": ("in.jsonl", _jsonl(records))}, data={"purpose": "batch"}, headers=auth
    )
    up.raise_for_status()
    body = {"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = requests.post(f"{url}/v1/batches", json=body, headers=auth, timeout=60)
    created.raise_for_status()
    return created.json()["id"]


def anthropic_batch(url: str, key: str, n: int, tag: str) -> str:
    params = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": tag}]}
    body = {"requests": [{"custom_id": f"{tag}-{i}", "params": params} for i in range(n)]}
    resp = requests.post(f"{url}/v1/messages/batches", json=body, headers={"x-api-key": key}, timeout=60)
    resp.raise_for_status()
    return resp.json()["id"]


def native_batch(url: str, key: str, n: int, tag: str) -> str:
    chat = {**CHAT, "messages": [{"role": "user", "content": tag}]}
    resp = requests.post(f"{url}/v1/batches", json={"shape": "openai", "requests": [chat] * n}, headers=_auth(key))
    resp.raise_for_status()
    return resp.json()["id"]


def batch_pk(public_id: str) -> uuid.UUID:
    for prefix in ("batch_", "msgbatch_"):
        if public_id.startswith(prefix):
            return uuid.UUID(hex=public_id.removeprefix(prefix))
    return uuid.UUID(public_id)


# --- tenant B -------------------------------------------------------------------------------------------


@dataclass
class BFigures:
    live_ms: list = field(default_factory=list)
    refused: list = field(default_factory=list)  # (status, error code) of every live call not answered 200
    batch_s: dict = field(default_factory=dict)  # surface -> seconds from creation to completed (None: not)
    batch_status: dict = field(default_factory=dict)
    items_failed: int = 0  # B's batch records that ended without an answer (discarded, cancelled)
    bench_events: int = 0  # B's usage events refused for want of a host key (no_keys, a benched key)

    @property
    def p50_ms(self) -> float | None:
        return statistics.median(self.live_ms) if self.live_ms else None


def run_b(url: str, key: str, wait_s: float) -> BFigures:
    """B's three batches, then its live calls one after another while they run; then at most `wait_s` for the
    batches to complete. Times are the relay's own (created_at → completed_at)."""
    from django.utils import timezone

    from batches.models import Batch, BatchStatus, Item

    figures = BFigures()
    since = timezone.now()
    ids = {
        "openai": openai_batch(url, key, "gpt-4o", BATCH_RECORDS, "b-openai"),
        "anthropic": anthropic_batch(url, key, BATCH_RECORDS, "b-anthropic"),
        "native": native_batch(url, key, BATCH_RECORDS, "b-native"),
    }
    pks = {surface: batch_pk(public) for surface, public in ids.items()}
    with requests.Session() as http:
        for i in range(LIVE_CALLS):
            chat = {**CHAT, "messages": [{"role": "user", "content": f"tenant b live call {i}"}]}
            t0 = time.perf_counter()
            resp = http.post(f"{url}/v1/chat/completions", json=chat, headers=_auth(key), timeout=60)
            figures.live_ms.append((time.perf_counter() - t0) * 1000)
            if resp.status_code != 200:
                figures.refused.append((resp.status_code, _code(resp)))
    deadline = time.monotonic() + wait_s
    while True:
        rows = {b.pk: b for b in Batch.objects.filter(pk__in=pks.values())}
        done = all(rows[pk].completed_at is not None for pk in pks.values())
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for surface, pk in pks.items():
        b = rows[pk]
        figures.batch_status[surface] = b.status
        ok = b.completed_at is not None and b.status == BatchStatus.COMPLETED
        figures.batch_s[surface] = (b.completed_at - b.created_at).total_seconds() if ok else None
    figures.items_failed = Item.objects.filter(batch_id__in=pks.values(), state__in=("discarded", "cancelled")).count()
    figures.bench_events = _no_keys_events("tenant-b", since)
    return figures


def run_b_batches_once(url: str, key: str, wait_s: float = 60.0) -> None:
    """One small native batch, waited for (a warm-up: the workers load their code)."""
    from batches.models import Batch

    pk = batch_pk(native_batch(url, key, BATCH_RECORDS, "warm-up"))
    deadline = time.monotonic() + wait_s
    while Batch.objects.get(pk=pk).completed_at is None and time.monotonic() < deadline:
        time.sleep(0.25)


def _code(resp) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return resp.json()["error"].get("code") or resp.json()["error"].get("type") or ""
    return ""


def _no_keys_events(project: str, since) -> int:
    """The project's calls and records refused because no host key could be used (benched or cooling down)."""
    from usage.models import UsageEvent

    return UsageEvent.objects.filter(project=project, error_kind="no_keys", ts__gte=since).count()


# --- tenant A -------------------------------------------------------------------------------------------


@dataclass
class AFigures:
    endpoints_created: int = 0
    endpoint_ids: list = field(default_factory=list)
    endpoints_refused: list = field(default_factory=list)
    hook_batches: list = field(default_factory=list)
    test_answer_s: float | None = None
    test_status: int | None = None
    slow_statuses: list = field(default_factory=list)
    stream_ids: dict = field(default_factory=dict)  # tag -> the relay's request id
    stream_chunks_read: dict = field(default_factory=dict)
    header_statuses: list = field(default_factory=list)
    slow_rounds: int = 0
    provider_batches: list = field(default_factory=list)
    errors: list = field(default_factory=list)


def a_register_hooks(url: str, keys: dict, receiver: DeadReceiver, a: AFigures) -> None:
    for i in range(WEBHOOK_ENDPOINTS):
        body = {"url": receiver.url, "name": f"dead-{i}", "event_types": END_EVENTS}
        resp = requests.post(f"{url}/v1/webhook_endpoints", json=body, headers=_auth(keys["hooks"]), timeout=60)
        if resp.status_code == 200:
            a.endpoints_created += 1
            a.endpoint_ids.append(resp.json()["id"])
        else:
            a.endpoints_refused.append((resp.status_code, _code(resp)))


def a_end_batches(url: str, keys: dict, a: AFigures) -> None:
    for i in range(HOOK_BATCHES):
        a.hook_batches.append(native_batch(url, keys["hooks"], 1, f"a-hook-end-{i}"))


def a_test_endpoint(url: str, keys: dict, a: AFigures) -> None:
    ids = a.endpoint_ids
    if not ids:
        return
    t0 = time.perf_counter()
    try:
        resp = requests.post(
            f"{url}/v1/webhook_endpoints/{ids[0]}/test",
            json={"event_type": "batch.completed"},
            headers=_auth(keys["hooks"]),
            timeout=60,
        )
        a.test_status = resp.status_code
    except requests.RequestException as exc:
        a.errors.append(f"test: {exc}")
    a.test_answer_s = time.perf_counter() - t0


def a_slow_calls(url: str, keys: dict, a: AFigures, stop: threading.Event, first_round: threading.Event) -> None:
    """SLOW_CALLS calls in flight at all times, each one the provider never answers in time, until `stop`.
    `first_round` is set once SLOW_CALLS of them have come back (a bench, if any, is then in place)."""

    def one(i: int) -> None:
        chat = {**CHAT, "messages": [{"role": "user", "content": f"{SLOW_MARKER} think long {i}"}]}
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                resp = requests.post(f"{url}/v1/chat/completions", json=chat, headers=_auth(keys["slow"]), timeout=120)
                a.slow_statuses.append((resp.status_code, _code(resp)))
            except requests.RequestException as exc:
                a.errors.append(f"slow call: {exc}")
                return
            if len(a.slow_statuses) >= SLOW_CALLS:
                a.slow_rounds = len(a.slow_statuses) // SLOW_CALLS
                first_round.set()
            # Refused at once (a benched key): a tenant's client backs off a little, it does not spin.
            stop.wait(max(0.0, 0.5 - (time.monotonic() - t0)))

    threads = [threading.Thread(target=one, args=(i,), name=f"slow-{i}") for i in range(SLOW_CALLS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def hung_up_stream(url: str, key: str, body: dict, after: int) -> tuple[str | None, int]:
    """POST a streamed call on a plain socket, read `after` content chunks, then close the connection as a
    client process that exits does. Returns (the relay's request id, content chunks read)."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    sock = socket.create_connection((host, int(port)), timeout=60)
    try:
        sock.sendall(head.encode() + payload)
        buf, request_id, read = b"", None, 0
        while b"\r\n\r\n" not in buf:
            data = sock.recv(65536)
            if not data:
                return None, 0
            buf += data
        headers, buf = buf.split(b"\r\n\r\n", 1)
        for line in headers.decode(errors="replace").split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "x-request-id":
                request_id = value.strip()
        while read < after:
            *lines, buf = buf.split(b"\n")  # whole lines only; a partial one waits for the next read
            read += sum(1 for line in lines if line.startswith(b"data: {") and _has_content(line))
            if read >= after:
                break
            data = sock.recv(65536)
            if not data:
                break
            buf += data
        return request_id, read
    finally:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()


def _has_content(line: bytes) -> bool:
    with contextlib.suppress(ValueError, KeyError, IndexError, TypeError):
        return bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
    return False


def a_streams(url: str, keys: dict, a: AFigures) -> None:
    """Streamed calls read for HANG_UP_AFTER content chunks, then the connection closed."""
    for i in range(STREAMS):
        tag = f"{STREAM_MARKER}-{i}"
        prompt = [{"role": "user", "content": f"{tag} tell a long story"}]
        try:
            rid, read = hung_up_stream(
                url, keys["stream"], {"model": "gpt-4o", "stream": True, "messages": prompt}, HANG_UP_AFTER
            )
        except OSError as exc:
            a.errors.append(f"stream {tag}: {exc!r}")
            continue
        a.stream_ids[tag] = rid
        a.stream_chunks_read[tag] = read


def a_steer_headers(url: str, keys: dict, a: AFigures) -> None:
    chat = {**CHAT, "messages": [{"role": "user", "content": "bill my neighbour's project"}]}
    resp = requests.post(
        f"{url}/v1/chat/completions", json=chat, headers={**_auth(keys["headers"]), **A_HEADERS}, timeout=60
    )
    a.header_statuses.append(("chat", resp.status_code))
    message = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "beta please"}]}
    headers = {"x-api-key": keys["headers"], "anthropic-version": "2023-06-01", "anthropic-beta": A_BETAS}
    resp = requests.post(f"{url}/v1/messages", json=message, headers=headers, timeout=60)
    a.header_statuses.append(("messages", resp.status_code))


def a_provider_batches(url: str, keys: dict, a: AFigures) -> None:
    """Provider-mode batches from the account whose budget is $0, sent with A's own provider headers."""
    for i in range(PROVIDER_BATCHES):
        try:
            a.provider_batches.append(
                openai_batch(url, keys["batch"], "gpt-4o-batch", PROVIDER_RECORDS, f"a-provider-{i}", A_HEADERS)
            )
        except requests.RequestException as exc:
            a.errors.append(f"provider batch {i}: {exc}")


# --- the rounds -----------------------------------------------------------------------------------------


def quiet_round(url: str, tenants: Tenants, wait_s: float = 60.0) -> BFigures:
    return run_b(url, tenants.b, wait_s)


def attacked_round(url: str, tenants: Tenants, receiver: DeadReceiver, wait_s: float = 90.0):
    """A's attacks, then B's workload while A's slow calls go on (and its `test`). A's steering calls and
    streams come before its slow calls: a key its slow calls benched would refuse them, and a call that never
    reaches the provider shows nothing about what reaches it. Returns (B, A)."""
    a = AFigures()
    keys = tenants.a
    a_register_hooks(url, keys, receiver, a)
    a_end_batches(url, keys, a)
    a_provider_batches(url, keys, a)
    a_steer_headers(url, keys, a)
    a_streams(url, keys, a)
    stop, first_round = threading.Event(), threading.Event()
    slow = threading.Thread(target=a_slow_calls, args=(url, keys, a, stop, first_round), name="a-slow")
    slow.start()
    first_round.wait(60)
    tester = threading.Thread(target=a_test_endpoint, args=(url, keys, a), name="a-test")
    tester.start()
    try:
        b = run_b(url, tenants.b, wait_s)
    finally:
        stop.set()
        slow.join()
        tester.join()
    return b, a
