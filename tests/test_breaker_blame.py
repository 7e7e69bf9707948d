"""Faults are scored to the tenant that caused them, over real HTTP: relay (live server) → fake provider
(loopback), two service accounts on one policy with a single host key.

A read timeout (a generation that outlives RELAY_UPSTREAM_READ_TIMEOUT) or a connection dropped after the
request was sent can be the request's doing: it scores the principal that sent it, and the key stays
open for the others. A connection refused cannot be: it benches the key for everyone
(policies.breaker.RULES, docs/capacity.md). Live calls, streams, batch items run in the relay and provider
batch jobs all score through that one table."""

import io
import json
import socket
import socketserver
import threading

import pytest
import requests
from django.test import override_settings

from batches import ingest
from batches.lifecycle import claim as claims
from batches.models import Item
from batches.provider import jobs
from batches.provider.models import JobStatus, ProviderJob
from batches.surfaces.native import read as native_read
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import validation
from batches.worker import execute
from core import auth
from core.crypto import sha256_hex
from core.models import HostBinding
from devkit.upstream import Reply
from policies import breaker
from policies.models import PolicyHostKey
from tests.test_tenant_isolation import _wait_for_event, chat, two_tenants
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

SLOW = "<a-generation-that-runs-long>"
KEY = sha256_hex("upstream-openai-0")[:12]
# Short enough for a test, long enough that an ordinary answer of the fake comes well within it.
READ_TIMEOUT = 1.0


@pytest.fixture
def tenants(live_server, catalog, fake):
    # One host key on the policy: what one tenant does to it, every tenant meets.
    PolicyHostKey.objects.filter(policy=catalog.policy).exclude(host_key=catalog.keys[0]).delete()
    return two_tenants(live_server, catalog)


def test_one_tenants_read_timeouts_do_not_bench_the_shared_key_for_another(tenants, fake):
    # The measurement: 3 of A's calls time out at the provider, then B's next 5 calls on the same key.
    fake.answer_when(SLOW, Reply(delay=READ_TIMEOUT + 2))
    with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
        for i in range(3):
            resp = tenants.post(tenants.a, f"{SLOW} {i}")
            assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error", resp.text
        assert breaker.snapshot(KEY)["state"] == "closed"
        assert breaker.suspects(KEY) == [tenants.tag_a]  # A's timeouts are scored against A
        answers = [tenants.post(tenants.b, f"hello {i}") for i in range(5)]
    assert [r.status_code for r in answers] == [200] * 5, [r.text for r in answers]
    assert breaker.suspects(KEY) == []  # B's success cleared A's score


def test_a_live_call_that_outlives_the_read_timeout_is_not_tried_on_another_key(live_server, catalog, fake):
    # Two keys on the policy: a generation that outlives the read timeout would run (and bill the operator)
    # once per key if the call failed over; it is sent once, and the caller gets its 502.
    assert PolicyHostKey.objects.filter(policy=catalog.policy).count() >= 2
    fake.answer_when(SLOW, Reply(delay=READ_TIMEOUT + 2))
    with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
        resp = requests.post(
            live_server.url + "/v1/chat/completions",
            json=chat(SLOW),
            headers={"Authorization": f"Bearer {catalog.key}"},
            timeout=30,
        )
        _wait_for_event(resp)
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error", resp.text
    assert len([r for r in fake.received if SLOW in json.dumps(r["body"])]) == 1


def test_read_timeouts_of_two_tenants_within_the_window_bench_the_key_for_everyone(tenants, fake):
    fake.answer_when(SLOW, Reply(delay=READ_TIMEOUT + 2))
    with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
        assert tenants.post(tenants.a, SLOW).status_code == 502
        assert breaker.snapshot(KEY)["state"] == "closed"
        assert tenants.post(tenants.b, SLOW).status_code == 502
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["reason"]) == ("open", "upstream_network_error")
    resp = tenants.post(tenants.a, "hello")
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_keys"


def test_a_stream_that_goes_quiet_past_the_read_timeout_scores_its_principal_only(tenants, fake):
    gate = threading.Event()  # never opened: the provider stops after its first content event
    fake.script("*", [Reply(stream_gate=gate)])
    try:
        with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
            with requests.post(
                tenants.url + "/v1/chat/completions",
                json=dict(chat("a long answer"), stream=True),
                headers={"Authorization": f"Bearer {tenants.a}"},
                stream=True,
                timeout=30,
            ) as resp:
                assert resp.status_code == 200
                body = b"".join(resp.iter_content(None))
            _wait_for_event(resp)
    finally:
        gate.set()
    assert b"[DONE]" not in body  # it broke before its end
    event = UsageEvent.objects.get(request_id=resp.headers["X-Relay-Request-ID"])
    assert event.error_kind == "upstream_stream_broken"
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.suspects(KEY) == [tenants.tag_a]
    assert [tenants.post(tenants.b, f"hello {i}").status_code for i in range(3)] == [200] * 3


class _HangUp(socketserver.BaseRequestHandler):
    """Accepts the connection, reads the request, closes without an answer: a drop after the request was sent."""

    def handle(self):
        self.request.recv(65536)
        self.request.shutdown(socket.SHUT_RDWR)


def test_a_connection_dropped_after_sending_scores_the_principal_only(tenants, catalog, fake):
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _HangUp)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    host = catalog.hosts["openai"]
    good_url = host.base_url
    try:
        host.base_url = f"http://127.0.0.1:{server.server_address[1]}"
        host.save()
        resp = tenants.post(tenants.a, "hello")
        assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_error"
    finally:
        server.shutdown()
        server.server_close()
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.suspects(KEY) == [tenants.tag_a]
    host.base_url = good_url
    host.save()
    assert tenants.post(tenants.b, "hello").status_code == 200


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once the socket is closed: connect is refused


def test_a_connect_refused_benches_the_key_for_everyone(tenants, catalog, fake):
    host = catalog.hosts["openai"]
    host.base_url = f"http://127.0.0.1:{_closed_port()}"
    host.save()
    resp = tenants.post(tenants.a, "hello")  # one principal, one request
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream_unreachable"
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["reason"]) == ("open", "upstream_unreachable")
    assert breaker.suspects(KEY) == []  # nobody's fault: no principal is blamed
    resp = tenants.post(tenants.b, "hello")  # another tenant: the key is benched for it too
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_keys"
    assert fake.received == []


def _run_batch(principal, contents: list[str]):
    body = {"shape": "openai", "requests": [chat(c) for c in contents]}
    batch = submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))
    while (item := claims.claim("breaker-blame")) is not None:
        execute.run_item(item)
    return batch


def test_a_batchs_timed_out_records_score_their_owner_and_bench_nobody(tenants, catalog, fake):
    fake.answer_when(SLOW, Reply(delay=READ_TIMEOUT + 2))
    principal = auth.principal_for_key(catalog.key)
    with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
        batch = _run_batch(principal, [f"{SLOW} {i}" for i in range(2)])
    assert {(i.state, i.error_code) for i in Item.objects.filter(batch_id=batch.id)} == {
        ("discarded", "upstream_error")
    }
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.suspects(KEY) == [tenants.tag_a]
    assert [tenants.post(tenants.b, f"hello {i}").status_code for i in range(3)] == [200] * 3


def test_a_native_result_names_a_transport_failure_by_its_code_first(tenants, catalog, fake):
    """As the OpenAI and Anthropic surfaces carry it (the record's `code`), the native result's error text
    starts with the code: `upstream_unreachable: …`, `upstream_error: …` for a connection that broke."""
    principal = auth.principal_for_key(catalog.key)
    fake.answer_when(SLOW, Reply(delay=READ_TIMEOUT + 2))
    fake.answer_when("<bad>", Reply(status=400, body={"error": {"message": "bad request"}}))
    with override_settings(RELAY_UPSTREAM_READ_TIMEOUT=READ_TIMEOUT):
        broke = _run_batch(principal, [SLOW, "fine", "<bad>"])
    breaker.record_success(KEY)
    host = catalog.hosts["openai"]
    host.base_url = f"http://127.0.0.1:{_closed_port()}"
    host.save()
    unreachable = _run_batch(principal, ["hello"])

    def results(batch):
        return json.loads(b"".join(native_read.iter_results_json(batch)))["results"]

    [result] = results(unreachable)
    assert result["state"] == "discarded"
    assert result["error"].startswith("upstream_unreachable: the upstream provider could not be reached"), result
    slow, fine, bad = results(broke)
    assert slow["error"].startswith("upstream_error: the connection to the upstream provider broke"), slow
    assert fine["state"] == "completed" and "error" not in fine
    # An answer the provider gave keeps the spec's text, its status beside it.
    assert (bad["error"], bad["status_code"]) == ("batch item: upstream status 400", 400)


# --- provider batch jobs score through the same table ------------------------------------------------


@pytest.fixture
def provider_mode(catalog, fake, settings):
    settings.RELAY_PROVIDER_POLL_SECONDS = 0
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0
    fake.batches.job_seconds = 0.3
    HostBinding.objects.update(batch_mode="provider")
    return fake.batches


def _openai_job(catalog) -> ProviderJob:
    principal = auth.principal_for_key(catalog.key)
    record = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": chat("hello")}
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [record]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50_000) as submission:
        batch = openai_create.create(principal, submission)
    validation.validate(batch.id)
    return ProviderJob.objects.get(batch_id=batch.pk)


def test_a_provider_jobs_create_dropped_after_sending_scores_the_batchs_owner_only(tenants, catalog, provider_mode):
    provider_mode.drop_create_answers(1, "openai")
    job = _openai_job(catalog)
    jobs.advance(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.SUBMITTING and job.upstream_id == ""  # looked for later, never sent twice
    assert breaker.snapshot(KEY)["state"] == "closed"
    assert breaker.suspects(KEY) == [tenants.tag_a]
    assert tenants.post(tenants.b, "hello").status_code == 200


def test_a_provider_jobs_upload_refused_at_connect_benches_the_key_for_everyone(tenants, catalog, provider_mode):
    job = _openai_job(catalog)
    host = catalog.hosts["openai"]
    host.base_url = f"http://127.0.0.1:{_closed_port()}"
    host.save()
    jobs.advance(job.pk)
    job.refresh_from_db()
    assert job.status == JobStatus.PENDING and "sending the job failed" in job.last_error
    snap = breaker.snapshot(KEY)
    assert (snap["state"], snap["reason"]) == ("open", "upstream_unreachable")
