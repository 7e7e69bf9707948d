"""No secret reaches a tenant or the disk in any encoding: the scrubber's property test, every path a
provider's words travel (live answers, native and Anthropic results, OpenAI error files, attempts,
usage events, logs), transport errors without internal addresses, and the clean-up of what an older
relay stored."""

import base64
import html
import io
import itertools
import json
import logging
import re
import socket
import urllib.parse

import pytest
from django.core.management import call_command
from django.test import Client
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batches import ingest, storage
from batches.lifecycle import claim as claims
from batches.models import Attempt, Batch, File, FilePurpose, Item
from batches.surfaces.anthropic import create as anthropic_create
from batches.surfaces.anthropic import read as anthropic_read
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import finalize, validation
from batches.worker import execute
from core import auth, scrub
from core.models import Host
from devkit.upstream import Reply
from usage.models import UsageEvent

OPENAI_KEYS = ["upstream-openai-0", "upstream-openai-1", "upstream-openai-2"]
ANTHROPIC_KEY = "upstream-anthropic-0"
ALL_KEYS = OPENAI_KEYS + [ANTHROPIC_KEY]


# --- an oracle: every layer a reader could decode a text into, with the standard library -----------


_JSON_SHORT = {"\\": "\\", "/": "/", '"': '"', "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _unescape_json(text: str) -> str:
    """One level of JSON string escapes, as json.loads reads them (lenient about what is not one)."""
    return re.sub(
        r'\\(?:u([0-9a-fA-F]{4})|([\\/"bfnrt]))',
        lambda m: chr(int(m.group(1), 16)) if m.group(1) else _JSON_SHORT[m.group(2)],
        text,
    )


def _layers(text: str, depth: int = 0) -> list[str]:
    out = [text]
    for decode in (_unescape_json, urllib.parse.unquote, html.unescape):
        decoded = decode(text)
        if decoded != text and depth < 4:
            out += _layers(decoded, depth + 1)
    if depth < 4:
        # Base64 wrapped over lines is one run to a reader; a prefix glued to a run is not part of it.
        joined = re.sub(r"(?<=[A-Za-z0-9+/_=-])(?:\r?\n|\\n)(?=[A-Za-z0-9+/_-])", "", text)
        for run in re.findall(r"[A-Za-z0-9+/_=-]{12,}", joined):
            tails = [run] + [run[i + 1 :] for i, c in enumerate(run[:64]) if c in "/_-"]
            for tail, alphabet in itertools.product(tails, (base64.b64decode, base64.urlsafe_b64decode)):
                try:
                    raw = alphabet(tail.rstrip("=") + "=" * (-len(tail.rstrip("=")) % 4))
                except ValueError:
                    continue
                out += _layers(raw.decode("latin-1"), depth + 1)
    return out


def exposed(text: str, secrets=ALL_KEYS) -> list[str]:
    return [s for s in secrets if any(s in layer for layer in _layers(text))]


# --- the property: many encodings of a known key, nested in one another -----------------------------


def _escape_some(value: str, mask: list[bool], form, always: str) -> str:
    """The masked characters escaped; `always`: the escape character itself, which an encoder must escape."""
    return "".join(form(c) if mask[i % len(mask)] or c in always else c for i, c in enumerate(value))


def _json_u(s: str, mask: list[bool], upper: bool) -> str:
    """A JSON string's inside, with the masked characters as \\uXXXX (a backslash or quote is always escaped)."""
    form = "04X" if upper else "04x"
    return "".join(f"\\u{ord(c):{form}}" if mask[i % len(mask)] or c in '\\"' else c for i, c in enumerate(s))


ENCODERS = {
    "json_u": _json_u,
    "json_string": lambda s, mask, upper: json.dumps(s)[1:-1],
    "percent": lambda s, mask, upper: _escape_some(s, mask, lambda c: f"%{ord(c):02{'X' if upper else 'x'}}", "%"),
    "percent_all": lambda s, mask, upper: urllib.parse.quote(s, safe=""),
    "html": lambda s, mask, upper: _escape_some(s, mask, lambda c: f"&#x{ord(c):x};" if upper else f"&#{ord(c)};", "&"),
    "base64": lambda s, mask, upper: base64.b64encode(s.encode()).decode(),
    "base64url": lambda s, mask, upper: base64.urlsafe_b64encode(s.encode()).decode().rstrip("="),
}

key_text = st.text(
    alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_", min_size=12, max_size=48
)
context = st.text(alphabet=" abcxyz:.,{}\"'=\n", max_size=20)


# Derandomized: the same 1,000 chains in every run, so CI cannot turn red on a new draw (60,000 random
# chains were run by hand against this scrubber; widen max_examples and drop derandomize to explore).
@settings(max_examples=1000, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(
    key=key_text,
    chain=st.lists(st.sampled_from(sorted(ENCODERS)), min_size=0, max_size=3),
    mask=st.lists(st.booleans(), min_size=1, max_size=7),
    upper=st.booleans(),
    before=context,
    after=context,
)
def test_no_encoding_of_a_known_key_survives_the_scrubber(key, chain, mask, upper, before, after):
    scrub.forget_all()
    scrub.remember(key)
    text = f"invalid api key {key} given"
    for name in chain:
        text = ENCODERS[name](text, mask, upper)
    body = f"{before} {text} {after}"
    try:
        assert exposed(body, [key]), (chain, body)  # the oracle sees the key before the scrub
        clean = scrub.scrub_text(body, load=False)
        assert not exposed(clean, [key]), (chain, body, clean)
        raw = scrub.scrub_bytes(body.encode(), load=False).decode()
        assert not exposed(raw, [key]), (chain, body, raw)
    finally:
        scrub.forget_all()


def test_the_settings_secrets_and_relay_keys_are_redacted_by_shape_too(settings):
    scrub.forget_all()
    relay_key = "sk-wr-" + "Ab9_-" * 13
    for text in (
        f"key {relay_key}",
        f"key {relay_key}".replace("-", "\\u002d"),
        f"token {settings.RELAY_ADMIN_TOKEN}",
        f"master {urllib.parse.quote(settings.RELAY_MASTER_KEY, safe='')}".replace("-", "%2D"),
    ):
        clean = scrub.scrub_text(text, load=False)
        assert scrub.REDACTED in clean, text
        assert not exposed(clean, [relay_key, settings.RELAY_ADMIN_TOKEN, settings.RELAY_MASTER_KEY]), clean


def test_a_json_body_is_redacted_on_its_decoded_form_and_stays_valid_json():
    scrub.forget_all()
    scrub.remember("upstream-openai-0")
    raw = b'{"error": {"message": "invalid x-api-key upstream\\u002dopenai\\u002D0", "n": 1}}'
    clean = scrub.scrub_bytes(raw, load=False)
    parsed = json.loads(clean)
    assert "upstream-openai-0" not in parsed["error"]["message"] and scrub.REDACTED in parsed["error"]["message"]
    assert parsed["error"]["n"] == 1
    assert scrub.scrub_bytes(b'{"ok": "caf\\u00e9 \\n"}', load=False) == b'{"ok": "caf\\u00e9 \\n"}'
    scrub.forget_all()


# --- every path a provider's words travel --------------------------------------------------------


def _escaped_echo(key: str) -> bytes:
    """A provider's 400 that names the key with every `-` written as a JSON escape, once more as
    percent-encoded, and once in base64."""
    escaped = key.replace("-", "\\u002d")
    b64 = base64.b64encode(f"Bearer {key}".encode()).decode()
    return (
        '{"type":"error","error":{"type":"invalid_request_error","message":"invalid x-api-key '
        f'{escaped}; url key={urllib.parse.quote(key).replace("-", "%2D")}; auth {b64}"}}}}'
    ).encode()


def _script_all(fake, times=6):
    for key in ALL_KEYS:
        fake.script(key, [Reply(status=400, raw=_escaped_echo(key)) for _ in range(times)])


def _auth(catalog):
    return {"HTTP_AUTHORIZATION": f"Bearer {catalog.key}"}


CHAT = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "claude-sonnet", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "path,body",
    [("/v1/chat/completions", CHAT), ("/v1/messages", MESSAGES), ("/anthropic/v1/messages", MESSAGES)],
)
def test_live_answers_never_carry_an_escaped_key(catalog, fake, caplog, path, body):
    _script_all(fake)
    resp = Client().post(path, data=json.dumps(body), content_type="application/json", **_auth(catalog))
    assert resp.status_code == 400, resp.content
    text = resp.content.decode()
    assert not exposed(text), text
    assert not exposed(json.dumps(resp.json())), resp.json()
    assert scrub.REDACTED in json.dumps(resp.json())
    assert not any(exposed(e.error_message) for e in UsageEvent.objects.all())
    assert not any(exposed(r.getMessage()) for r in caplog.records)


def _read(resp) -> str:
    return (b"".join(resp.streaming_content) if resp.streaming else resp.content).decode()


def _run_all():
    while (item := claims.claim("test-runner")) is not None:
        execute.run_item(item)


@pytest.mark.django_db(transaction=True)
def test_native_and_anthropic_results_and_openai_error_files_carry_no_key(catalog, fake):
    _script_all(fake, times=20)
    principal = auth.principal_for_key(catalog.key)
    native = submit.submit_native(principal, io.BytesIO(json.dumps({"shape": "openai", "requests": [CHAT]}).encode()))
    anthropic_req = {"custom_id": "a", "params": MESSAGES}
    with ingest.read_submission(io.BytesIO(json.dumps({"requests": [anthropic_req]}).encode()), 10**8, 50) as sub:
        anth = anthropic_create.create(principal, sub)
    record = {"custom_id": "o", "method": "POST", "url": "/v1/chat/completions", "body": CHAT}
    body = {"endpoint": "/v1/chat/completions", "completion_window": "24h", "requests": [record]}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**8, 50) as sub:
        oai = openai_create.create(principal, sub)
    validation.validate(oai.id)
    _run_all()
    finalize.finalize(oai.id)

    native_results = _read(Client().get(f"/v1/batches/{native.id}/results", **_auth(catalog)))
    assert "upstream status 400" in native_results and not exposed(native_results), native_results
    b = Batch.objects.get(pk=anth.pk)
    anthropic_lines = b"".join(anthropic_read.iter_results(b)).decode()
    assert '"errored"' in anthropic_lines and not exposed(anthropic_lines), anthropic_lines
    for line in anthropic_lines.splitlines():
        assert not exposed(json.dumps(json.loads(line)))
    error_file = File.objects.get(pk=Batch.objects.get(pk=oai.pk).error_file_id)
    stored = b"".join(storage.iter_file(error_file.ref)).decode()
    assert stored and not exposed(stored), stored
    served = _read(Client().get(f"/v1/files/{error_file.public_id}/content", **_auth(catalog)))
    assert not exposed(served) and not exposed(json.dumps([json.loads(x) for x in served.splitlines()]))
    kept = [i.error_body + i.error for i in Item.objects.all()] + [
        a.error_body + a.error for a in Attempt.objects.all()
    ]
    assert kept and not any(exposed(text) for text in kept)


# --- transport errors: a fixed sentence and a code, never an address ------------------------------


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.django_db(transaction=True)
def test_an_unreachable_provider_is_named_by_cause_not_by_address(catalog, fake, caplog):
    port = _closed_port()
    Host.objects.filter(name__in=["openai", "anthropic"]).update(base_url=f"http://127.0.0.1:{port}")
    from core import catalog as relay_catalog

    relay_catalog.bump()
    caplog.set_level(logging.WARNING, logger="gateway.pipeline")
    resp = Client().post(
        "/v1/chat/completions", data=json.dumps(CHAT), content_type="application/json", **_auth(catalog)
    )
    assert resp.status_code == 502, resp.content
    error = resp.json()["error"]
    assert error["code"] == "upstream_unreachable"
    assert error["message"].startswith("the upstream provider could not be reached (request ")
    for leak in ("127.0.0.1", str(port), "NewConnectionError", "HTTPPool", "Max retries", "refused"):
        assert leak not in resp.content.decode(), resp.content
    # The operator still learns where: the log line under the request id.
    assert any(str(port) in r.getMessage() and "unreachable" in r.getMessage() for r in caplog.records)

    principal = auth.principal_for_key(catalog.key)
    with ingest.read_submission(
        io.BytesIO(json.dumps({"requests": [{"custom_id": "a", "params": MESSAGES}]}).encode()), 10**8, 50
    ) as sub:
        anth = anthropic_create.create(principal, sub)
    Batch.objects.filter(pk=anth.pk).update(max_attempts=1)
    Item.objects.filter(batch_id=anth.pk).update(max_attempts=1)
    _run_all()
    lines = b"".join(anthropic_read.iter_results(Batch.objects.get(pk=anth.pk))).decode()
    assert "upstream_unreachable" in lines, lines
    for leak in ("127.0.0.1", str(port), "NewConnectionError", "HTTPPool"):
        assert leak not in lines, lines
    assert not any(str(port) in i.error for i in Item.objects.all())


# --- what an older relay stored is cleaned by a command ---------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_scrub_secrets_cleans_stored_error_files_and_rows(catalog, fake):
    from batches.surfaces.openai.files import write_file

    principal = auth.principal_for_key(catalog.key)
    leaked = _escaped_echo("upstream-openai-1").decode()
    line = json.dumps({"id": "batch_req_x", "custom_id": "x", "response": None, "error": {"message": leaked}})
    native = submit.submit_native(principal, io.BytesIO(json.dumps({"shape": "openai", "requests": [CHAT]}).encode()))
    file = write_file(
        principal, purpose="batch_output", filename="e.jsonl", chunks=[f"{line}\n".encode()], batch_id=native.id
    )
    Item.objects.filter(batch_id=native.id).update(error=f"batch item: {leaked}"[:1000], error_body=leaked)
    scrub.forget_all()

    call_command("scrub_secrets", "--dry-run", stdout=io.StringIO())
    assert exposed(b"".join(storage.iter_file(File.objects.get(pk=file.pk).ref)).decode())  # dry run: untouched
    out = io.StringIO()
    call_command("scrub_secrets", stdout=out)
    assert f"redacted {file.public_id}" in out.getvalue() and "1 Item row(s)" in out.getvalue()
    f = File.objects.get(pk=file.pk)
    stored = b"".join(storage.iter_file(f.ref)).decode()
    assert not exposed(stored) and scrub.REDACTED in stored and f.bytes == len(stored.encode())
    assert json.loads(stored.splitlines()[0])["custom_id"] == "x"
    item = Item.objects.get(batch_id=native.id)
    assert not exposed(item.error) and not exposed(item.error_body)
    assert f.purpose == FilePurpose.BATCH_OUTPUT


# --- forms a review found passing: a run holding a secret twice, a prefix glued to a run, wrapped
# base64, HTML references without `;` or with long zero padding ---------------------------------------


@pytest.mark.parametrize(
    "form",
    [
        # one secret plain and another escaped in the same base64 run: the run goes whole
        lambda k: base64.b64encode(f"{k} and {k.replace('-', chr(92) + 'u002d')}".encode()).decode(),
        # a path glued to the front of base64url shifts its alignment
        lambda k: (
            "/files/x/"
            + base64.urlsafe_b64encode(json.dumps({"k": k}).replace("-", "\\u002d").encode()).decode().rstrip("=")
        ),
        # base64 wrapped over lines, as MIME and PEM write it, and with JSON's escaped line breaks
        lambda k: "\n".join(_chunks(base64.b64encode(f"Bearer {k} for the account".encode()).decode(), 16)),
        lambda k: "\\n".join(_chunks(base64.b64encode(f"Bearer {k} for the account".encode()).decode(), 16)),
        # HTML character references as a browser reads them
        lambda k: k.replace("-", "&#45"),
        lambda k: k.replace("-", "&#x000002d;"),
        # a reference split by an escape (hypothesis found it): `&#4\u0035;` is `&#45;` one layer down
        lambda k: k.replace("-", "&#4\\u0035;"),
    ],
)
def test_forms_found_in_review_are_redacted(form):
    key = "sk-live-Review1234-abcdefghijkl"
    scrub.forget_all()
    scrub.remember(key)
    try:
        text = f"echo: {form(key)} end"
        assert exposed(text, [key]), text  # the oracle reads the key in it
        clean = scrub.scrub_text(text, load=False)
        assert not exposed(clean, [key]), clean
    finally:
        scrub.forget_all()


def _chunks(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


def test_ordinary_bodies_pass_unchanged():
    scrub.forget_all()
    scrub.remember("sk-live-Review1234-abcdefghijkl")
    bodies = [
        b'{"id": "chatcmpl-AbCdEfGhIjKlMnOp", "usage": {"completion_tokens": 12}, "x": "50% off &amp; more"}',
        json.dumps({"content": "def f():\n    return 'a\\\\b'  # 100%\n" * 50}).encode(),
        b"data: " + base64.b64encode(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4),
    ]
    try:
        for body in bodies:
            assert scrub.scrub_bytes(body, load=False) == body
    finally:
        scrub.forget_all()


@pytest.mark.django_db
def test_every_variable_under_the_host_key_prefix_is_scrubbed_whoever_reads_it(monkeypatch, catalog):
    # A Bedrock host's session token is read by its host kind, not by a host key's value_env: scrubbed alike.
    monkeypatch.setenv("RELAY_HOSTKEY_BEDROCK_SESSION", "aws-session-token-value-0123456789")
    scrub.forget_all()
    try:
        text = "provider echoed aws-session-token-value-0123456789"
        assert scrub.scrub_text(text) == f"provider echoed {scrub.REDACTED}"
    finally:
        scrub.forget_all()
