"""The dispatch pipeline over real HTTP: relay (live server) → fake upstream (loopback)."""

import threading
import time

import pytest
import requests
from django.test import override_settings

from core.models import HostBinding, HostKey, LLMModel
from devkit.upstream import Reply
from policies.models import Policy
from tests import factories
from usage.models import UsageEvent

pytestmark = pytest.mark.django_db(transaction=True)

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hello there relay"}]}


@pytest.fixture
def relay(live_server, catalog):
    class Client:
        url = live_server.url
        key = catalog.key

        def post(self, path, body, headers=None, key=None):
            h = {"Authorization": f"Bearer {key or catalog.key}"}
            h.update(headers or {})
            resp = requests.post(self.url + path, json=body, headers=h, timeout=30)
            if resp.headers.get("X-WR-Origin") == "upstream":
                wait_for_event(resp)
            return resp

    before = set(threading.enumerate())
    yield Client()
    # A usage event is written after its answer is sent: let the live server finish this test's
    # requests (their handler threads end after the response's closers ran), so none lands in the
    # next test. A thread an earlier test left behind is not waited for.
    httpd = live_server.thread.httpd
    deadline = time.monotonic() + 10
    for thread in set(threading.enumerate()) - before:
        if getattr(getattr(thread, "_target", None), "__self__", None) is httpd:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def wait_for_event(resp) -> None:
    """The usage event of a dispatched request is written just after its answer is sent
    (gateway/inference.py): wait for it before looking at usage."""
    request_id = resp.headers["X-Relay-Request-ID"]
    deadline = time.monotonic() + 10
    while not UsageEvent.objects.filter(request_id=request_id).exists():
        assert time.monotonic() < deadline, f"no usage event for {request_id}"
        time.sleep(0.005)


def error_of(resp):
    return resp.json()["error"]


# --- happy paths and adapters ---------------------------------------------------


def test_chat_completion_goes_upstream_with_rewritten_model_and_key(relay, fake):
    resp = relay.post("/v1/chat/completions", CHAT, headers={"X-WR-Trace": "secret", "X-Request-ID": "abc"})
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-WR-Origin"] == "upstream"
    assert resp.json()["object"] == "chat.completion"
    sent = fake.received[-1]
    assert sent["path"] == "/v1/chat/completions"
    assert sent["body"]["model"] == "gpt-4o-2024-08-06"
    assert sent["headers"]["Authorization"] == "Bearer upstream-openai-0"
    # Caller credentials and X-WR-* never reach the upstream.
    assert relay.key not in str(sent["headers"]) and not any(h.lower().startswith("x-wr-") for h in sent["headers"])


def test_openai_prefixed_path_and_x_api_key(relay, fake):
    resp = requests.post(relay.url + "/openai/v1/chat/completions", json=CHAT, headers={"x-api-key": relay.key})
    assert resp.status_code == 200


def test_anthropic_adapter_sends_x_api_key_and_version(relay, fake):
    body = {"model": "claude-sonnet", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    resp = relay.post("/anthropic/v1/messages", body)
    assert resp.status_code == 200, resp.text
    sent = fake.received[-1]
    assert sent["path"] == "/v1/messages"
    assert sent["headers"]["x-api-key"] == "upstream-anthropic-0"
    assert sent["headers"]["anthropic-version"] == "2023-06-01"
    assert "Authorization" not in sent["headers"]
    assert resp.json()["type"] == "message"


def test_responses_adapter(relay, fake):
    resp = relay.post("/v1/responses", {"model": "gpt-resp", "input": "hello"})
    assert resp.status_code == 200, resp.text
    assert fake.received[-1]["path"] == "/v1/responses"
    assert fake.received[-1]["body"]["model"] == "gpt-4.1"
    event = UsageEvent.objects.get()
    assert event.input_tokens == 1 and event.output_tokens > 0


def test_embeddings_and_completions_paths(relay, fake):
    assert relay.post("/v1/embeddings", {"model": "gpt-4o", "input": ["a b", "c"]}).status_code == 200
    assert relay.post("/v1/completions", {"model": "gpt-4o", "prompt": "say"}).status_code == 200
    assert [r["path"] for r in fake.received] == ["/v1/embeddings", "/v1/completions"]


def test_wrong_shape_for_binding_is_400(relay, fake):
    resp = relay.post("/v1/messages", {"model": "gpt-4o", "max_tokens": 5, "messages": []})
    assert resp.status_code == 400 and error_of(resp)["code"] == "cross_shape_dispatch"
    assert fake.received == []


def test_stream_true_on_a_route_that_does_not_stream_is_a_clear_400(relay, fake):
    # Chat completions, responses and messages stream (tests/test_streaming.py); embeddings do not.
    resp = relay.post("/v1/embeddings", {"model": "gpt-4o", "input": "x", "stream": True})
    assert resp.status_code == 400
    assert error_of(resp)["code"] == "streaming_unsupported" and "stream" in error_of(resp)["message"]
    assert fake.received == []


def test_bad_bodies(relay):
    h = {"Authorization": f"Bearer {relay.key}", "Content-Type": "application/json"}
    assert requests.post(relay.url + "/v1/chat/completions", data=b"{nope", headers=h).status_code == 400
    assert requests.post(relay.url + "/v1/chat/completions", data=b"[1]", headers=h).status_code == 400
    resp = relay.post("/v1/chat/completions", {"messages": []})
    assert resp.status_code == 400 and "model" in error_of(resp)["message"]


def test_body_over_limit_is_413(relay):
    with override_settings(RELAY_MAX_REQUEST_BYTES=1000):
        resp = relay.post("/v1/chat/completions", dict(CHAT, padding="x" * 2000))
    assert resp.status_code == 413


# --- routing errors ---------------------------------------------------------------


def test_model_not_found(relay):
    resp = relay.post("/v1/chat/completions", dict(CHAT, model="nope"))
    assert resp.status_code == 404 and error_of(resp)["code"] == "model_not_found"
    assert resp.headers["X-WR-Origin"] == "relay"
    wait_for_event(resp)
    event = UsageEvent.objects.get()
    assert event.status == 0 and event.error_kind == "model_not_found" and event.cost_nano_usd is None


def test_model_not_allowed(relay, catalog):
    Policy.objects.filter(pk=catalog.policy.pk).update(grants=["anthropic/*"])
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 403 and error_of(resp)["code"] == "model_not_allowed"


@pytest.mark.parametrize(
    "grants,allowed",
    [
        (["openai/gpt-4o@openai"], True),
        (["openai/gpt-4o"], True),
        (["openai/gpt-4o@*"], True),
        (["openai/*"], True),
        (["openai"], True),
        (["*"], True),
        (["openai/gpt-4o@azure"], False),
        (["openai/gpt-4o-mini"], False),
        (["anthropic"], False),
    ],
)
def test_grant_forms(relay, catalog, grants, allowed):
    Policy.objects.filter(pk=catalog.policy.pk).update(grants=grants)
    resp = relay.post("/v1/chat/completions", CHAT)
    assert (resp.status_code == 200) is allowed, resp.text


def test_policy_disabled(relay, catalog):
    Policy.objects.filter(pk=catalog.policy.pk).update(enabled=False)
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 403 and error_of(resp)["code"] == "policy_disabled"


def test_no_policy(relay, catalog):
    from core.models import ServiceAccount
    from core.services import create_relay_key

    sa = ServiceAccount.objects.create(project=catalog.project, name="no-policy")
    _, key = create_relay_key(service_account=sa)
    resp = relay.post("/v1/chat/completions", CHAT, key=key)
    assert resp.status_code == 403 and error_of(resp)["code"] == "no_policy"


def test_no_host_binding(relay):
    HostBinding.objects.filter(model__name="gpt-4o").update(enabled=False)
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_host_binding"


def test_no_keys(relay):
    HostKey.objects.filter(host__name="openai").update(enabled=False)
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_keys"


# --- rate limits ------------------------------------------------------------------


def test_inbound_limit_spent_gives_429_with_integer_retry_after(relay, catalog):
    rl = factories.rate_limit("two-per-minute", ("requests", 2, 60, "fixed-window"))
    Policy.objects.filter(pk=catalog.policy.pk).update(rate_limit=rl)
    assert relay.post("/v1/chat/completions", CHAT).status_code == 200
    assert relay.post("/v1/chat/completions", CHAT).status_code == 200
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 429
    assert error_of(resp)["code"] == "rate_limit_exceeded" and error_of(resp)["type"] == "rate_limit_error"
    assert "budget exceeded: requests" in error_of(resp)["message"]
    assert int(resp.headers["Retry-After"]) >= 1 and resp.headers["X-WR-Origin"] == "relay"
    wait_for_event(resp)
    assert UsageEvent.objects.filter(error_kind="rate_limit_exceeded").count() == 1


def test_token_meter_charged_after_response(relay, catalog):
    rl = factories.rate_limit("few-tokens", ("tokens", 10, 60, "sliding-window"))
    Policy.objects.filter(pk=catalog.policy.pk).update(rate_limit=rl)
    long_prompt = {"model": "gpt-4o", "messages": [{"role": "user", "content": "word " * 30}]}
    assert relay.post("/v1/chat/completions", long_prompt).status_code == 200  # allowed, then charged
    assert relay.post("/v1/chat/completions", CHAT).status_code == 429


def test_spent_upstream_tier_skips_the_key(relay, catalog, fake):
    tier = factories.rate_limit("tier-1", ("requests", 1, 60, "fixed-window"))
    HostKey.objects.filter(name="openai-0").update(rate_limit=tier)
    relay.post("/v1/chat/completions", CHAT)
    relay.post("/v1/chat/completions", CHAT)
    assert [r["key"] for r in fake.received] == ["upstream-openai-0", "upstream-openai-1"]


# --- key selection ------------------------------------------------------------------


def test_prioritized_always_uses_the_first_healthy_key(relay, fake):
    for _ in range(3):
        relay.post("/v1/chat/completions", CHAT)
    assert {r["key"] for r in fake.received} == {"upstream-openai-0"}


def test_round_robin_rotates(relay, catalog, fake):
    Policy.objects.filter(pk=catalog.policy.pk).update(key_selection="round-robin")
    for _ in range(6):
        relay.post("/v1/chat/completions", CHAT)
    keys = [r["key"] for r in fake.received]
    assert sorted(keys) == sorted(["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"] * 2)
    assert keys[:3] == keys[3:]


def test_least_recently_used(relay, catalog, fake):
    Policy.objects.filter(pk=catalog.policy.pk).update(key_selection="least-recently-used")
    for _ in range(4):
        relay.post("/v1/chat/completions", CHAT)
    keys = [r["key"] for r in fake.received]
    assert keys[:3] == ["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"]
    assert keys[3] == "upstream-openai-0"


# --- breakers and failover --------------------------------------------------------------


def test_failover_across_three_keys(relay, fake):
    fake.script("upstream-openai-0", [Reply(status=500, body={"error": {"message": "boom 0"}})])
    fake.script("upstream-openai-1", [Reply(status=503, body={"error": {"message": "boom 1"}})])
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 200
    assert [r["key"] for r in fake.received] == ["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"]
    assert UsageEvent.objects.get().attempts == 3


def test_all_keys_fail_gives_last_upstream_status_and_body(relay, fake):
    for i in range(3):
        fake.script(f"upstream-openai-{i}", [Reply(status=502, body={"error": {"message": f"down {i}"}})])
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 502
    assert resp.json() == {"error": {"message": "down 2"}}
    assert resp.headers["X-WR-Origin"] == "upstream" and resp.headers["X-WR-Upstream-Status"] == "502"
    event = UsageEvent.objects.get()
    assert event.status == 502 and event.error_kind == "upstream_error" and event.attempts == 3


def test_client_error_is_not_failed_over(relay, fake):
    fake.script("upstream-openai-0", [Reply(status=400, body={"error": {"message": "bad param"}})])
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 400 and resp.json()["error"]["message"] == "bad param"
    assert len(fake.received) == 1


def test_401_opens_the_key_and_later_requests_skip_it(relay, fake):
    from core.crypto import sha256_hex
    from policies import breaker

    fake.script("upstream-openai-0", [Reply(status=401, body={"error": {"message": "bad key"}})])
    assert relay.post("/v1/chat/completions", CHAT).status_code == 200  # failed over to key 1
    snap = breaker.snapshot(sha256_hex("upstream-openai-0")[:12])
    assert snap["state"] == "open" and snap["reason"] == "upstream_auth_failed"
    assert relay.post("/v1/chat/completions", CHAT).status_code == 200
    assert [r["key"] for r in fake.received] == ["upstream-openai-0", "upstream-openai-1", "upstream-openai-1"]


def test_long_429_opens_for_retry_after_short_one_does_not(relay, fake):
    from core.crypto import sha256_hex
    from policies import breaker

    fake.script("upstream-openai-0", [Reply(status=429, headers={"Retry-After": "2"}, body={"error": {}})])
    relay.post("/v1/chat/completions", CHAT)
    assert breaker.snapshot(sha256_hex("upstream-openai-0")[:12])["state"] == "closed"
    fake.script("upstream-openai-0", [Reply(status=429, headers={"Retry-After": "30"}, body={"error": {}})])
    relay.post("/v1/chat/completions", CHAT)
    snap = breaker.snapshot(sha256_hex("upstream-openai-0")[:12])
    assert snap["state"] == "open" and snap["reason"] == "upstream_rate_limited"


def test_unreachable_host_fails_over_and_benches_every_key_it_tried(relay, catalog, fake):
    from core.crypto import sha256_hex
    from policies import breaker

    catalog.hosts["openai"].base_url = "http://127.0.0.1:1"
    catalog.hosts["openai"].save()
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 502 and error_of(resp)["code"] == "upstream_unreachable"
    # Not the request's doing (no byte of it left): every key tried is benched for everyone, so the
    # next caller is told at once rather than waiting out a connect attempt per key.
    snaps = [breaker.snapshot(sha256_hex(f"upstream-openai-{i}")[:12]) for i in range(3)]
    assert {(s["state"], s["reason"]) for s in snaps} == {("open", "upstream_unreachable")}
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_keys"


def test_every_breaker_open_means_no_keys(relay, fake):
    for i in range(3):
        fake.script(f"upstream-openai-{i}", [Reply(status=401, body={"error": {}})])
    assert relay.post("/v1/chat/completions", CHAT).status_code == 401
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_keys"


# --- deadline ------------------------------------------------------------------------


def test_deadline_is_enforced_against_a_dripping_upstream(relay, fake):
    fake.script("*", [Reply(drip_seconds=20)])
    with override_settings(RELAY_UPSTREAM_DEADLINE=1.5):
        resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 504 and error_of(resp)["code"] == "timeout"
    wait_for_event(resp)
    assert UsageEvent.objects.get().error_kind == "timeout"


# --- usage events and cost --------------------------------------------------------------


def test_usage_event_tokens_and_cost(relay, catalog):
    resp = relay.post("/v1/chat/completions", CHAT)
    event = UsageEvent.objects.get()
    usage = resp.json()["usage"]
    assert event.request_id == resp.headers["X-Relay-Request-ID"]
    assert (event.source, event.status, event.model, event.host, event.policy) == (
        "live",
        200,
        "gpt-4o",
        "openai",
        "pol-a",
    )
    assert event.project == "proj-a" and event.team == "team-a" and event.principal_kind == "serviceaccount"
    assert event.input_tokens == usage["prompt_tokens"] and event.output_tokens == usage["completion_tokens"]
    # $2.50 / Mtok input, $10 / Mtok output, in integer nano-USD.
    expected = event.input_tokens * 2_500 + event.output_tokens * 10_000
    assert event.cost_nano_usd == expected


def test_unpriced_binding_records_null_cost(relay):
    body = {"model": "claude-sonnet", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}
    relay.post("/v1/messages", body)
    event = UsageEvent.objects.get()
    assert event.input_tokens > 0 and event.cost_nano_usd is None


def test_model_unknown_to_catalog_but_granted_wildcard(relay):
    LLMModel.objects.create(name="orphan", provider="openai")
    resp = relay.post("/v1/chat/completions", dict(CHAT, model="orphan"))
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_host_binding"


def test_the_provider_is_asked_for_an_uncompressed_answer(relay, fake):
    # The answer is passed on as the bytes that came: a gzip answer would reach the caller as gzip.
    assert relay.post("/v1/chat/completions", CHAT).status_code == 200
    headers = {k.lower(): v for k, v in fake.received[-1]["headers"].items()}
    assert headers["accept-encoding"] == "identity"
    assert headers["authorization"] == "Bearer upstream-openai-0" and headers["content-type"] == "application/json"
    assert fake.received[-1]["body"]["model"] == "gpt-4o-2024-08-06"  # the whole body arrived (Content-Length)


def test_keys_whose_secret_cannot_be_read_are_named_as_such_not_as_cooling_down(relay, catalog, fake, caplog):
    unset = {"value_env": "RELAY_HOSTKEY_TEST_UNSET", "value_encrypted": ""}
    HostKey.objects.filter(host=catalog.hosts["openai"]).update(**unset)
    resp = relay.post("/v1/chat/completions", CHAT)
    assert resp.status_code == 503 and error_of(resp)["code"] == "no_keys"
    message = error_of(resp)["message"]
    assert "cannot read their secrets" in message and "cooling down" not in message
    assert "RELAY_HOSTKEY_TEST_UNSET" not in message  # the variable's name is the operator's, in the log
    assert any("$RELAY_HOSTKEY_TEST_UNSET" in r.getMessage() for r in caplog.records)
    assert not fake.received  # no provider was called
