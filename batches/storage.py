"""Batch payloads (request and response bodies) behind one storage interface.

- `dir` (default): files under RELAY_BATCH_PAYLOAD_DIR. A batch's inputs are
  one append-only file (`<batch>/input.jsonl`) and each item keeps its byte
  range, so ingesting 50,000 items is one sequential write, not 50,000 files.
  Results are one file per item. Every replica must mount the same directory.
- `db`: rows in PostgreSQL (`Payload`), which every replica sees: the choice for
  several replicas without a shared volume.

A ref names its backend (`file:…`, `db:…`), so items written under one setting
stay readable after the setting changes. A missing payload raises
PayloadMissing, which fails the item with `load input` — never silently.
"""

import os
import shutil
from pathlib import Path

from django.conf import settings

from batches.models import Payload


class PayloadMissing(Exception):
    pass


class _DirInputWriter:
    def __init__(self, root: Path, batch_id: str):
        self.dir = root / batch_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rel = f"{batch_id}/input.jsonl"
        self.fh = open(self.dir / "input.jsonl", "wb")  # noqa: SIM115 - closed in close()/discard()
        self.offset = 0

    def add(self, idx: int, data: bytes) -> str:
        self.fh.write(data)
        self.fh.write(b"\n")
        ref = f"file:{self.rel}#{self.offset}:{len(data)}"
        self.offset += len(data) + 1
        return ref

    def close(self) -> None:
        # The 202 promises the work is kept: make the inputs durable first.
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()

    def discard(self) -> None:
        self.fh.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class _DbInputWriter:
    FLUSH_EVERY = 1000

    def __init__(self, batch_id: str):
        self.batch_id = batch_id
        self.pending: list[Payload] = []

    def add(self, idx: int, data: bytes) -> str:
        key = f"{self.batch_id}/in/{idx}"
        self.pending.append(Payload(key=key, data=data))
        if len(self.pending) >= self.FLUSH_EVERY:
            self._flush()
        return f"db:{key}"

    def _flush(self) -> None:
        Payload.objects.bulk_create(self.pending)
        self.pending = []

    def close(self) -> None:
        self._flush()

    def discard(self) -> None:
        # The caller's transaction rolls back whatever was flushed.
        self.pending = []


def _root() -> Path:
    return Path(settings.RELAY_BATCH_PAYLOAD_DIR)


def backend() -> str:
    return settings.RELAY_BATCH_PAYLOAD_STORE


def input_writer(batch_id: str):
    if backend() == "db":
        return _DbInputWriter(batch_id)
    return _DirInputWriter(_root(), batch_id)


def write_result(batch_id: str, item_id: str, data: bytes) -> str:
    if backend() == "db":
        key = f"{batch_id}/out/{item_id}"
        Payload.objects.update_or_create(key=key, defaults={"data": data})
        return f"db:{key}"
    path = _root() / batch_id / "results"
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / f"{item_id}.json.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, path / f"{item_id}.json")  # atomic: a reader never sees half a result
    return f"file:{batch_id}/results/{item_id}.json"


def read(ref: str) -> bytes:
    scheme, _, rest = ref.partition(":")
    if scheme == "db":
        data = Payload.objects.filter(key=rest).values_list("data", flat=True).first()
        if data is None:
            raise PayloadMissing(f"payload {ref} not found in the database store")
        return bytes(data)
    if scheme == "file":
        rel, _, span = rest.partition("#")
        path = _root() / rel
        try:
            with open(path, "rb") as fh:
                if not span:
                    return fh.read()
                offset, length = (int(x) for x in span.split(":"))
                fh.seek(offset)
                data = fh.read(length)
        except OSError as exc:
            raise PayloadMissing(
                f"payload {rel} not found under {_root()} (is RELAY_BATCH_PAYLOAD_DIR shared by every replica?)"
            ) from exc
        if len(data) != length:
            raise PayloadMissing(f"payload {rel} is truncated")
        return data
    raise PayloadMissing(f"unknown payload ref {ref!r}")


def delete_batch(batch_id: str) -> None:
    Payload.objects.filter(key__startswith=f"{batch_id}/").delete()
    shutil.rmtree(_root() / batch_id, ignore_errors=True)
