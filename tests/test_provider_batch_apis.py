"""The providers' batch APIs behind one registry (gateway/batch_apis/): each provider is one BatchAPI class
(its endpoints, limits, input framing, upload, create, find, poll, results, cancel, result lines), the job code
asks the registry and never compares a provider's name, and the wire package stays free of the batch engine so
it can move down to the gateway layer. Pure checks first; the last test drives a real job through an API class
registered in place of OpenAI's (PostgreSQL, Redis and the fake provider's HTTP are real)."""

import ast
import inspect
import json
import pathlib
from types import SimpleNamespace
from uuid import uuid4

import orjson
import pytest

from batches.models import Item
from batches.provider.models import ProviderJob
from core import hostkinds
from core.models import Adapter, HostBinding
from gateway import batch_apis as wire
from tests.test_provider_batches import chat, drive, openai_batch

ROOT = pathlib.Path(__file__).resolve().parent.parent
JOB_CODE = ["batches/provider/jobs.py", "batches/provider/results.py", "batches/provider/placement.py"]


def _job(**fields):
    return SimpleNamespace(pk=uuid4(), endpoint="/v1/chat/completions", **fields)


# --- the registry ------------------------------------------------------------------------------------------


def test_every_registered_api_is_complete_and_named_by_its_kind():
    assert {"openai", "anthropic", "azure_openai", "bedrock", "openai_compatible"} <= set(wire.REGISTRY)
    for kind, cls in wire.REGISTRY.items():
        assert cls.kind == kind and issubclass(cls, wire.BatchAPI) and wire.api(kind) is cls
        assert not inspect.isabstract(cls), f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} unwritten"
        assert cls.label and cls.max_records > 0 and cls.max_bytes > 0 and cls.window.total_seconds() > 0
        assert cls.endpoints and all(e.startswith("/v1/") for e in cls.endpoints)
        assert issubclass(cls.input_file, wire.InputFile) and not inspect.isabstract(cls.input_file)
        # Only adapters the catalog knows; the API is the one its host kind names (wire.for_host).
        assert cls.adapters <= set(Adapter.values) and cls.min_records >= 1
    for kind in hostkinds.REGISTRY.values():
        host = SimpleNamespace(kind=kind.name, options={})
        for adapter in kind.adapters:
            named = wire.REGISTRY[kind.batch_api] if kind.batch_api else None
            # A kind's batch API may take fewer shapes than it serves live (Vertex: Claude's, not Gemini's).
            want = named if named is not None and adapter in named.adapters else None
            assert wire.for_host(host, adapter) is want, (kind.name, adapter)
    # A host without a kind: the native wire of its binding's adapter.
    assert wire.for_host(SimpleNamespace(kind="", options={}), "openai") is wire.OpenAIBatchAPI
    assert wire.for_host(SimpleNamespace(kind="", options={}), "anthropic") is wire.AnthropicBatchAPI


def test_the_job_tables_kind_constraint_lists_exactly_the_registered_apis():
    (check,) = [c for c in ProviderJob._meta.constraints if c.name == "provider_job_kind_valid"]
    ((field, kinds),) = check.condition.children
    # Vertex's batch API is listed ahead of its registry line (its module lands with the Vertex host kind).
    assert field == "kind__in" and sorted(set(wire.REGISTRY) | {"vertex"}) == sorted(kinds)
    assert all(len(kind) <= ProviderJob._meta.get_field("kind").max_length for kind in kinds)


def test_the_job_code_never_branches_on_a_providers_name():
    names = {name.lower() for cls in wire.REGISTRY.values() for name in (cls.kind, cls.label)}
    for path in JOB_CODE:
        tree = ast.parse((ROOT / path).read_text())
        literals = [
            (node.lineno, node.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.lower() in names
        ]
        assert literals == [], f"{path} names a provider: {literals}"
        # Only the registry package, never one provider's module.
        modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not {m for m in modules if m.startswith("gateway.batch_apis.")}, path


def test_the_wire_package_imports_nothing_of_the_batch_engine():
    for path in sorted((ROOT / "gateway/batch_apis").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):  # function-level imports count too
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("batches") or name.startswith("gateway.batch_apis"), (path.name, name)


# --- each API's wire: the input it sends, the result lines it reads --------------------------------------


def test_openai_input_is_a_multipart_upload_of_one_jsonl_line_per_record():
    job = _job()
    records = wire.OpenAIBatchAPI(None, job).records()
    records.add(f"{job.pk.hex}-0", b'{"model": "m", "messages": []}')
    records.add(f"{job.pk.hex}-1", b'{"model": "m", "messages": [{"role": "user", "content": "x"}]}')
    body = records.finish().read()
    records.close()
    parts = body.split(f"--{records.boundary}".encode())
    assert parts[0] == b"" and parts[-1] == b"--\r\n" and b'name="purpose"\r\n\r\nbatch' in parts[1]
    lines = parts[2].split(b"\r\n\r\n", 1)[1].rstrip(b"\r\n").split(b"\n")
    rows = [json.loads(line) for line in lines]
    assert [r["custom_id"] for r in rows] == [f"{job.pk.hex}-0", f"{job.pk.hex}-1"]
    assert {(r["method"], r["url"]) for r in rows} == {("POST", "/v1/chat/completions")}
    assert rows[1]["body"]["messages"][0]["content"] == "x"


def test_anthropic_input_is_one_create_body_with_the_records_as_params():
    job = _job()
    records = wire.AnthropicBatchAPI(None, job).records()
    assert wire.AnthropicBatchAPI(None, job).upload(records) is None  # no input file: the create carries them
    for i in range(3):
        records.add(f"{job.pk.hex}-{i}", b'{"model": "claude", "max_tokens": 8, "messages": []}')
    body = json.loads(records.finish().read())
    records.close()
    assert [r["custom_id"] for r in body["requests"]] == [f"{job.pk.hex}-{i}" for i in range(3)]
    assert body["requests"][0]["params"] == {"model": "claude", "max_tokens": 8, "messages": []}


def _line(**row) -> bytes:
    return orjson.dumps(row)


@pytest.mark.parametrize(
    ("line", "outcome", "status"),
    [
        (_line(custom_id="j-0", response={"status_code": 200, "body": {"id": "x", "usage": {}}}), "succeeded", 200),
        (_line(custom_id="j-1", response={"status_code": 400, "body": {"error": {"message": "bad"}}}), "errored", 400),
        (_line(custom_id="j-2", error={"code": "batch_expired", "message": "late"}), "expired", None),
        (_line(custom_id="j-3", error={"code": "batch_cancelled", "message": "stop"}), "canceled", None),
        (_line(custom_id="j-4", error={"code": "server_error", "message": "boom"}), "errored", 500),
    ],
)
def test_openai_result_lines_map_to_records(line, outcome, status):
    result = wire.OpenAIBatchAPI.parse_line(line)
    assert (result.custom_id, result.outcome, result.status_code) == (orjson.loads(line)["custom_id"], outcome, status)
    if outcome == "succeeded":
        assert result.parsed == {"id": "x", "usage": {}} and orjson.loads(result.body) == result.parsed


@pytest.mark.parametrize(
    ("result", "outcome", "status"),
    [
        ({"type": "succeeded", "message": {"id": "msg", "usage": {}}}, "succeeded", 200),
        ({"type": "errored", "error": {"type": "error", "error": {"type": "invalid_request_error"}}}, "errored", 400),
        ({"type": "errored", "error": {"type": "error", "error": {"type": "overloaded_error"}}}, "errored", 529),
        ({"type": "errored", "error": {"type": "error", "error": {"type": "something_new"}}}, "errored", 500),
        ({"type": "expired"}, "expired", None),
        ({"type": "canceled"}, "canceled", None),
    ],
)
def test_anthropic_result_lines_map_to_records(result, outcome, status):
    parsed = wire.AnthropicBatchAPI.parse_line(_line(custom_id="j-7", result=result))
    assert (parsed.custom_id, parsed.outcome, parsed.status_code) == ("j-7", outcome, status)


@pytest.mark.parametrize("cls", list(wire.REGISTRY.values()), ids=list(wire.REGISTRY))
@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'"a string"', b"null"])
def test_a_result_line_that_is_no_record_is_an_error_naming_none(cls, line):
    # A line that names no record is skipped by the results writer, never a crash that stalls the job.
    result = cls.parse_line(line)
    assert (result.custom_id, result.outcome) == ("", "errored")


# --- the seam: the job code drives whatever class the registry names ----------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_job_code_drives_the_api_the_registry_names(catalog, fake, settings, monkeypatch):
    settings.RELAY_PROVIDER_POLL_SECONDS = 0
    settings.RELAY_PROVIDER_POLL_MAX_SECONDS = 0
    fake.batches.job_seconds = 0.3
    HostBinding.objects.update(batch_mode="provider")
    calls = []

    class Spy(wire.OpenAIBatchAPI):
        """OpenAI's wire with its own limit, saying which of its methods the job code called."""

        max_records = 2

        def __getattribute__(self, name):
            if name in ("records", "upload", "create", "status", "find", "results", "cancel"):
                calls.append(name)
            return super().__getattribute__(name)

    monkeypatch.setitem(wire.REGISTRY, "openai", Spy)
    batch = openai_batch(catalog, [chat(str(i)) for i in range(3)])
    assert sorted(ProviderJob.objects.filter(batch=batch).values_list("records", flat=True)) == [1, 2]
    drive(batch)
    assert Item.objects.filter(batch=batch, state="completed").count() == 3
    assert calls.count("create") == 2 and calls.count("upload") == 2 and calls.count("records") == 2
    assert calls.count("results") == 2 and calls.count("status") >= 2
    assert calls.index("records") < calls.index("upload") < calls.index("create") < calls.index("status")
