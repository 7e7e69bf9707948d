"""Streamed live calls, driven by the providers' own SDKs through the real web server.

gunicorn is started with relay.webserver.gunicorn_argv — the argv of embedded mode and compose — against
the test database; the fake upstream runs in this process and streams each provider's own events.
Every wait is bounded and every socket, thread and process is closed by the test itself.
"""

import json
import socket
import threading
import time

import anthropic
import openai
import pytest
import requests

from devkit.upstream import Reply, canned
from gateway import streaming
from tests import factories
from tests.workers import production_web, wait_for
from usage.models import UsageEvent

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "stream this to me"}]}
MESSAGES = {"model": "claude-sonnet", "max_tokens": 64, "messages": [{"role": "user", "content": "hello claude"}]}
CONCURRENT_STREAMS = 200


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker):
    """The production web server (gunicorn, relay.webserver's argv) on the test database."""
    from django.db import connection

    with production_web(connection.settings_dict, log_prefix="relay-web-stream-") as server:
        yield server.url, server.log


def event_of(request_id: str, timeout: float = 10) -> UsageEvent:
    """A stream's usage event is written by the web worker's writer thread once the stream has ended."""
    wait_for(
        lambda: UsageEvent.objects.filter(request_id=request_id).exists(),
        timeout,
        interval=0.02,
        what=f"the usage event of {request_id}",
    )
    return UsageEvent.objects.get(request_id=request_id)


def expected_usage(path: str, body: dict) -> dict:
    """What the fake upstream reports for this body (its canned answer's usage)."""
    return canned(path, dict(body, model="m"))["usage"]


def sse_data(resp: requests.Response) -> list:
    """The `data:` payloads of a streamed answer, parsed ("[DONE]" kept as is)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:]
            out.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return out


def _post(url: str, path: str, body: dict, key: str, **kwargs) -> requests.Response:
    return requests.post(
        url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30, stream=True, **kwargs
    )


# --- the SDKs ------------------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_openai_sdk_streams_chat_and_usage_is_recorded_from_the_stream(web, catalog, fake):
    url, _ = web
    client = openai.OpenAI(base_url=url + "/v1", api_key=catalog.key, max_retries=0)
    stream = client.chat.completions.create(**CHAT, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == canned("/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]
    assert len(chunks) > 5  # word by word, as the provider sent it
    # The relay asked for usage upstream; the client did not, so the usage-only chunk was not passed on.
    assert fake.received[-1]["body"]["stream_options"] == {"include_usage": True}
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
    request_id = stream.response.headers["x-request-id"]
    usage = expected_usage("/v1/chat/completions", CHAT)
    event = event_of(request_id)
    assert (event.status, event.error_kind, event.model, event.attempts) == (200, "", "gpt-4o", 1)
    assert (event.input_tokens, event.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert event.cost_nano_usd == (usage["prompt_tokens"] * 2_500 + usage["completion_tokens"] * 10_000)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_client_that_asks_for_usage_gets_the_providers_usage_chunk(web, catalog, fake):
    url, _ = web
    client = openai.OpenAI(base_url=url + "/openai/v1", api_key=catalog.key, max_retries=0)
    chunks = list(client.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
    usage = expected_usage("/v1/chat/completions", CHAT)
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == usage["prompt_tokens"]
    assert chunks[-1].usage.completion_tokens == usage["completion_tokens"]
    wait_for(lambda: UsageEvent.objects.exists(), 10, interval=0.02, what="the stream's usage event")
    event = UsageEvent.objects.get()
    assert (event.input_tokens, event.output_tokens) == (usage["prompt_tokens"], usage["completion_tokens"])


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_openai_sdk_streams_responses_with_usage_from_response_completed(web, catalog, fake):
    url, _ = web
    client = openai.OpenAI(base_url=url + "/v1", api_key=catalog.key, max_retries=0)
    body = {"model": "gpt-resp", "input": "three little words"}
    kinds = []
    with client.responses.stream(**body) as stream:
        deltas = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
        request_id = stream._raw_stream.response.headers["x-request-id"]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert len(deltas) > 5 and "".join(deltas) == final.output_text
    usage = expected_usage("/v1/responses", body)
    assert final.usage.input_tokens == usage["input_tokens"]
    event = event_of(request_id)
    assert (event.model, event.input_tokens, event.output_tokens) == (
        "gpt-resp",
        usage["input_tokens"],
        usage["output_tokens"],
    )
    assert "stream_options" not in fake.received[-1]["body"]  # a Chat Completions option only


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("prefix", ["", "/anthropic"])
def test_anthropic_sdk_streams_messages_with_usage_from_message_start_and_delta(web, catalog, fake, prefix):
    url, _ = web
    client = anthropic.Anthropic(base_url=url + prefix, api_key=catalog.key, max_retries=0)
    with client.messages.stream(**MESSAGES) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
        request_id = stream.request_id  # the anthropic SDK's, read from `request-id`
    assert len(pieces) > 5 and "".join(pieces) == canned("/v1/messages", MESSAGES)["content"][0]["text"]
    assert request_id == stream.response.headers["x-request-id"]
    usage = expected_usage("/v1/messages", MESSAGES)
    assert final.usage.output_tokens == usage["output_tokens"]
    event = event_of(request_id)
    assert (event.input_tokens, event.output_tokens, event.error_kind) == (
        usage["input_tokens"],
        usage["output_tokens"],
        "",
    )
    assert fake.received[-1]["path"] == "/v1/messages" and fake.received[-1]["body"]["stream"] is True


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_litellm_sdk_streams_through_the_relay(web, catalog, fake):
    litellm = pytest.importorskip("litellm", reason="litellm is not in the dev virtualenv (bench/ has its own)")
    url, _ = web
    response = litellm.completion(
        model="openai/gpt-4o", api_base=url + "/v1", api_key=catalog.key, stream=True, messages=CHAT["messages"]
    )
    text = "".join(c.choices[0].delta.content or "" for c in response if c.choices)
    assert text == canned("/v1/chat/completions", CHAT)["choices"][0]["message"]["content"]
    usage = expected_usage("/v1/chat/completions", CHAT)
    wait_for(
        lambda: UsageEvent.objects.filter(output_tokens=usage["completion_tokens"]).exists(),
        10,
        interval=0.02,
        what="the LiteLLM stream's usage event",
    )


# --- passed through as it comes --------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_events_reach_the_client_while_the_provider_is_still_generating(web, catalog, fake):
    url, _ = web
    gate = threading.Event()
    fake.script("*", [Reply(stream_gate=gate)])
    try:
        with _post(url, "/v1/messages", dict(MESSAGES, stream=True), catalog.key) as resp:
            assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
            assert resp.headers["x-request-id"] == resp.headers["request-id"]
            lines = resp.iter_lines()
            seen = []
            # The provider holds everything after its first content event: what arrived came through at once.
            for line in lines:
                seen.append(line)
                if b"content_block_delta" in line and line.startswith(b"data:"):
                    break
            assert any(b"message_start" in line for line in seen)
            gate.set()
            rest = list(lines)
        assert any(b"message_stop" in line for line in rest)
    finally:
        gate.set()
    event_of(resp.headers["x-request-id"])


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("failure", [Reply(status=500), Reply(status=429, headers={"Retry-After": "1"})])
def test_a_key_that_fails_before_its_first_byte_fails_over_like_a_whole_answer(web, catalog, fake, failure):
    url, _ = web
    fake.script("upstream-openai-0", [failure])
    with _post(url, "/v1/chat/completions", dict(CHAT, stream=True), catalog.key) as resp:
        assert resp.status_code == 200
        data = sse_data(resp)
    assert data[-1] == "[DONE]" and all("usage" not in d or d["usage"] is None for d in data[:-1])
    assert [r["key"] for r in fake.received] == ["upstream-openai-0", "upstream-openai-1"]
    event = event_of(resp.headers["x-request-id"])
    assert event.attempts == 2 and event.status == 200 and event.output_tokens > 0


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_every_key_failing_before_the_first_byte_is_an_ordinary_error_answer(web, catalog, fake):
    url, _ = web
    fake.script("*", [Reply(status=503)] * 3)
    resp = requests.post(
        url + "/v1/chat/completions",
        json=dict(CHAT, stream=True),
        headers={"Authorization": f"Bearer {catalog.key}"},
        timeout=30,
    )
    assert resp.status_code == 503 and resp.headers["content-type"].startswith("application/json")
    assert resp.headers["x-request-id"]
    assert len(fake.received) == 3
    assert event_of(resp.headers["x-request-id"]).error_kind == "upstream_error"


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_an_open_stream_holds_its_concurrency_slot_until_it_ends(web, catalog, fake):
    url, _ = web
    catalog.policy.rate_limit = factories.rate_limit("one-at-a-time", ("concurrency", 1, 60, "fixed-window"))
    catalog.policy.save()
    gate = threading.Event()
    fake.script("*", [Reply(stream_gate=gate)])
    try:
        with _post(url, "/v1/chat/completions", dict(CHAT, stream=True), catalog.key) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(lines)
            second = requests.post(
                url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {catalog.key}"}, timeout=30
            )
            assert second.status_code == 429, second.text  # the stream is still in flight
            gate.set()
            assert b"data: [DONE]" in list(lines)
        event_of(first.headers["x-request-id"])
        third = requests.post(
            url + "/v1/chat/completions", json=CHAT, headers={"Authorization": f"Bearer {catalog.key}"}, timeout=30
        )
        assert third.status_code == 200, third.text  # released at the stream's end
    finally:
        gate.set()


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_routes_that_do_not_stream_refuse_stream_true(web, catalog, fake):
    url, _ = web
    resp = requests.post(
        url + "/v1/embeddings",
        json={"model": "gpt-4o", "input": "x", "stream": True},
        headers={"Authorization": f"Bearer {catalog.key}"},
        timeout=30,
    )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "streaming_unsupported"
    assert fake.received == []


# --- the client hangs up -----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_client_hanging_up_closes_the_upstream_call_and_is_billed_what_was_reported(web, catalog, fake):
    url, _ = web
    gate = threading.Event()  # never opened while the client is there: the provider has gone quiet
    fake.script("*", [Reply(stream_gate=gate)])
    try:
        request_id = _read_then_hang_up(url, "/v1/messages", dict(MESSAGES, stream=True), catalog.key, b"text_delta")
        started = time.monotonic()
        # The relay notices while the provider is silent (its watchdog looks at the client's connection
        # each second) and closes the upstream call, which the provider sees at once.
        wait_for(lambda: fake.closed_by_client == 1, 5, interval=0.02, what="the upstream call to be closed")
        assert time.monotonic() - started < 3
    finally:
        gate.set()
    event = event_of(request_id)
    usage = expected_usage("/v1/messages", MESSAGES)
    # message_start had come: its input tokens are the provider's; message_delta, with the final output
    # count, never came, so the output is the estimate of the one text delta relayed (the provider had
    # produced one word: one token in its count), and the event says it is an estimate.
    assert (event.error_kind, event.input_tokens, event.output_tokens) == ("client_canceled", usage["input_tokens"], 1)
    assert event.usage_estimated is True
    assert event.cost_nano_usd is None  # claude-sonnet is unpriced in this catalog: unknown, never 0


def _gated_hang_up(url: str, fake, path: str, body: dict, key: str, marker: bytes) -> UsageEvent:
    """The provider sends its stream up to the first content event and goes quiet; the client reads up to
    `marker` (that event) and hangs up. The stream's usage event."""
    gate = threading.Event()
    fake.script("*", [Reply(stream_gate=gate)])
    try:
        request_id = _read_then_hang_up(url, path, dict(body, stream=True), key, marker)
        wait_for(lambda: fake.closed_by_client == 1, 5, interval=0.02, what="the upstream call to be closed")
    finally:
        gate.set()
    return event_of(request_id)


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_chat_stream_hung_up_after_two_chunks_is_billed_an_estimate_and_charged_to_its_budget(web, catalog, fake):
    from usage.models import Budget, BudgetPeriod
    from usage.tokens import estimate

    url, _ = web
    budget = Budget.objects.create(name="proj", project=catalog.project, usd_nanos=10**9, period="day")
    # Two chunks: the role chunk and the first word. The provider had produced one token then.
    event = _gated_hang_up(url, fake, "/v1/chat/completions", CHAT, catalog.key, b'"content":"[relay')
    assert (event.error_kind, event.usage_estimated) == ("client_canceled", True)
    assert event.output_tokens == 1
    # The prompt from the size of the request the relay sent (usage.tokens.estimate, the reservations' rule).
    sent, _ = streaming.upstream_body("/v1/chat/completions", dict(CHAT, stream=True))
    assert event.input_tokens == estimate(sent).input > 0
    assert event.cost_nano_usd == event.input_tokens * 2_500 + event.output_tokens * 10_000
    # Charged to the budget like any other call (the writer thread charges it after the event).
    wait_for(
        lambda: BudgetPeriod.objects.filter(budget=budget, spent_nanos=event.cost_nano_usd).exists(),
        5,
        interval=0.02,
        what="the estimate charged to the budget",
    )


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_hung_up_streams_estimate_is_charged_to_the_policys_token_limit(web, catalog, fake):
    url, _ = web
    catalog.policy.rate_limit = factories.rate_limit("out-1", ("tokens.output", 1, 60, "sliding-window"))
    catalog.policy.save()
    event = _gated_hang_up(url, fake, "/v1/chat/completions", CHAT, catalog.key, b'"content":"[relay')
    assert (event.usage_estimated, event.output_tokens) == (True, 1)
    # The estimated output token spent the limit: the next call is refused until the window slides.
    with _post(url, "/v1/chat/completions", CHAT, catalog.key) as resp:
        assert resp.status_code == 429, resp.content
        assert resp.json()["error"]["code"] == "rate_limit_exceeded"


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_responses_stream_hung_up_before_response_completed_is_billed_an_estimate(web, catalog, fake):
    url, _ = web
    body = {"model": "gpt-resp", "input": "three little words"}
    event = _gated_hang_up(url, fake, "/v1/responses", body, catalog.key, b"response.output_text.delta")
    assert (event.error_kind, event.usage_estimated, event.output_tokens) == ("client_canceled", True, 1)
    assert event.input_tokens > 0


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_stream_that_ends_with_the_providers_usage_is_not_an_estimate(web, catalog, fake):
    url, _ = web
    with _post(url, "/v1/chat/completions", dict(CHAT, stream=True), catalog.key) as resp:
        assert resp.status_code == 200 and b"[DONE]" in resp.content
        request_id = resp.headers["x-request-id"]
    event = event_of(request_id)
    usage = expected_usage("/v1/chat/completions", CHAT)
    assert (event.usage_estimated, event.output_tokens) == (False, usage["completion_tokens"])


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_a_client_hanging_up_while_events_flow_closes_the_upstream_call(web, catalog, fake):
    url, _ = web
    long_prompt = " ".join(["word"] * 150)
    fake.script("*", [Reply(event_delay=0.02)])  # ~160 events over ~3 s
    body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": long_prompt}]}
    request_id = _read_then_hang_up(url, "/v1/chat/completions", body, catalog.key, b'"content":"word')
    wait_for(lambda: fake.closed_by_client == 1, 3, interval=0.02, what="the upstream call to be closed")
    event = event_of(request_id)
    # OpenAI reports usage only in its last chunk, which never came: the words relayed are billed (an
    # estimate), at least the ones the client read before hanging up, and no more than the answer has.
    answer = canned("/v1/chat/completions", body)["usage"]["completion_tokens"]
    assert (event.error_kind, event.usage_estimated) == ("client_canceled", True)
    assert 12 <= event.output_tokens < answer


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_an_anthropic_stream_hung_up_mid_answer_bills_the_output_relayed_not_message_starts_count(web, catalog, fake):
    url, _ = web
    long_prompt = " ".join(["word"] * 150)
    fake.script("*", [Reply(event_delay=0.02)])
    body = dict(MESSAGES, stream=True, messages=[{"role": "user", "content": long_prompt}])
    request_id = _read_then_hang_up(url, "/v1/messages", body, catalog.key, b'"text":"word')
    wait_for(lambda: fake.closed_by_client == 1, 3, interval=0.02, what="the upstream call to be closed")
    event = event_of(request_id)
    usage = canned("/v1/messages", body)["usage"]
    # message_start said 1 output token; twelve words had been relayed when the client left.
    assert (event.error_kind, event.usage_estimated) == ("client_canceled", True)
    assert event.input_tokens == usage["input_tokens"]  # the provider's own count of the prompt
    assert 12 <= event.output_tokens < usage["output_tokens"]


def _read_then_hang_up(url: str, path: str, body: dict, key: str, marker: bytes) -> str:
    """A client that reads a stream until `marker` has come, then closes its connection. Its request id."""
    port = int(url.rsplit(":", 1)[1])
    payload = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: relay\r\nContent-Type: application/json\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        seen = b""
        while marker not in seen:
            piece = s.recv(65536)
            assert piece, seen
            seen += piece
        head = seen.split(b"\r\n\r\n", 1)[0].decode()
        assert head.startswith("HTTP/1.1 200"), head
        s.shutdown(socket.SHUT_RDWR)
    return next(
        line.split(":", 1)[1].strip() for line in head.split("\r\n") if line.lower().startswith("x-request-id:")
    )


# --- 200 streams at once -----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.django_db(transaction=True)
def test_200_open_streams_leave_healthz_and_whole_answers_prompt(web, catalog, fake):
    url, _ = web
    gate = threading.Event()
    fake.answer_when("hold this stream", Reply(stream_gate=gate))
    body = {"model": "gpt-4o", "stream": True, "messages": [{"role": "user", "content": "hold this stream"}]}
    opened, finished, failures = [], [], []
    lock = threading.Lock()

    def one_stream() -> None:
        try:
            with _post(url, "/v1/chat/completions", body, catalog.key) as resp:
                lines = resp.iter_lines()
                for line in lines:
                    if b'"content"' in line:
                        break
                with lock:
                    opened.append(1)
                rest = list(lines)
            with lock:
                finished.append(b"data: [DONE]" in rest)
        except Exception as exc:  # noqa: BLE001 - reported below
            with lock:
                failures.append(repr(exc))

    threads = [threading.Thread(target=one_stream, daemon=True) for _ in range(CONCURRENT_STREAMS)]
    try:
        for t in threads:
            t.start()
        wait_for(lambda: len(opened) + len(failures) >= CONCURRENT_STREAMS, 60, interval=0.05, what="200 streams")
        assert not failures, failures[:3]
        timings = {}
        for name, call in (
            ("healthz", lambda: requests.get(url + "/healthz", timeout=10)),
            (
                "chat",
                lambda: requests.post(url + "/v1/chat/completions", json=CHAT, headers=_auth(catalog), timeout=10),
            ),
        ):
            for _ in range(3):
                started = time.monotonic()
                answer = call()
                timings.setdefault(name, []).append(time.monotonic() - started)
                assert answer.status_code == 200, answer.text
        print(
            f"with {CONCURRENT_STREAMS} open streams: " + ", ".join(f"{k} {max(v):.3f} s" for k, v in timings.items())
        )
        assert max(max(v) for v in timings.values()) < 2.0, timings
    finally:
        gate.set()
        for t in threads:
            t.join(timeout=30)
    assert len(finished) == CONCURRENT_STREAMS and all(finished), (len(finished), failures[:3])
    wait_for(
        lambda: UsageEvent.objects.filter(model="gpt-4o", output_tokens__gt=0).count() >= CONCURRENT_STREAMS + 3,
        30,
        interval=0.1,
        what="every stream's usage event",
    )


def _auth(catalog) -> dict:
    return {"Authorization": f"Bearer {catalog.key}"}


# --- the event cutter, alone ---------------------------------------------------------------------------------


@pytest.mark.unit
def test_events_are_passed_whole_however_the_reads_cut_them():
    events, first = __import__("devkit.upstream", fromlist=["canned_events"]).canned_events(
        "/v1/chat/completions", dict(CHAT, stream_options={"include_usage": True})
    )
    raw = b"".join(events)
    for step in (1, 7, 64, len(raw)):
        cutter = streaming.Events("openai", "/v1/chat/completions", strip_usage_chunk=True)
        out = b"".join(cutter.feed(raw[i : i + step]) for i in range(0, len(raw), step)) + cutter.flush()
        assert out == b"".join(e for e in events if b'"choices":[]' not in e)
        usage = canned("/v1/chat/completions", CHAT)["usage"]
        assert (cutter.tokens.input, cutter.tokens.output) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert first == 1


@pytest.mark.unit
def test_an_anthropic_stream_is_billed_from_its_latest_counts_and_an_error_event_is_kept():
    cutter = streaming.Events("anthropic", "/v1/messages", strip_usage_chunk=True)
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 10, "cache_read_input_tokens": 4}}}
    out = cutter.feed(b"event: message_start\ndata: " + json.dumps(start).encode() + b"\n\n")
    assert out.startswith(b"event: message_start")  # Anthropic's events are never dropped
    cutter.feed(b'event: message_delta\ndata: {"type":"message_delta","usage":{"output_tokens":7}}\r\n\r\n')
    cutter.feed(b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"busy"}}\n\n')
    assert (cutter.tokens.input, cutter.tokens.cache_read, cutter.tokens.output) == (10, 4, 7)
    assert "overloaded_error" in cutter.error


@pytest.mark.unit
def test_usage_is_asked_for_upstream_only_on_openais_chunk_shapes():
    body, asked = streaming.upstream_body("/v1/chat/completions", dict(CHAT, stream=True))
    assert body["stream_options"] == {"include_usage": True} and not asked
    body, asked = streaming.upstream_body(
        "/v1/chat/completions", dict(CHAT, stream_options={"include_usage": False, "include_obfuscation": False})
    )
    assert body["stream_options"] == {"include_usage": True, "include_obfuscation": False} and not asked
    assert streaming.upstream_body("/v1/chat/completions", dict(CHAT, stream_options={"include_usage": True}))[1]
    assert streaming.upstream_body("/v1/messages", MESSAGES) == (MESSAGES, True)
