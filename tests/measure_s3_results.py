"""Not a test: a measurement of how results reach the s3 store (docs/object-storage.md, "Results").
Prints, for a drain by a real item worker and for a provider job's results, the records, the result
objects PUT and the S3 server's CPU per record (moto's server on loopback, as tests/test_storage_s3.py
starts it). Named outside `test_*.py` so the suite never collects it; run it by name:

    pytest -p no:xdist tests/measure_s3_results.py -s
        MEASURE_RECORDS (default 2000), MEASURE_LATENCY_MS (the fake provider's, default 0: the drain)
"""

import os
import time
from pathlib import Path

import pytest

from batches.models import Batch, Item
from bench.measure import cpu_seconds
from core.models import HostBinding
from devkit.upstream import Reply
from tests.test_provider_batches import chat, drive, openai_batch
from tests.test_storage_s3 import _native, bucket, s3_endpoint, s3_workers  # noqa: F401 - fixtures
from tests.workers import wait_for

RECORDS = int(os.environ.get("MEASURE_RECORDS") or 2000)
LATENCY_MS = float(os.environ.get("MEASURE_LATENCY_MS") or 0)


def _moto_cpu(endpoint: str) -> float:
    port = endpoint.rsplit(":", 1)[1]
    return cpu_seconds(int(Path(f"/tmp/relay-s3-moto-{port}.pid").read_text().strip()))


def _log(endpoint: str) -> Path:
    return Path(f"/tmp/relay-s3-moto-{endpoint.rsplit(':', 1)[1]}.log")  # scripts/s3.sh's: a line a request


def _log_size(endpoint: str) -> int:
    return _log(endpoint).stat().st_size if _log(endpoint).exists() else 0


def _input_gets(endpoint: str, since: int, store, batch: Batch) -> int:
    """GETs of the batch's input object the S3 server logged since `since` (its log's size then)."""
    with _log(endpoint).open("rb") as fh:
        fh.seek(since)
        lines = fh.read().decode(errors="replace").splitlines()
    return sum(f'"GET /{store.name}/{store.prefix}{batch.id}/input.jsonl ' in line for line in lines)


def _report(what: str, store, batch: Batch, cpu: float, gets: int | None = None) -> None:
    results = [k for k in store.keys(f"{batch.id}/") if "/results/" in k]
    done = Item.objects.filter(batch_id=batch.pk, state="completed").count()
    print(
        f"\n{what}: {done} records completed, {len(results)} result objects PUT "
        f"({len(results) / max(done, 1):.3f} per record), S3 server CPU {cpu * 1000 / max(done, 1):.2f} ms per record"
        + (f", {gets} GETs of the input object" if gets is not None else "")
    )


@pytest.mark.django_db(transaction=True)
def test_measure_a_drain(bucket, s3_endpoint, catalog, fake, s3_workers):  # noqa: F811
    if LATENCY_MS:
        fake.answer_when("", Reply(delay=LATENCY_MS / 1000))
    s3_workers("measure")
    warm = _native(catalog, 16)  # the worker's first items (imports, connections) are not measured
    wait_for(lambda: Batch.objects.get(pk=warm.pk).completed_at, 120, what="the warm-up batch")
    before, logged = _moto_cpu(s3_endpoint), _log_size(s3_endpoint)
    batch = _native(catalog, RECORDS)
    started = time.monotonic()
    wait_for(lambda: Batch.objects.get(pk=batch.pk).completed_at, 600, interval=0.5, what="the drain")
    print(f"\ndrain of {RECORDS} records at {LATENCY_MS:g} ms upstream latency: {time.monotonic() - started:.1f} s")
    cpu = _moto_cpu(s3_endpoint) - before
    gets = _input_gets(s3_endpoint, logged, bucket, batch) if logged else None
    _report("item-worker drain (input PUT and input GETs included)", bucket, batch, cpu, gets)


@pytest.mark.django_db(transaction=True)
def test_measure_a_provider_jobs_results(bucket, s3_endpoint, catalog, fake):  # noqa: F811
    fake.batches.job_seconds = 0.1
    HostBinding.objects.update(batch_mode="provider")
    batch = openai_batch(catalog, [chat(f"r{i}", f"hi {i}") for i in range(RECORDS)])
    before = _moto_cpu(s3_endpoint)
    drive(batch, timeout=600)
    _report("provider job's results (input object read included)", bucket, batch, _moto_cpu(s3_endpoint) - before)
