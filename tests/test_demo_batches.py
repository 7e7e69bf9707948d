"""The fake provider's batch APIs (devkit.batches), driven by the official `openai` and `anthropic` SDKs
as a provider-mode relay will drive them: OpenAI Files + Batches and Anthropic Message Batches.

Most tests move the fake's clock by hand (`fake.batches.clock`), so progress is exact and instant; one
lets real time run. Their tier is unit (conftest: no database fixture), but for the one that starts the
demo upstream as a process."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import anthropic
import openai
import pytest
import requests
from anthropic.types.messages import MessageBatch, MessageBatchIndividualResponse
from openai.types import Batch, FileObject

from devkit.upstream import DemoUpstream, Reply, canned

T = 10.0  # the jobs' seconds under the hand-moved clock
START = 1_800_000_000.0


class Clock:
    def __init__(self):
        self.t = START

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(fake):
    c = Clock()
    fake.batches.clock = c
    fake.batches.job_seconds = T
    return c


def oai(fake, key="sk-one", **kw) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=fake.url + "/v1", max_retries=0, **kw)


def claude(fake, key="sk-ant-one") -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key=key, base_url=fake.url, max_retries=0)


def chat_line(i, text=None, url="/v1/chat/completions", custom_id=None) -> dict:
    body = {"model": "gpt-demo", "messages": [{"role": "user", "content": text or f"question {i}"}]}
    return {"custom_id": custom_id or f"req-{i}", "method": "POST", "url": url, "body": body}


def upload(client, lines) -> FileObject:
    data = "\n".join(json.dumps(line) for line in lines).encode() + b"\n"
    return client.files.create(file=("input.jsonl", data), purpose="batch")


def start_openai(client, lines, **kw) -> Batch:
    f = upload(client, lines)
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", **kw)


def retrieve(client, batch_id) -> Batch:
    """The batch, validated strictly against the SDK's model (not the SDK's lenient construct)."""
    raw = client.batches.with_raw_response.retrieve(batch_id)
    return Batch.model_validate(raw.http_response.json())


def jsonl(client, file_id) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def without_created(body: dict) -> dict:
    return {k: v for k, v in body.items() if k != "created"}  # canned() stamps the time


def message_params(text, **extra) -> dict:
    return {"model": "claude-demo", "max_tokens": 32, "messages": [{"role": "user", "content": text}], **extra}


def raw_message_batch(client, batch_id) -> MessageBatch:
    raw = client.messages.batches.with_raw_response.retrieve(batch_id)
    return MessageBatch.model_validate(raw.http_response.json())


# --- OpenAI ----------------------------------------------------------------------------------------------


def test_openai_batch_runs_its_records_over_time_with_the_live_replies_and_a_scripted_failure(fake, clock):
    fake.answer_when("REFUSE-ME", Reply(status=400, body={"error": {"message": "no", "type": "invalid_request_error"}}))
    client = oai(fake)
    lines = [chat_line(i, "REFUSE-ME" if i == 5 else None) for i in range(8)]
    batch = start_openai(client, lines, metadata={"relay_job": "job-1"})
    assert (batch.status, batch.metadata, batch.request_counts.total) == ("validating", {"relay_job": "job-1"}, 0)

    clock.t = START + 0.05 * T
    assert retrieve(client, batch.id).status == "validating"
    clock.t = START + 0.1 * T
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.model, batch.request_counts.total, batch.request_counts.completed) == (
        "in_progress",
        "gpt-demo",
        8,
        0,
    )
    clock.t = START + 0.5 * T  # half of the records' span: 4 of 8 ran
    counts = retrieve(client, batch.id).request_counts
    assert (counts.completed, counts.failed) == (4, 0)
    clock.t = START + 0.8 * T  # 7 ran, the 6th (index 5) refused
    counts = retrieve(client, batch.id).request_counts
    assert (counts.completed, counts.failed) == (6, 1)
    clock.t = START + 0.95 * T
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.output_file_id, batch.request_counts.completed) == ("finalizing", None, 7)
    clock.t = START + T
    batch = retrieve(client, batch.id)
    assert batch.status == "completed"
    assert batch.completed_at == int(START + T) and batch.in_progress_at == int(START + 0.1 * T)
    assert batch.usage.input_tokens > 0 and batch.usage.total_tokens > batch.usage.input_tokens

    out = jsonl(client, batch.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(8) if i != 5]
    for line in out:
        i = int(line["custom_id"].split("-")[1])
        assert line["id"].startswith("batch_req_") and line["error"] is None
        assert line["response"]["status_code"] == 200
        assert without_created(line["response"]["body"]) == without_created(
            canned("/v1/chat/completions", chat_line(i)["body"])
        )
    [err] = jsonl(client, batch.error_file_id)
    assert err["custom_id"] == "req-5" and err["error"] is None
    assert err["response"]["status_code"] == 400
    assert err["response"]["body"] == {"error": {"message": "no", "type": "invalid_request_error"}}

    output_file = client.files.retrieve(batch.output_file_id)
    FileObject.model_validate(output_file.model_dump())
    assert output_file.purpose == "batch_output"
    assert output_file.bytes == len(client.files.content(batch.output_file_id).content)
    assert client.files.content(batch.input_file_id).text.count("\n") == 8


def test_an_input_file_openai_would_refuse_fails_the_batch_with_its_line_errors(fake, clock):
    client = oai(fake)
    lines = [chat_line(0), chat_line(1, custom_id="req-0"), chat_line(2, url="/v1/embeddings")]
    batch = start_openai(client, lines)
    clock.t = START + 0.1 * T
    batch = retrieve(client, batch.id)
    assert batch.status == "failed" and batch.failed_at == int(START + 0.1 * T)
    assert [(e.code, e.line) for e in batch.errors.data] == [("duplicate_custom_id", 2), ("mismatched_endpoint", 3)]
    assert (batch.output_file_id, batch.error_file_id, batch.request_counts.total) == (None, None, 0)

    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("input.csv", b"a,b\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(
            input_file_id=batch.input_file_id, endpoint="/v1/chat/completions", completion_window="1h"
        )


def test_openai_cancel_keeps_finished_results_and_writes_the_rest_as_cancelled(fake, clock):
    client = oai(fake)
    batch = start_openai(client, [chat_line(i) for i in range(10)])
    clock.t = START + 0.5 * T  # 5 of 10 done
    batch = client.batches.cancel(batch.id)
    assert (batch.status, batch.cancelling_at, batch.request_counts.completed) == ("cancelling", int(clock.t), 5)
    clock.t = START + 0.55 * T  # a cancel takes 0.1 T to land; nothing more runs meanwhile
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.request_counts.completed) == ("cancelling", 5)
    clock.t = START + 0.6 * T
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.cancelled_at, batch.request_counts.completed) == ("cancelled", int(clock.t), 5)
    assert [line["custom_id"] for line in jsonl(client, batch.output_file_id)] == [f"req-{i}" for i in range(5)]
    errors = jsonl(client, batch.error_file_id)
    assert [line["custom_id"] for line in errors] == [f"req-{i}" for i in range(5, 10)]
    assert {(line["response"], line["error"]["code"]) for line in errors} == {(None, "batch_cancelled")}
    with pytest.raises(openai.BadRequestError):  # a finished batch cannot be cancelled
        done = start_openai(client, [chat_line(0)])
        clock.t += T
        client.batches.cancel(done.id)


def test_openai_records_that_never_finish_expire_at_the_window_and_the_rest_keep_their_results(fake, clock):
    fake.batches.expire_when("TOO-SLOW")
    fake.answer_when("HANGS", Reply(hang=True))  # a live hang is a record that never finishes
    client = oai(fake)
    lines = [chat_line(0), chat_line(1, "TOO-SLOW"), chat_line(2), chat_line(3, "HANGS")]
    batch = start_openai(client, lines)
    clock.t = START + 0.95 * T  # the others are done, but the job waits for its window
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("in_progress", 2, 0)
    clock.t = START + T
    batch = retrieve(client, batch.id)
    assert (batch.status, batch.expired_at, batch.expires_at) == ("expired", int(START + T), int(START + T))
    assert [line["custom_id"] for line in jsonl(client, batch.output_file_id)] == ["req-0", "req-2"]
    errors = jsonl(client, batch.error_file_id)
    assert [(line["custom_id"], line["response"], line["error"]["code"]) for line in errors] == [
        ("req-1", None, "batch_expired"),
        ("req-3", None, "batch_expired"),
    ]


def test_openai_capacity_refusals_429_on_create_and_token_limit_failure(fake, clock):
    client = oai(fake)
    f = upload(client, [chat_line(0)])
    fake.batches.refuse_creates(1, "openai", retry_after=7)
    with pytest.raises(openai.RateLimitError) as refused:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert refused.value.response.headers["retry-after"] == "7"
    assert refused.value.body["code"] == "rate_limit_exceeded"
    assert fake.batches.creates("openai") == 0

    fake.batches.fail_token_limit(1)
    first = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    second = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    clock.t = START + 0.1 * T
    first, second = retrieve(client, first.id), retrieve(client, second.id)
    assert first.status == "failed" and first.errors.data[0].code == "token_limit_exceeded"
    assert first.output_file_id is None
    assert second.status == "in_progress"
    assert fake.batches.creates("openai") == 2


def test_openai_list_pages_newest_first(fake, clock):
    client = oai(fake)
    ids = []
    for i in range(3):
        ids.append(start_openai(client, [chat_line(i)]).id)
        clock.t += 1
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == [ids[2], ids[1]] and page.has_more
    raw = client.batches.with_raw_response.list(limit=2).http_response.json()
    assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", ids[2], ids[1])
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # the SDK follows `after`
    last = client.batches.list(limit=2, after=ids[1])
    assert [b.id for b in last.data] == [ids[0]] and not last.has_more


def test_a_create_whose_answer_is_lost_still_made_its_job_and_listing_finds_it(fake, clock):
    client = oai(fake)
    f = upload(client, [chat_line(0)])
    fake.batches.drop_create_answers(1)
    with pytest.raises(openai.APIConnectionError):
        client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"relay_job": "7"}
        )
    assert [b.metadata for b in client.batches.list()] == [{"relay_job": "7"}]

    gate = threading.Event()
    fake.batches.hold_creates(gate)
    with pytest.raises(openai.APITimeoutError):
        oai(fake, timeout=0.3).batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    gate.set()
    assert fake.batches.creates() == 2


# --- Anthropic -------------------------------------------------------------------------------------------


def test_anthropic_batch_counts_move_and_results_stream_when_it_ends(fake, clock):
    fake.answer_when("REFUSE-ME", Reply(status=400, body={"error": {"message": "no", "type": "invalid_request_error"}}))
    client = claude(fake)
    batch_requests = [{"custom_id": f"c-{i}", "params": message_params(f"hello {i}")} for i in range(4)]
    batch_requests.append({"custom_id": "c-4", "params": message_params("REFUSE-ME")})
    batch_requests.append({"custom_id": "c-5", "params": {"model": "claude-demo", "messages": []}})  # no max_tokens
    batch = client.messages.batches.create(requests=batch_requests)
    assert (batch.processing_status, batch.results_url, batch.request_counts.processing) == ("in_progress", None, 6)

    clock.t = START + 0.45 * T  # half of the records' span: 3 of 6
    batch = raw_message_batch(client, batch.id)
    assert (batch.request_counts.processing, batch.request_counts.succeeded) == (3, 3)
    with pytest.raises(anthropic.AnthropicError):  # no results_url before the end
        client.messages.batches.results(batch.id)
    clock.t = START + T
    batch = raw_message_batch(client, batch.id)
    counts = batch.request_counts
    assert (batch.processing_status, counts.processing, counts.succeeded, counts.errored) == ("ended", 0, 4, 2)
    assert batch.ended_at.timestamp() == START + T
    assert batch.results_url == f"{fake.url}/v1/messages/batches/{batch.id}/results"

    results = {r.custom_id: r.result for r in client.messages.batches.results(batch.id)}
    assert [results[f"c-{i}"].type for i in range(6)] == ["succeeded"] * 4 + ["errored"] * 2
    assert (
        results["c-0"].message.content[0].text
        == canned("/v1/messages", message_params("hello 0"))["content"][0]["text"]
    )
    assert (results["c-4"].error.error.type, results["c-4"].error.error.message) == ("invalid_request_error", "no")
    assert "max_tokens" in results["c-5"].error.error.message
    raw = requests.get(batch.results_url, headers={"x-api-key": "sk-ant-one"})
    for line in raw.text.splitlines():  # every line validates strictly
        MessageBatchIndividualResponse.model_validate_json(line)


def test_anthropic_cancel_expiry_and_delete(fake, clock):
    fake.batches.expire_when("TOO-SLOW")
    client = claude(fake)
    slow = client.messages.batches.create(
        requests=[
            {"custom_id": "a", "params": message_params("quick")},
            {"custom_id": "b", "params": message_params("TOO-SLOW")},
        ]
    )
    cancelled = client.messages.batches.create(
        requests=[{"custom_id": f"x{i}", "params": message_params(f"n {i}")} for i in range(9)]
    )
    clock.t = START + 0.3 * T  # 3 of 9 done
    batch = client.messages.batches.cancel(cancelled.id)
    assert (batch.processing_status, batch.cancel_initiated_at.timestamp()) == ("canceling", clock.t)
    with pytest.raises(anthropic.BadRequestError):  # not ended: cannot be deleted yet
        client.messages.batches.delete(cancelled.id)
    clock.t = START + 0.4 * T
    batch = raw_message_batch(client, cancelled.id)
    assert (batch.processing_status, batch.request_counts.succeeded, batch.request_counts.canceled) == ("ended", 3, 6)
    assert [r.result.type for r in client.messages.batches.results(cancelled.id)] == ["succeeded"] * 3 + [
        "canceled"
    ] * 6

    clock.t = START + 0.95 * T
    assert raw_message_batch(client, slow.id).processing_status == "in_progress"
    clock.t = START + T
    batch = raw_message_batch(client, slow.id)
    assert (batch.request_counts.succeeded, batch.request_counts.expired) == (1, 1)
    assert {r.custom_id: r.result.type for r in client.messages.batches.results(slow.id)} == {
        "a": "succeeded",
        "b": "expired",
    }
    assert client.messages.batches.delete(slow.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.batches.retrieve(slow.id)


def test_anthropic_refuses_malformed_batches_and_429s_on_request(fake, clock):
    client = claude(fake)
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(
            requests=[
                {"custom_id": "same", "params": message_params("a")},
                {"custom_id": "same", "params": message_params("b")},
            ]
        )
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.create(requests=[{"custom_id": "has space", "params": message_params("a")}])
    fake.batches.refuse_creates(1, "anthropic", retry_after=3)
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.batches.create(requests=[{"custom_id": "a", "params": message_params("a")}])
    assert refused.value.response.headers["retry-after"] == "3"
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert client.messages.batches.create(requests=[{"custom_id": "a", "params": message_params("a")}]).id
    assert fake.batches.creates("anthropic") == 1


def test_anthropic_list_cursors(fake, clock):
    client = claude(fake)
    ids = []
    for i in range(3):
        ids.append(client.messages.batches.create(requests=[{"custom_id": "a", "params": message_params(str(i))}]).id)
        clock.t += 1
    page = client.messages.batches.list(limit=2)
    assert ([b.id for b in page.data], page.first_id, page.last_id, page.has_more) == (
        [ids[2], ids[1]],
        ids[2],
        ids[1],
        True,
    )
    assert [b.id for b in client.messages.batches.list(limit=2)] == ids[::-1]  # the SDK follows after_id
    assert [b.id for b in client.messages.batches.list(limit=2, before_id=ids[0]).data] == [ids[2], ids[1]]
    assert not client.messages.batches.list(limit=5, after_id=ids[1]).has_more


# --- both -------------------------------------------------------------------------------------------------


def test_polls_answer_500_while_the_provider_is_failing(fake, clock):
    client, ant = oai(fake), claude(fake)
    batch = start_openai(client, [chat_line(0)])
    message_batch = ant.messages.batches.create(requests=[{"custom_id": "a", "params": message_params("a")}])
    fake.batches.fail_polls(120)
    for call in (
        lambda: client.batches.retrieve(batch.id),
        lambda: client.batches.list(),
        lambda: ant.messages.batches.retrieve(message_batch.id),
        lambda: ant.messages.batches.list(),
    ):
        with pytest.raises((openai.InternalServerError, anthropic.InternalServerError)):
            call()
    clock.t = START + 120
    assert retrieve(client, batch.id).status == "completed"
    assert raw_message_batch(ant, message_batch.id).processing_status == "ended"
    assert [e["status"] for e in fake.batches.polls(batch.id)] == [500, 200]


def test_jobs_and_files_belong_to_the_key_that_made_them(fake, clock):
    client, other = oai(fake), oai(fake, key="sk-two")
    batch = start_openai(client, [chat_line(0)])
    clock.t = START + T
    batch = retrieve(client, batch.id)
    for call in (
        lambda: other.batches.retrieve(batch.id),
        lambda: other.batches.cancel(batch.id),
        lambda: other.files.retrieve(batch.input_file_id),
        lambda: other.files.content(batch.output_file_id),
        lambda: other.files.delete(batch.input_file_id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert other.batches.list().data == [] and other.files.list().data == []
    assert [f.id for f in client.files.list()] == [batch.output_file_id, batch.input_file_id]

    ant, ant_other = claude(fake), claude(fake, key="sk-ant-two")
    message_batch = ant.messages.batches.create(requests=[{"custom_id": "a", "params": message_params("a")}])
    clock.t = START + 3 * T
    for call in (
        lambda: ant_other.messages.batches.retrieve(message_batch.id),
        lambda: ant_other.messages.batches.cancel(message_batch.id),
        lambda: ant_other.messages.batches.delete(message_batch.id),
        lambda: requests.get(
            f"{fake.url}/v1/messages/batches/{message_batch.id}/results", headers={"x-api-key": "sk-ant-two"}
        ).raise_for_status(),
    ):
        with pytest.raises((anthropic.NotFoundError, requests.HTTPError)):
            call()
    assert ant_other.messages.batches.list().data == []
    assert fake.batches.job(message_batch.id).key == "sk-ant-one" and fake.batches.job(batch.id).key == "sk-one"
    assert requests.get(f"{fake.url}/v1/batches/{batch.id}").status_code == 401  # no key at all


def test_the_request_log_counts_polls_uploads_and_creates(fake, clock):
    client = oai(fake)
    batch = start_openai(client, [chat_line(0)])
    for step in range(5):  # 5 polls 10 s apart, then 3 polls a minute apart
        clock.t = START + 10 * step
        client.batches.retrieve(batch.id)
    for step in range(3):
        clock.t = START + 100 + 61 * step
        client.batches.retrieve(batch.id)
    assert len(fake.batches.polls(batch.id)) == 8
    assert fake.batches.max_per_minute(batch.id, op="retrieve") == 5
    assert fake.batches.uploads() == 1 and fake.batches.creates() == 1
    [create] = fake.batches.requests(op="create")
    assert (create["method"], create["path"], create["key"], create["job"], create["status"]) == (
        "POST",
        "/v1/batches",
        "sk-one",
        batch.id,
        200,
    )
    assert fake.received == []  # batch-API calls are not live calls
    fake.reset()
    assert fake.batches.log == [] and fake.batches.job(batch.id) is None and fake.batches.clock is time.time


def test_jobs_progress_in_real_time(fake):
    fake.batches.job_seconds = 0.5
    client = oai(fake)
    batch = start_openai(client, [chat_line(i) for i in range(20)])
    seen, done = [], []
    deadline = time.monotonic() + 5
    while batch.status != "completed" and time.monotonic() < deadline:
        time.sleep(0.02)
        batch = client.batches.retrieve(batch.id)
        seen.append(batch.status)
        done.append(batch.request_counts.completed)
    assert batch.status == "completed" and batch.request_counts.completed == 20
    assert "in_progress" in seen and done == sorted(done) and any(0 < n < 20 for n in done)


def test_a_50000_line_input_is_uploaded_run_and_streamed_back(fake, clock):
    client = oai(fake, timeout=60)
    lines = "\n".join(
        json.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/embeddings", "body": {"model": "e", "input": "x"}}
        )
        for i in range(50_000)
    ).encode()
    f = client.files.create(file=("big.jsonl", lines), purpose="batch")
    assert f.bytes == len(lines)
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    clock.t = START + T
    batch = client.batches.retrieve(batch.id)
    assert (batch.status, batch.request_counts.completed) == ("completed", 50_000)
    size = client.files.retrieve(batch.output_file_id).bytes
    with client.files.with_streaming_response.content(batch.output_file_id) as response:
        assert int(response.headers["content-length"]) == size
        count, last = 0, None
        for line in response.iter_lines():
            count, last = count + 1, line
    assert count == 50_000 and json.loads(last)["custom_id"] == "r49999"


def test_live_paths_answer_as_before(fake):
    live = requests.post(f"{fake.url}/v1/chat/completions", json={"model": "m", "messages": []})
    assert live.status_code == 200 and live.json()["object"] == "chat.completion"
    assert requests.get(f"{fake.url}/v1/chat/completions").status_code == 501
    assert requests.post(f"{fake.url}/v1/unknown", json={}).status_code == 404
    assert [r["path"] for r in fake.received] == ["/v1/chat/completions", "/v1/unknown"]


def test_job_seconds_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RELAY_DEMO_BATCH_SECONDS", "7.5")
    server = DemoUpstream()
    try:
        assert server.batches.job_seconds == 7.5
        server.batches.job_seconds = 1
        server.reset()
        assert server.batches.job_seconds == 7.5
    finally:
        server.server_close()
    monkeypatch.delenv("RELAY_DEMO_BATCH_SECONDS")
    server = DemoUpstream()
    server.server_close()
    assert server.batches.job_seconds == 3.0


@pytest.mark.e2e
def test_the_demo_upstream_process_serves_the_batch_apis():
    """`make run` starts `python -m devkit.upstream`: its batch APIs answer there too."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "RELAY_DEMO_BATCH_SECONDS": "0.2"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "devkit.upstream", "--port", str(port)],
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.DEVNULL,
    )
    try:
        client = openai.OpenAI(api_key="sk-demo", base_url=f"http://127.0.0.1:{port}/v1", max_retries=5)
        deadline = time.monotonic() + 10
        while True:
            try:
                f = upload(client, [chat_line(0)])
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while batch.status not in ("completed", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
            batch = client.batches.retrieve(batch.id)
        assert batch.status == "completed"
        assert jsonl(client, batch.output_file_id)[0]["response"]["status_code"] == 200
    finally:
        proc.terminate()
        proc.wait(5)
