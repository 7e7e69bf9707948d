"""Batch payloads (request and response bodies) behind one storage interface.

- `dir` (default): files under RELAY_BATCH_PAYLOAD_DIR. A batch's inputs are
  one append-only file (`<batch>/input.jsonl`) and each item keeps its byte
  range, so ingesting 50,000 items is one sequential write, not 50,000 files.
  Results are appended the same way, to one file per batch and writing process
  (`<batch>/results/<host>-<pid>-<token>.jsonl`), each result a byte range: a file
  per result cost its inode allocation (see `result_group`). Every replica must
  mount the same directory.
- `db`: rows in PostgreSQL (`Payload`), which every replica sees: the choice for
  several replicas without a shared volume.
- `s3`: objects in an S3-compatible bucket (batches/storage_s3.py): what every replica sees
  without the database holding the bodies (docs/object-storage.md). Results are written in
  groups, one object per group, each result a byte range of it (`result_group`).

Files of the OpenAI surface (uploads, output and error files) go through the
same backends, written and read as streams so a 200 MB file never sits in
memory: `dir` keeps one file under `files/`; `db` keeps 1 MiB chunk rows
(`files/<id>/<n>`, ref scheme `dbfile:`); `s3` keeps one object, multipart when large.

A ref names its backend (`file:…`, `db:…`, `dbfile:…`, `s3:…`), so items written under one setting
stay readable after the setting changes. A missing payload raises
PayloadMissing, which fails the item with `load input` — never silently.
"""

import contextlib
import logging
import os
import secrets
import shutil
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

from django.conf import settings

from batches import storage_s3, storage_s3_checks  # noqa: F401 - registers the s3 store's system checks
from batches.models import Payload
from batches.storage_errors import FileTooLarge, PayloadMissing, PayloadStoreUnavailable, ResultGroupBase

log = logging.getLogger(__name__)

__all__ = ["FileTooLarge", "PayloadMissing", "PayloadStoreUnavailable"]  # the callers' names for them


class _DirInputWriter:
    uses_db = False  # add() never touches the database: rows can stream into a COPY meanwhile

    def __init__(self, root: Path, batch_id: str):
        self.dir = root / batch_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rel = f"{batch_id}/input.jsonl"
        # A large buffer: a 31 MiB input is a few dozen write(2)s, not one per element.
        self.fh = open(self.dir / "input.jsonl", "wb", buffering=1024 * 1024)  # noqa: SIM115 - closed in close()/discard()
        self.prefix = f"file:{self.rel}#"
        self.offset = 0

    def add(self, idx: int, data: bytes) -> str:
        self.fh.write(data + b"\n")
        ref = f"{self.prefix}{self.offset}:{len(data)}"
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

    def read_back(self):
        """The lines written so far, as a binary file open for reading from the start (it stays
        readable after discard(): the open file outlives its name)."""
        self.fh.flush()
        return open(self.dir / "input.jsonl", "rb")  # noqa: SIM115 - the caller's Submission closes it


class _DbInputWriter:
    FLUSH_EVERY = 1000
    uses_db = True

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
    if backend() == "s3":
        return storage_s3.InputWriter(batch_id)
    return _DirInputWriter(_root(), batch_id)


def write_result(batch_id: str, item_id: str, data: bytes) -> str:
    """Store one item's result; returns its ref. A group of one (`result_group`): one code path for every
    result, whoever writes it (the item worker's inline finish, tests, benchmarks)."""
    with result_group(batch_id) as group:
        ref = group.add(item_id, data)
    return ref


def result_group(batch_id: str):
    """A writer of a batch's results: `add(item_id, data) -> ref`, then `close()` (or `with …:`, which
    discards on an error). A ref is valid only once close() has returned; close() raises when the
    results could not be stored, so the caller commits no finish pointing at nothing.

    - `dir`: each add() appends to this process's results file of the batch (a byte range, as inputs
      are). Was one file per result (a temporary file, then a rename): perf showed the inode allocation
      of that `open(O_CREAT)` (ext4's `find_inode_bit` → `recently_deleted`) as ~1.3 ms of CPU per item
      at 100 ms upstream latency, a quarter of the relay's whole cost per item. As before, nothing is
      fsynced: a result whose finish never commits is left unreferenced in the file (a retry appends
      its own), deleted with the batch.
    - `db`: a row per result, inserted by close() in one statement.
    - `s3`: one object for the group, PUT by close() (storage_s3.ResultGroup): a PUT per result was a
      round trip and 5 USD a million on S3, and ~3 ms of the S3 server's CPU each on moto.

    Every result gets a key (db) or an object (s3) of its own write, never the item's alone: a claim fenced
    out (its host cut off, its lease rescued) still writes its result after the rescuer stored one, and
    must not replace it. What it wrote stays unreferenced (its finish is refused) and goes with the batch."""
    if backend() == "db":
        return _DbResultGroup(batch_id)
    if backend() == "s3":
        return storage_s3.ResultGroup(batch_id)
    return _DirResultGroup(batch_id)


def result_group_wait() -> float:
    """How long a writer of many items' results (the worker's bookkeeper) may wait for more to join a
    group: only where a group saves a round trip per result (s3); a directory append costs no wait."""
    return RESULT_GROUP_WAIT_S if backend() == "s3" else 0.0


# The bookkeeper's wait for more results to join an s3 group: measured on 2,000-record drains at 0 and
# 100 ms upstream latency (docs/object-storage.md, "Results: one object per group").
RESULT_GROUP_WAIT_S = 0.005


class _DirResultGroup(ResultGroupBase):
    def __init__(self, batch_id: str):
        self.batch_id = batch_id

    def add(self, item_id: str, data: bytes) -> str:
        return _segments.append(self.batch_id, data)

    def close(self) -> None:
        pass  # appended already; as before, nothing is fsynced (see result_group)

    def discard(self) -> None:
        pass  # what was appended is unreferenced, deleted with the batch


class _DbResultGroup(ResultGroupBase):
    def __init__(self, batch_id: str):
        self.batch_id = batch_id
        self.pending: list[Payload] = []

    def add(self, item_id: str, data: bytes) -> str:
        key = f"{self.batch_id}/out/{item_id}-{secrets.token_hex(4)}"  # a key per write: see result_group
        self.pending.append(Payload(key=key, data=data))
        return f"db:{key}"

    def close(self) -> None:
        pending, self.pending = self.pending, []
        if pending:
            Payload.objects.bulk_create(pending)

    def discard(self) -> None:
        self.pending = []


class _ResultSegments:
    """This process's open results files, one per batch, appended by one writer at a time (the lock:
    the batch worker's bookkeeper thread writes them, other threads rarely). The file's name is this
    process's own, so no other process ever appends to it and the offset kept here is the file's end.
    At most MAX_OPEN stay open (the oldest is closed first); a file found unlinked (its batch was
    deleted meanwhile) or a failed write makes the next append reopen and read the end again."""

    MAX_OPEN = 32

    def __init__(self):
        self.lock = threading.Lock()
        self.pid: int | None = None
        self.name = ""
        self.open: dict[str, list] = {}  # batch id -> [fd, end offset, ref prefix]

    def append(self, batch_id: str, data: bytes) -> str:
        with self.lock:
            seg = self._segment(batch_id)
            fd, offset, prefix = seg
            try:
                view = memoryview(data + b"\n")
                while view:
                    view = view[os.write(fd, view) :]
            except OSError:
                self._close(batch_id)  # what was written of this one is left unreferenced
                raise
            seg[1] = offset + len(data) + 1
            return f"{prefix}{offset}:{len(data)}"

    def _segment(self, batch_id: str) -> list:
        if self.pid != os.getpid():  # a forked child: the parent's descriptors and name are not its own
            for batch in list(self.open):
                self._close(batch)
            self.pid = os.getpid()
            host = "".join(c if c.isalnum() or c in "._-" else "_" for c in socket.gethostname())[:60]
            self.name = f"{host}-{self.pid}-{secrets.token_hex(4)}.jsonl"
        seg = self.open.get(batch_id)
        if seg is not None:
            if os.fstat(seg[0]).st_nlink:
                return seg
            self._close(batch_id)  # the batch's directory was deleted under it
        if len(self.open) >= self.MAX_OPEN:
            self._close(next(iter(self.open)))
        folder = _root() / batch_id / "results"
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder / self.name, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        seg = self.open[batch_id] = [fd, os.fstat(fd).st_size, f"file:{batch_id}/results/{self.name}#"]
        return seg

    def _close(self, batch_id: str) -> None:
        seg = self.open.pop(batch_id, None)
        if seg is not None:
            with contextlib.suppress(OSError):
                os.close(seg[0])


_segments = _ResultSegments()


def read(ref: str) -> bytes:
    scheme, _, rest = ref.partition(":")
    if scheme == "db":
        data = Payload.objects.filter(key=rest).values_list("data", flat=True).first()
        if data is None:
            raise PayloadMissing(f"payload {ref} not found in the database store")
        return bytes(data)
    if scheme == "file":
        rel, _, span = rest.partition("#")
        if span:  # a byte range: read as `read_many` and `read_input` read them
            spans = _Spans(os.fsencode(_root()) + b"/")
            try:
                data = spans.read(ref)
            finally:
                spans.close()
            if isinstance(data, PayloadMissing):
                raise data
            return data
        try:
            with open(_root() / rel, "rb") as fh:
                return fh.read()
        except OSError as exc:
            raise _missing(rel) from exc
    if scheme == "s3":
        return storage_s3.read(rest)
    raise PayloadMissing(f"unknown payload ref {ref!r}")


def read_many(refs: list[str]) -> list:
    """`read()` of many refs at once, in order: each entry is the payload's bytes or the PayloadMissing
    that read() would raise. For the results of a 50,000-item batch: `db:` refs are fetched in one
    query, whole-file `file:` refs with four system calls each (no pathlib, no buffered file object),
    byte ranges with one `pread` each, every file they share opened once, and `s3:` refs by concurrent
    GETs (storage_s3.read_many)."""
    out: list = [None] * len(refs)
    db_keys: dict[str, list[int]] = {}
    s3_refs: dict[int, str] = {}
    root = os.fsencode(_root()) + b"/"
    spans = _Spans(root)
    try:
        for i, ref in enumerate(refs):
            if ref.startswith("db:"):
                db_keys.setdefault(ref[3:], []).append(i)
            elif ref.startswith("file:"):
                out[i] = _read_whole(root, ref) if "#" not in ref else spans.read(ref)
            elif ref.startswith("s3:"):
                s3_refs[i] = ref[3:]
            else:
                try:
                    out[i] = read(ref)
                except PayloadMissing as exc:
                    out[i] = exc
    finally:
        spans.close()
    if s3_refs:
        for i, data in zip(s3_refs, storage_s3.read_many(list(s3_refs.values())), strict=True):
            out[i] = data
    if db_keys:
        found = dict(Payload.objects.filter(key__in=list(db_keys)).values_list("key", "data"))
        for key, positions in db_keys.items():
            data = found.get(key)
            for i in positions:
                out[i] = (
                    PayloadMissing(f"payload db:{key} not found in the database store") if data is None else bytes(data)
                )
    return out


def read_input(ref: str) -> bytes:
    """`read()` for the batch runner's item inputs: byte ranges of the batch's input file are read with
    one `pread` on a descriptor this thread keeps open (until `close_inputs()`, which the drain calls at
    its end), not open/fstat/seek/read/close per item; those of an `s3:` input object come from the
    process's read-ahead (storage_s3.read_input: a window of the object per GET, not a GET per item).
    Inputs never change once written."""
    if ref.startswith("s3:"):
        return storage_s3.read_input(ref[3:])
    if not ref.startswith("file:") or "#" not in ref:
        return read(ref)
    root = os.fsencode(_root()) + b"/"
    spans = getattr(_inputs, "spans", None)
    if spans is None or spans.root != root:
        if spans is not None:
            spans.close()
        spans = _inputs.spans = _Spans(root)
    data = spans.read(ref)
    if isinstance(data, PayloadMissing):
        spans.forget(ref)  # not kept: the next item of that batch looks again
        raise data
    return data


def close_inputs() -> None:
    spans = getattr(_inputs, "spans", None)
    _inputs.spans = None
    if spans is not None:
        spans.close()
    storage_s3.close_inputs()


_inputs = threading.local()


class _Spans:
    """Byte-range refs (`file:<rel>#<offset>:<length>`) read with `os.pread`, each file opened once
    (at most MAX_OPEN at a time)."""

    MAX_OPEN = 16

    def __init__(self, root: bytes):
        self.root = root
        self.fds: dict[str, int | PayloadMissing] = {}

    def forget(self, ref: str) -> None:
        fd = self.fds.pop(ref[5:].partition("#")[0], None)
        if isinstance(fd, int):
            os.close(fd)

    def read(self, ref: str):
        rel, _, span = ref[5:].partition("#")
        try:
            offset, length = (int(x) for x in span.split(":"))
        except ValueError:
            return PayloadMissing(f"unknown payload ref {ref!r}")
        fd = self.fds.get(rel)
        if fd is None:
            if len(self.fds) >= self.MAX_OPEN:
                self.close()
            try:
                fd = os.open(self.root + os.fsencode(rel), os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                fd = _missing(rel)
            self.fds[rel] = fd
        if isinstance(fd, PayloadMissing):
            return fd
        try:
            data = os.pread(fd, length, offset)
        except OSError:
            return _missing(rel)
        if len(data) != length:
            return PayloadMissing(f"payload {rel} is truncated")
        return data

    def close(self) -> None:
        fds, self.fds = self.fds, {}
        for fd in fds.values():
            if isinstance(fd, int):
                os.close(fd)


def _missing(rel: str) -> PayloadMissing:
    log.warning("payload %s not found under %s", rel, _root())  # the path is for operators only
    return PayloadMissing(
        f"payload {rel} not found in the payload store (is RELAY_BATCH_PAYLOAD_DIR shared by every replica?)"
    )


def _read_whole(root: bytes, ref: str):
    rel = ref[5:]
    try:
        fd = os.open(root + os.fsencode(rel), os.O_RDONLY | os.O_CLOEXEC)
        try:
            parts = []
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
        finally:
            os.close(fd)
    except OSError:
        return _missing(rel)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def delete_batch(batch_id: str) -> None:
    Payload.objects.filter(key__startswith=f"{batch_id}/").delete()
    shutil.rmtree(_root() / batch_id, ignore_errors=True)
    if storage_s3.configured():  # also under another setting now: refs name their store, and so do deletes
        storage_s3.delete_prefix(f"{batch_id}/")


# --- files (OpenAI surface) -----------------------------------------------------------

FILE_CHUNK = 1024 * 1024


class _DirFileWriter:
    """Appends to `files/<id>.part`; close() makes it durable and renames it into place."""

    def __init__(self, root: Path, file_id: str, limit: int | None):
        self.dir = root / "files"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.name = file_id
        self.tmp = self.dir / f"{file_id}.part"
        self.fh = open(self.tmp, "wb")  # noqa: SIM115 - closed in close()/discard()
        self.size = 0
        self.limit = limit

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            raise FileTooLarge(self.limit)
        self.fh.write(data)

    def close(self) -> str:
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.dir / self.name)
        return f"file:files/{self.name}"

    def discard(self) -> None:
        self.fh.close()
        for path in (self.tmp, self.dir / self.name):
            path.unlink(missing_ok=True)


class _DbFileWriter:
    """Buffers at most one chunk and inserts full chunks as they fill."""

    def __init__(self, file_id: str, limit: int | None):
        self.prefix = f"files/{file_id}/"
        self.buf = bytearray()
        self.n = 0
        self.size = 0
        self.limit = limit

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.limit is not None and self.size > self.limit:
            raise FileTooLarge(self.limit)
        self.buf += data
        while len(self.buf) >= FILE_CHUNK:
            self._put(bytes(self.buf[:FILE_CHUNK]))
            del self.buf[:FILE_CHUNK]

    def _put(self, chunk: bytes) -> None:
        Payload.objects.create(key=f"{self.prefix}{self.n:08d}", data=chunk)
        self.n += 1

    def close(self) -> str:
        if self.buf or self.n == 0:
            self._put(bytes(self.buf))
            self.buf = bytearray()
        return f"dbfile:{self.prefix.rstrip('/')}"

    def discard(self) -> None:
        self.buf = bytearray()
        Payload.objects.filter(key__startswith=self.prefix).delete()


def file_writer(file_id: str, limit: int | None = None):
    """A writer with write(bytes), close() → ref, discard(), and `size`; FileTooLarge past `limit` bytes."""
    if backend() == "db":
        return _DbFileWriter(file_id, limit)
    if backend() == "s3":
        return storage_s3.FileWriter(file_id, limit)
    return _DirFileWriter(_root(), file_id, limit)


def iter_file(ref: str, chunk_size: int = FILE_CHUNK) -> Iterator[bytes]:
    """The file's bytes in chunks, in constant memory."""
    scheme, _, rest = ref.partition(":")
    if scheme == "dbfile":
        keys = list(Payload.objects.filter(key__startswith=rest + "/").order_by("key").values_list("key", flat=True))
        if not keys:
            raise PayloadMissing(f"file {ref} not found in the database store")
        for key in keys:
            data = Payload.objects.filter(key=key).values_list("data", flat=True).first()
            if data is None:
                raise PayloadMissing(f"file {ref} was deleted while it was read")
            yield bytes(data)
        return
    if scheme == "file":
        try:
            fh = open(_root() / rest, "rb")  # noqa: SIM115 - closed below, also when the consumer stops early
        except OSError as exc:
            log.warning("file %s not found under %s", rest, _root())  # the path is for operators only
            raise PayloadMissing(
                f"file {rest} not found in the payload store (is RELAY_BATCH_PAYLOAD_DIR shared by every replica?)"
            ) from exc
        with fh:
            while chunk := fh.read(chunk_size):
                yield chunk
        return
    if scheme == "s3":
        yield from storage_s3.iter_file(rest, chunk_size)
        return
    raise PayloadMissing(f"unknown file ref {ref!r}")


class LineTooLong(Exception):
    def __init__(self, line: int, limit: int):
        super().__init__(f"line {line} is longer than {limit} bytes")
        self.line, self.limit = line, limit


def iter_lines(ref: str, max_line: int) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its newline) for each line, holding at most one line."""
    buf = bytearray()
    number = 0
    for chunk in iter_file(ref):
        start = 0
        while (nl := chunk.find(b"\n", start)) != -1:
            buf += chunk[start:nl]
            number += 1
            if len(buf) > max_line:
                raise LineTooLong(number, max_line)
            yield number, bytes(buf)
            buf.clear()
            start = nl + 1
        buf += chunk[start:]
        if len(buf) > max_line:
            raise LineTooLong(number + 1, max_line)
    if buf:
        yield number + 1, bytes(buf)


def delete_file(ref: str) -> None:
    scheme, _, rest = ref.partition(":")
    if scheme == "dbfile":
        Payload.objects.filter(key__startswith=rest + "/").delete()
    elif scheme == "file":
        (_root() / rest).unlink(missing_ok=True)
    elif scheme == "s3":
        storage_s3.delete(rest)
