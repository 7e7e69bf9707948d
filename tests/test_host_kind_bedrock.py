"""Amazon Bedrock as a host kind: Claude through InvokeModel, every call SigV4-signed with botocore's signer and
checked by the fake Bedrock (devkit.clouds) with that same signer, through the real pipeline."""

import json

import pytest
import requests
from django.test import Client

from core.hostkinds.bedrock import sigv4_headers
from core.models import Host, HostBinding, HostKey
from policies.models import PolicyHostKey
from relay.config_apply import ConfigError, apply_config

pytestmark = pytest.mark.django_db(transaction=True)

ACCESS_KEY_ID = "AKIAEXAMPLETESTKEY01"
SECRET = "bedrock-secret/Access+Key"
MODEL_ID = "anthropic.claude-3-5-haiku-20241022-v1:0"


def message(model: str, **extra) -> dict:
    return {"model": model, "max_tokens": 64, "messages": [{"role": "user", "content": "hello bedrock"}], **extra}


@pytest.fixture
def bedrock(catalog, fake):
    fake.clouds.bedrock_keys[ACCESS_KEY_ID] = SECRET
    apply_config(
        {
            "hosts": [
                {
                    "name": "bedrock",
                    "kind": "bedrock",
                    "base_url": fake.url,
                    "access_key_id": ACCESS_KEY_ID,
                    "region": "eu-west-3",
                }
            ],
            "models": [{"name": "br-haiku", "provider": "anthropic"}],
            "bindings": [{"model": "br-haiku", "host": "bedrock", "adapter": "anthropic", "upstream_name": MODEL_ID}],
            "host_keys": [{"name": "bedrock-0", "host": "bedrock", "value": SECRET}],
        }
    )
    PolicyHostKey.objects.create(
        policy=catalog.policy, host_key=HostKey.objects.get(host__name="bedrock"), position=len(catalog.keys)
    )
    return catalog


def post(catalog, body: dict, **headers):
    return Client().post(
        "/v1/messages",
        data=json.dumps(body),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {catalog.key}",
        HTTP_ANTHROPIC_VERSION="2023-06-01",
        **headers,
    )


def test_an_allowed_beta_goes_in_the_body_as_bedrock_takes_it_and_another_is_refused(bedrock, fake):
    HostBinding.objects.filter(host__name="bedrock").update(allowed_betas=["token-efficient-tools-2025-02-19"])
    resp = post(bedrock, message("br-haiku"), HTTP_ANTHROPIC_BETA="token-efficient-tools-2025-02-19")
    assert resp.status_code == 200, resp.content
    sent = fake.received[-1]
    assert sent["body"]["anthropic_beta"] == ["token-efficient-tools-2025-02-19"]
    assert "anthropic-beta" not in {k.lower() for k in sent["headers"]}  # Bedrock reads the body, not the header
    before = len(fake.received)
    refused = post(bedrock, message("br-haiku"), HTTP_ANTHROPIC_BETA="files-api-2025-04-14")
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "beta_not_allowed"
    assert len(fake.received) == before  # refused before any call


def test_a_message_goes_to_invoke_model_signed_and_in_bedrocks_envelope(bedrock, fake):
    resp = post(bedrock, message("br-haiku"))
    assert resp.status_code == 200, resp.content
    answer = resp.json()
    assert answer["type"] == "message" and answer["usage"]["input_tokens"] > 0
    sent = fake.received[-1]
    headers = {k.lower(): v for k, v in sent["headers"].items()}
    assert sent["path"] == "/model/anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke"
    assert sent["body"] == {
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hello bedrock"}],
        "anthropic_version": "bedrock-2023-05-31",
    }
    assert headers["authorization"].startswith(f"AWS4-HMAC-SHA256 Credential={ACCESS_KEY_ID}/")
    assert "/eu-west-3/bedrock/aws4_request" in headers["authorization"]
    assert "x-api-key" not in headers and "anthropic-version" not in headers


def test_a_wrong_secret_is_refused_by_the_signature_check_and_not_leaked(bedrock, fake):
    fake.clouds.bedrock_keys[ACCESS_KEY_ID] = "another-secret"
    resp = post(bedrock, message("br-haiku"))
    assert resp.status_code == 403
    assert b"signature we calculated does not match" in resp.content
    assert SECRET.encode() not in resp.content


def test_a_secret_echoed_by_bedrock_is_scrubbed(bedrock, fake):
    from devkit.upstream import Reply

    fake.script(SECRET, [Reply(status=400, body={"message": f"bad request signed by {SECRET}"})])
    resp = post(bedrock, message("br-haiku"))
    assert resp.status_code == 400 and b"bad request signed by" in resp.content
    assert SECRET.encode() not in resp.content


def stream(catalog, body: dict) -> bytes:
    resp = post(catalog, dict(body, stream=True))
    assert resp.status_code == 200, resp.content
    assert resp["Content-Type"].startswith("text/event-stream")
    content = b"".join(resp.streaming_content)
    resp.close()
    return content


def test_a_stream_is_bedrocks_event_stream_turned_back_into_anthropics_sse(bedrock, fake):
    from tests.workers import wait_for
    from usage.models import UsageEvent

    content = stream(bedrock, message("br-haiku"))
    sent = fake.received[-1]
    assert sent["path"] == "/model/anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke-with-response-stream"
    assert "stream" not in sent["body"] and sent["body"]["anthropic_version"] == "bedrock-2023-05-31"
    events = [e for e in content.split(b"\n\n") if e.strip()]
    names = [e.split(b"\n")[0] for e in events]
    assert names[0] == b"event: message_start" and names[-1] == b"event: message_stop"
    assert b"event: content_block_delta" in names
    deltas = [json.loads(e.split(b"data: ", 1)[1]) for e in events if e.startswith(b"event: content_block_delta")]
    assert "hello bedrock" in "".join(d["delta"]["text"] for d in deltas)
    assert b"vnd.amazon.eventstream" not in content and b'"bytes"' not in content
    # The usage the stream reported is billed, as for Anthropic's own stream.
    wait_for(lambda: UsageEvent.objects.filter(model="br-haiku").exists(), 10, interval=0.02, what="the usage event")
    event = UsageEvent.objects.get(model="br-haiku")
    assert event.input_tokens > 0 and event.output_tokens > 0 and not event.usage_estimated


def test_an_exception_frame_midstream_becomes_anthropics_error_event():
    from core.hostkinds.bedrock import EventStreamAsSSE
    from devkit.clouds import bedrock_chunk, bedrock_exception

    class Wire:  # the upstream stream's interface, fed frames split at awkward places
        status, headers = 200, {"Content-Type": "application/vnd.amazon.eventstream"}

        def __init__(self, data: bytes):
            self.pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

        def read(self) -> bytes:
            return self.pieces.pop(0) if self.pieces else b""

    start = b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}\n\n'
    wire = Wire(bedrock_chunk(start) + bedrock_exception("throttlingException", "Too many tokens, please wait."))
    reader = EventStreamAsSSE(wire)
    assert reader.headers["Content-Type"].startswith("text/event-stream")
    out = b""
    while piece := reader.read():
        out += piece
    first, second = [e for e in out.split(b"\n\n") if e]
    assert first == b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":3}}}'
    assert second.startswith(b"event: error\ndata: ")
    error = json.loads(second.split(b"data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "rate_limit_error", "message": "Too many tokens, please wait."}}


def test_a_corrupt_frame_breaks_the_stream_as_a_network_failure():
    from core.hostkinds.bedrock import EventStreamAsSSE
    from devkit.clouds import bedrock_chunk
    from gateway.upstream import UpstreamError

    frame = bytearray(bedrock_chunk(b'data: {"type":"ping"}\n\n'))
    frame[-1] ^= 0xFF  # the message CRC no longer matches

    class Wire:
        status, headers, pieces = 200, {}, [bytes(frame)]

        def read(self):
            return self.pieces.pop() if self.pieces else b""

    with pytest.raises(UpstreamError) as exc:
        EventStreamAsSSE(Wire()).read()
    assert exc.value.kind == "network"


def test_count_tokens_is_not_served(bedrock, fake):
    resp = Client().post(
        "/v1/messages/count_tokens",
        data=json.dumps(message("br-haiku")),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {bedrock.key}",
    )
    assert resp.status_code == 400 and "it serves /v1/messages" in resp.json()["error"]["message"]


def test_the_region_comes_from_the_runtime_endpoint_when_not_given(catalog):
    from core import hostkinds

    kind = hostkinds.get("bedrock")
    host = Host(kind="bedrock", base_url="https://bedrock-runtime.ap-northeast-1.amazonaws.com", options={})
    assert kind.region(host) == "ap-northeast-1"
    assert kind.region(Host(kind="bedrock", base_url="http://127.0.0.1:1", options={})) == "us-east-1"


def test_the_fake_checks_the_signature_over_the_bytes_sent(fake):
    fake.clouds.bedrock_keys[ACCESS_KEY_ID] = SECRET
    url = f"{fake.url}/model/{MODEL_ID.replace(':', '%3A')}/invoke"
    body = json.dumps({"anthropic_version": "bedrock-2023-05-31", "max_tokens": 8, "messages": []}).encode()
    signed = {"Content-Type": "application/json", **sigv4_headers(ACCESS_KEY_ID, SECRET, None, "us-east-1", body, url)}
    assert requests.post(url, data=body, headers=signed, timeout=10).status_code == 200
    tampered = body.replace(b"8", b"9")
    resp = requests.post(url, data=tampered, headers=signed, timeout=10)
    assert resp.status_code == 403 and "signature" in resp.json()["message"]
    assert requests.post(url, data=body, timeout=10).json() == {"message": "Missing Authentication Token"}
    stranger = sigv4_headers("AKIAUNKNOWNKEY000001", SECRET, None, "us-east-1", body, url)
    resp = requests.post(url, data=body, headers={"Content-Type": "application/json", **stranger}, timeout=10)
    assert resp.status_code == 403 and "security token" in resp.json()["message"]
    with_model = json.dumps({"anthropic_version": "bedrock-2023-05-31", "model": "x", "messages": []}).encode()
    signed = sigv4_headers(ACCESS_KEY_ID, SECRET, None, "us-east-1", with_model, url)
    resp = requests.post(url, data=with_model, headers={"Content-Type": "application/json", **signed}, timeout=10)
    assert resp.status_code == 400 and "extraneous key [model]" in resp.json()["message"]


def refused(doc: dict) -> str:
    with pytest.raises(ConfigError) as exc:
        apply_config(doc)
    return str(exc.value)


def test_apply_refuses_a_bedrock_host_without_credentials_or_with_a_bad_region(catalog, fake):
    hosts = Host.objects.count()
    assert "hosts[0]: options: 'access_key_id' is required" in refused(
        {"hosts": [{"name": "b", "kind": "bedrock", "base_url": fake.url}]}
    )
    assert "'region' 'Paris' is not an AWS region" in refused(
        {
            "hosts": [
                {
                    "name": "b",
                    "kind": "bedrock",
                    "base_url": fake.url,
                    "access_key_id": ACCESS_KEY_ID,
                    "region": "Paris",
                }
            ]
        }
    )
    assert "does not start with" in refused(
        {
            "hosts": [
                {
                    "name": "b",
                    "kind": "bedrock",
                    "base_url": fake.url,
                    "access_key_id": ACCESS_KEY_ID,
                    "session_token_env": "DATABASE_URL",
                }
            ]
        }
    )
    gpt = {
        "models": [{"name": "g", "provider": "openai"}],
        "bindings": [{"model": "g", "host": "b", "adapter": "openai"}],
    }
    host = {"name": "b", "kind": "bedrock", "base_url": fake.url, "access_key_id": ACCESS_KEY_ID}
    assert "a bedrock host serves adapter anthropic, not openai" in refused({"hosts": [host], **gpt})
    assert Host.objects.count() == hosts


def test_the_demo_catalogs_bedrock_host_answers_signed_by_the_demo_key(fake, monkeypatch):
    from pathlib import Path

    from django.conf import settings

    from core.models import ServiceAccount
    from core.services import create_relay_key
    from relay.config_apply import load_file

    doc = load_file(str(Path(settings.BASE_DIR) / "deploy" / "demo-catalog.yaml"))
    for host in doc["hosts"]:
        host["base_url"] = host["base_url"].replace("http://127.0.0.1:8090", fake.url)
    monkeypatch.setenv("RELAY_HOSTKEY_DEMO", "demo-upstream-key")
    apply_config(doc)
    _, key = create_relay_key(service_account=ServiceAccount.objects.get(name="demo-client"), name="t")
    resp = Client().post(
        "/v1/messages",
        data=json.dumps(message("bedrock-claude-3-5-haiku")),
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {key}",
    )
    assert resp.status_code == 200, resp.content
    assert fake.received[-1]["path"] == "/model/anthropic.claude-3-5-haiku-20241022-v1%3A0/invoke"
