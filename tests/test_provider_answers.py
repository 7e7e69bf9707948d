"""Provider answers that must not crash, stall or leak: Retry-After, host-key echo,
`openrelay` never forwarded; plus the parsers behind them."""

import json
import logging
import time
from email.utils import formatdate

import pytest
from django.test import Client

from core import jsonguard, scrub
from core.retry_after import MAX_SECONDS, parse_retry_after
from devkit.upstream import Reply
from policies import breaker

CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
KEYS = ["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"]


# --- parsers --------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["inf", "nan", "1e400", "1e12", "-5", "soon", "", "0x10", "Infinity", "1_0"])
def test_retry_after_ignores_anything_but_seconds_or_a_date(value):
    assert parse_retry_after(value) is None


def test_retry_after_seconds_dates_and_the_cap():
    now = 1_700_000_000.0
    assert parse_retry_after("7", now=now) == 7.0
    assert parse_retry_after("1.5", now=now) == 1.5
    assert parse_retry_after("99999999999999999999", now=now) == MAX_SECONDS
    assert parse_retry_after(formatdate(now + 120, usegmt=True), now=now) == pytest.approx(120, abs=1)
    assert parse_retry_after(formatdate(now + 10**9, usegmt=True), now=now) == MAX_SECONDS
    assert parse_retry_after(formatdate(now - 50, usegmt=True), now=now) == 0.0


@pytest.mark.parametrize(
    "raw,code,path",
    [
        ('{"a": "x\\u0000"}', "invalid_characters", "a"),
        ('{"a": [1, {"b": "\\ud800"}]}', "invalid_characters", "a[1].b"),
        ('{"a\\u0000": 1}', "invalid_characters", ""),
        ('{"a": NaN}', "non_finite_number", ""),
        ('{"a": -Infinity}', "non_finite_number", ""),
        ('{"a": 1e400}', "non_finite_number", ""),
        ("[" * 10_000 + "]" * 10_000, "nesting_too_deep", ""),
        ("[" * 65 + "]" * 65, "nesting_too_deep", "[0]" * 64),
        ("{", "invalid_json", ""),
        (b"\xff", "invalid_json", ""),
    ],
)
def test_jsonguard_refuses_with_code_and_path(raw, code, path):
    with pytest.raises(jsonguard.JSONGuardError) as info:
        jsonguard.loads(raw)
    assert info.value.code == code
    assert info.value.path == path


def test_jsonguard_accepts_ordinary_json_and_a_bom():
    parsed = jsonguard.loads(b'\xef\xbb\xbf{"a": [1.5, "\\ud83d\\ude00", {"b": null}]}')
    assert parsed == {"a": [1.5, "😀", {"b": None}]}
    assert jsonguard.loads("[" * 64 + "]" * 64)


def test_scrubber_removes_known_values_from_bytes_text_headers_and_logs(caplog):
    scrub.forget_all()
    scrub.remember("sk-secret-value-123")
    cleaned = scrub.scrub_bytes(b'{"m": "bad key sk-secret-value-123"}')
    assert cleaned == b'{"m": "bad key ' + scrub.REDACTED.encode() + b'"}'
    assert scrub.scrub_headers({"X": "sk-secret-value-123"}) == {"X": scrub.REDACTED}
    record = logging.LogRecord("x", 40, __file__, 1, "key %s", ("sk-secret-value-123",), None)
    scrub.ScrubFilter().filter(record)
    assert "sk-secret-value-123" not in record.getMessage()
    scrub.forget_all()


# --- live requests ----------------------------------------------------------------------------


@pytest.fixture
def live(catalog, fake):
    client = Client(raise_request_exception=False)

    def post(body, path="/v1/chat/completions"):
        return client.post(path, data=json.dumps(body), content_type="application/json", **_auth(catalog.key))

    return post


def _auth(key):
    return {"HTTP_AUTHORIZATION": f"Bearer {key}"}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "value,expected",
    [
        ("inf", None),
        ("nan", None),
        ("1e400", None),
        ("1e12", None),
        ("1000000000000", int(MAX_SECONDS)),
        ("30", 30),
        ("date+90", 90),
    ],
)
def test_upstream_retry_after_is_bounded_for_breakers_and_clients(live, fake, value, expected):
    if value == "date+90":
        value = formatdate(time.time() + 90, usegmt=True)
    fake.script("*", [Reply(status=429, headers={"Retry-After": value}) for _ in range(3)])
    resp = live(CHAT)
    assert resp.status_code == 429, resp.content
    if expected is None:
        assert "Retry-After" not in resp
    else:
        assert abs(int(resp["Retry-After"]) - expected) <= 2
    # No key is benched for longer than the cap.
    from core.crypto import sha256_hex

    for key in KEYS:
        until = breaker.snapshot(sha256_hex(key)[:12])["open_until"]
        assert until is None or until - time.time() <= MAX_SECONDS + 60, (key, until)


@pytest.mark.django_db(transaction=True)
def test_a_provider_echoing_the_host_key_never_shows_it_to_the_tenant(live, fake, caplog):
    for key in KEYS:
        body = {"error": {"message": f"Incorrect API key provided: {key}.", "type": "invalid_request_error"}}
        fake.script(key, [Reply(status=401, body=body, headers={"X-Echo": key})])
    resp = live(CHAT)
    assert resp.status_code == 401, resp.content
    text = resp.content.decode() + json.dumps(dict(resp.items()))
    assert not any(k in text for k in KEYS), text
    assert scrub.REDACTED in resp.content.decode()
    from usage.models import UsageEvent

    assert not any(k in e.error_message for e in UsageEvent.objects.all() for k in KEYS)
    assert not any(k in r.getMessage() for r in caplog.records for k in KEYS)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/openai/v1/chat/completions"])
def test_openrelay_never_reaches_the_provider_on_live_routes(live, fake, path):
    body = {**CHAT, "openrelay": {"tool_config": {"tools": [{"type": "http", "authorization": "Bearer tool-secret"}]}}}
    resp = live(body, path)
    assert resp.status_code == 200, resp.content
    sent = fake.received[-1]
    assert "openrelay" not in sent["body"] and "tool-secret" not in json.dumps(sent["body"])


@pytest.mark.django_db(transaction=True)
def test_live_body_with_non_finite_numbers_is_refused_not_forwarded(live, fake, catalog):
    client = Client(raise_request_exception=False)
    for raw in (b'{"model": "gpt-4o", "temperature": NaN}', b'{"model": "gpt-4o", "temperature": 1e400}'):
        resp = client.post("/v1/chat/completions", data=raw, content_type="application/json", **_auth(catalog.key))
        assert resp.status_code == 400
        assert resp.json()["error"]["code"] == "non_finite_number"
        assert resp.json()["error"].get("param") in (None, "temperature")
    assert fake.received == []
