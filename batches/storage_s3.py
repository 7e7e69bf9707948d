"""The `s3` payload store: batch payloads and files as objects in an S3-compatible bucket (boto3).

Selected by RELAY_BATCH_PAYLOAD_STORE=s3; configured by RELAY_S3_BUCKET, RELAY_S3_ENDPOINT_URL (MinIO, Ceph,
R2 …; unset for AWS), RELAY_S3_REGION, RELAY_S3_PREFIX and the standard AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY (unset: boto3's own chain — instance role, ~/.aws). Each is read from Django
settings when defined there, else from the environment. Keys under the prefix mirror the `dir` store:

    <prefix><batch>/input.jsonl                 a batch's inputs, one object; an item's ref is its byte range
    <prefix><batch>/results/<token>.jsonl       a group of results, one object; a result is its byte range (ResultGroup)
    <prefix>files/<file>                        a file of the OpenAI surface (upload, output, error file)

Refs are `s3:<key without the prefix>[#offset:length]`, relative like `file:` refs are to the payload dir.

Streams both ways, never a whole large payload in memory: a writer keeps at most SPOOL_MEMORY in memory
and spools the rest to a temporary file; an object that outgrows MULTIPART_THRESHOLD becomes a multipart
upload sent a part at a time, completed on close() and aborted on discard() or on any failure, so a
failed write leaves neither an object nor a pending upload for a row to point at. Reads of files are the
response body, read chunk by chunk. An unreachable or refusing store raises PayloadStoreUnavailable (503
in the API's shape; no item fails for it); a missing object raises PayloadMissing.
"""

import contextlib
import logging
import os
import secrets
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.conf import settings

from batches.storage_errors import FileTooLarge, PayloadMissing, PayloadStoreUnavailable, ResultGroupBase
from batches.storage_readahead import ReadAhead

log = logging.getLogger(__name__)

MiB = 1024 * 1024
# Multipart above this size (S3 allows a single PUT up to 5 GiB; the issue asks multipart above 64 MiB).
MULTIPART_THRESHOLD = 64 * MiB
# Each part of a multipart upload: 10,000 parts (S3's limit) of 16 MiB is 160 GiB, far past any payload.
PART_SIZE = 16 * MiB
# What a writer holds in memory before spooling to a temporary file (a result, a small file: no disk).
SPOOL_MEMORY = 1 * MiB
# GETs in flight at once for read_many (a page of 2,000 results); byte ranges of one object closer than
# COALESCE_GAP are fetched as one GET of at most COALESCE_MAX bytes (a provider job reads its items'
# inputs, neighbours in the batch's input object).
READ_CONCURRENCY = 16
COALESCE_GAP = 64 * 1024
COALESCE_MAX = 4 * MiB
DELETE_PAGE = 1000  # DeleteObjects takes at most 1,000 keys
# The item worker's inputs are read ahead (read_input; batches/storage_readahead.py): a miss fetches a window
# of the input object. An object's first window is small, for a process that reads only a few of its
# records (fair claims spread the slots over many batches); reading on doubles it up to the largest, 512 KiB:
# 50-500 requests of 1-10 KB a GET, so GETs are already a few per cent of the items; a larger one saves
# little more and makes the slot that missed wait longer for its item (the whole window is read first).
# 4 MiB in all per process: a largest window for each of the 8 slots, each on a batch of its own.
READ_AHEAD_FIRST = 64 * 1024
READ_AHEAD_MOST = 512 * 1024
READ_AHEAD_MEMORY = 4 * MiB


@dataclass(frozen=True)
class Config:
    bucket: str
    endpoint_url: str | None
    region: str
    prefix: str
    access_key: str | None
    secret_key: str | None


def _setting(name: str, default: str = "") -> str:
    value = getattr(settings, name, None)
    if value is None:
        value = os.environ.get(name, default)
    return str(value)


def config() -> Config:
    prefix = _setting("RELAY_S3_PREFIX", "relay/").lstrip("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return Config(
        bucket=_setting("RELAY_S3_BUCKET"),
        endpoint_url=_setting("RELAY_S3_ENDPOINT_URL") or None,
        region=_setting("RELAY_S3_REGION") or "us-east-1",
        prefix=prefix,
        access_key=_setting("AWS_ACCESS_KEY_ID") or None,
        secret_key=_setting("AWS_SECRET_ACCESS_KEY") or None,
    )


def configured() -> bool:
    return bool(config().bucket)


# --- the client --------------------------------------------------------------------------------------

_clients: dict = {}
_clients_lock = threading.Lock()


def make_client(cfg: Config, *, probe: bool = False):
    try:
        import boto3
        from botocore.config import Config as BotoConfig
    except ImportError as exc:  # boto3 is in requirements.txt; a slimmed image may lack it
        raise PayloadStoreUnavailable("boto3 is not installed (pip install -r requirements.txt)") from exc
    boto = BotoConfig(
        region_name=cfg.region,
        signature_version="s3v4",
        # Path-style for an endpoint of our own (MinIO, moto): no wildcard DNS needed for the bucket.
        s3={"addressing_style": "path" if cfg.endpoint_url else "auto"},
        retries={"mode": "standard", "max_attempts": 1 if probe else 4},
        connect_timeout=3 if probe else 10,
        read_timeout=10 if probe else 60,
        # read_many's GETs plus the 8 item slots' reads and writes of a worker replica.
        max_pool_connections=READ_CONCURRENCY + 16,
        # Checksums only where S3 requires them: several S3-compatible stores refuse the newer default
        # (CRC trailers on every PUT); TLS already protects the bytes in transit.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    # A session of its own: boto3's default session is not safe to make clients from in several threads.
    return boto3.session.Session().client(
        "s3",
        endpoint_url=cfg.endpoint_url,
        aws_access_key_id=cfg.access_key,
        aws_secret_access_key=cfg.secret_key,
        config=boto,
    )


def _client(cfg: Config):
    """One client per process and configuration (thread-safe; a forked child makes its own)."""
    key = (os.getpid(), cfg.endpoint_url, cfg.region, cfg.access_key, cfg.secret_key)
    client = _clients.get(key)
    if client is None:
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = _clients[key] = make_client(cfg)
    return client


def _store() -> tuple[Config, object]:
    cfg = config()
    if not cfg.bucket:
        raise PayloadStoreUnavailable("RELAY_BATCH_PAYLOAD_STORE=s3 but RELAY_S3_BUCKET is not set")
    return cfg, _client(cfg)


@contextlib.contextmanager
def errors(cfg: Config, what: str, rel: str = "", *, reading: bool = False):
    """botocore's errors as the store's: a missing object (when reading) is PayloadMissing, anything else
    the store refused or could not be asked is PayloadStoreUnavailable. The reason is logged for operators."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        yield
    except ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if reading and (code in ("NoSuchKey", "NotFound", "404") or (status == 404 and code != "NoSuchBucket")):
            log.warning("payload %s not found in s3://%s/%s", rel, cfg.bucket, cfg.prefix)
            raise PayloadMissing(f"payload {rel} not found in the payload store") from exc
        if reading and code == "InvalidRange":  # a byte range past the object's end
            raise PayloadMissing(f"payload {rel} is truncated") from exc
        reason = f"{what} {rel or cfg.bucket}: {code or status} {error.get('Message', '')}".strip()
        log.warning("s3 payload store (%s, bucket %s): %s", cfg.endpoint_url or "aws", cfg.bucket, reason)
        raise PayloadStoreUnavailable(reason) from exc
    except BotoCoreError as exc:  # unreachable endpoint, timeouts, no credentials, a broken response stream
        reason = f"{what} {rel or cfg.bucket}: {type(exc).__name__}: {exc}"
        log.warning("s3 payload store (%s, bucket %s): %s", cfg.endpoint_url or "aws", cfg.bucket, reason)
        raise PayloadStoreUnavailable(reason) from exc


# --- reading -----------------------------------------------------------------------------------------


def _span(rest: str) -> tuple[str, int | None, int]:
    rel, _, span = rest.partition("#")
    if not span:
        return rel, None, 0
    try:
        offset, length = (int(x) for x in span.split(":"))
    except ValueError:
        raise PayloadMissing(f"unknown payload ref {'s3:' + rest!r}") from None
    return rel, offset, length


def _get(cfg: Config, client, rel: str, start: int | None = None, end: int = 0) -> bytes:
    """The object's bytes, or those of [start, end)."""
    with errors(cfg, "read", rel, reading=True):
        if start is not None and end <= start:  # an empty range: S3 has no such Range, ask if it exists
            client.head_object(Bucket=cfg.bucket, Key=cfg.prefix + rel)
            return b""
        extra = {"Range": f"bytes={start}-{end - 1}"} if start is not None else {}
        body = client.get_object(Bucket=cfg.bucket, Key=cfg.prefix + rel, **extra)["Body"]
        try:
            return body.read()
        finally:
            body.close()


def read(rest: str) -> bytes:
    """`s3:` ref (without its scheme) → bytes: the object, or one byte range of it."""
    cfg, client = _store()
    rel, offset, length = _span(rest)
    if offset is None:
        return _get(cfg, client, rel)
    data = _get(cfg, client, rel, offset, offset + length)
    if len(data) != length:
        raise PayloadMissing(f"payload {rel} is truncated")
    return data


read_ahead = ReadAhead(READ_AHEAD_FIRST, READ_AHEAD_MOST, READ_AHEAD_MEMORY)  # one per process, its threads share it
os.register_at_fork(after_in_child=read_ahead.reset)


def read_input(rest: str) -> bytes:
    """read() for the item worker's inputs: a byte range of a batch's input object comes from the process's
    read-ahead, a window of that object fetched by an earlier miss, most often by another slot."""
    cfg, client = _store()
    rel, offset, length = _span(rest)
    if offset is None:
        return _get(cfg, client, rel)
    data = read_ahead.read(
        f"{cfg.bucket}/{cfg.prefix}{rel}", offset, length, lambda start, end: _get(cfg, client, rel, start, end)
    )
    if len(data) != length:
        raise PayloadMissing(f"payload {rel} is truncated")
    return data


def close_inputs() -> None:
    """The calling thread's drain has ended (the last thread to say so releases the read-ahead's windows)."""
    read_ahead.leave()


def read_many(rests: list[str]) -> list:
    """read() of each, in order: bytes or the PayloadMissing read() would raise (PayloadStoreUnavailable
    raises). Up to READ_CONCURRENCY GETs in flight; near byte ranges of one object are one GET."""
    cfg, client = _store()
    out: list = [None] * len(rests)
    jobs: list[tuple[str, int | None, int, list]] = []  # (rel, start, end, [(offset, length, position)])
    ranges: dict[str, list] = {}
    for i, rest in enumerate(rests):
        try:
            rel, offset, length = _span(rest)
        except PayloadMissing as exc:
            out[i] = exc
            continue
        if offset is None:
            jobs.append((rel, None, 0, [(0, -1, i)]))
        else:
            ranges.setdefault(rel, []).append((offset, length, i))
    for rel, spans in ranges.items():
        spans.sort()
        group, start, end = [], spans[0][0], spans[0][0]
        for offset, length, i in spans:
            if group and (offset - end > COALESCE_GAP or max(end, offset + length) - start > COALESCE_MAX):
                jobs.append((rel, start, end, group))
                group, start, end = [], offset, offset
            group.append((offset, length, i))
            end = max(end, offset + length)
        jobs.append((rel, start, end, group))

    def fetch(job) -> list:
        rel, start, end, members = job
        try:
            data = _get(cfg, client, rel, start, end)
        except PayloadMissing as exc:
            return [(i, exc) for _, _, i in members]
        if start is None:
            return [(members[0][2], data)]
        found = []
        for offset, length, i in members:
            piece = data[offset - start : offset - start + length]
            found.append((i, piece if len(piece) == length else PayloadMissing(f"payload {rel} is truncated")))
        return found

    if len(jobs) <= 1:
        results = map(fetch, jobs)
    else:
        pool = ThreadPoolExecutor(min(READ_CONCURRENCY, len(jobs)), thread_name_prefix="s3-read")
        results = pool.map(fetch, jobs)
        pool.shutdown(wait=False)  # map() has submitted every job; iterating below waits for each
    for found in results:
        for i, value in found:
            out[i] = value
    return out


def iter_file(rel: str, chunk_size: int) -> Iterator[bytes]:
    """The object's bytes in chunks of the response body, in constant memory."""
    cfg, client = _store()
    with errors(cfg, "read", rel, reading=True):
        body = client.get_object(Bucket=cfg.bucket, Key=cfg.prefix + rel)["Body"]
    try:
        while True:
            with errors(cfg, "read", rel):
                chunk = body.read(chunk_size)
            if not chunk:
                return
            yield chunk
    finally:
        body.close()


# --- writing -----------------------------------------------------------------------------------------


class _Upload:
    """One object written as a stream: write(bytes)…, then close() (the object exists) or discard()
    (neither the object nor a pending multipart upload remains, best effort: what a dead store keeps
    is orphan cleanup's, batches/retention.py).

    Bytes go to a spool (memory up to SPOOL_MEMORY, then a temporary file). Past MULTIPART_THRESHOLD a
    multipart upload begins: the spool so far is its first part, then every PART_SIZE spooled is the
    next (S3 takes parts of any size from 5 MiB to 5 GiB, the last one smaller). Each part is sent as the
    spool file, which botocore reads in small blocks: no part is ever a bytes object in memory."""

    def __init__(self, rel: str):
        self.cfg, self.client = _store()
        self.rel, self.key = rel, self.cfg.prefix + rel
        self.spool = tempfile.SpooledTemporaryFile(max_size=SPOOL_MEMORY)  # noqa: SIM115 - closed in close()/discard()
        self.buffered = 0  # bytes in the spool, not yet sent
        self.size = 0
        self.upload_id: str | None = None
        self.parts: list[dict] = []
        self.done = False

    def write(self, data: bytes) -> None:
        self.spool.write(data)
        self.buffered += len(data)
        self.size += len(data)
        if self.upload_id is None and self.buffered > MULTIPART_THRESHOLD:
            try:
                with errors(self.cfg, "start upload of", self.rel):
                    answer = self.client.create_multipart_upload(Bucket=self.cfg.bucket, Key=self.key)
                self.upload_id = answer["UploadId"]
            except BaseException:
                self.discard()
                raise
        if self.upload_id is not None and self.buffered >= PART_SIZE:
            self._send_part()

    def _body(self):
        self.spool.seek(0)
        # A small spool is in memory: hand botocore its bytes; a larger one is a file it reads in blocks.
        return self.spool.read() if self.buffered <= SPOOL_MEMORY else self.spool

    def _send_part(self) -> None:
        number = len(self.parts) + 1
        try:
            with errors(self.cfg, "upload part of", self.rel):
                answer = self.client.upload_part(
                    Bucket=self.cfg.bucket,
                    Key=self.key,
                    UploadId=self.upload_id,
                    PartNumber=number,
                    Body=self._body(),
                    ContentLength=self.buffered,
                )
        except BaseException:
            self.discard()
            raise
        self.parts.append({"PartNumber": number, "ETag": answer["ETag"]})
        self.spool.seek(0)
        self.spool.truncate()
        self.buffered = 0

    def close(self) -> None:
        try:
            if self.upload_id is None:
                with errors(self.cfg, "write", self.rel):
                    self.client.put_object(
                        Bucket=self.cfg.bucket, Key=self.key, Body=self._body(), ContentLength=self.buffered
                    )
            else:
                if self.buffered:
                    self._send_part()
                with errors(self.cfg, "complete upload of", self.rel):
                    self.client.complete_multipart_upload(
                        Bucket=self.cfg.bucket,
                        Key=self.key,
                        UploadId=self.upload_id,
                        MultipartUpload={"Parts": self.parts},
                    )
        except BaseException:
            self.discard()
            raise
        self.done = True
        self.spool.close()

    def discard(self) -> None:
        """Never raises: it runs while another error is on its way up."""
        self.spool.close()
        try:
            if self.done:
                with errors(self.cfg, "delete", self.rel):
                    self.client.delete_object(Bucket=self.cfg.bucket, Key=self.key)
            elif self.upload_id is not None:
                upload_id, self.upload_id = self.upload_id, None
                with errors(self.cfg, "abort upload of", self.rel):
                    self.client.abort_multipart_upload(Bucket=self.cfg.bucket, Key=self.key, UploadId=upload_id)
        except PayloadStoreUnavailable:
            log.warning("s3 payload store: %s left behind; orphan cleanup removes it", self.rel)
        self.done = False


class InputWriter:
    """A batch's inputs, appended to one object (`<batch>/input.jsonl`); each item's ref is its byte range."""

    uses_db = False  # add() never touches the database: rows can stream into a COPY meanwhile

    def __init__(self, batch_id: str):
        self.rel = f"{batch_id}/input.jsonl"
        self.upload = _Upload(self.rel)
        self.prefix = f"s3:{self.rel}#"
        self.offset = 0

    def add(self, idx: int, data: bytes) -> str:
        self.upload.write(data)
        self.upload.write(b"\n")
        ref = f"{self.prefix}{self.offset}:{len(data)}"
        self.offset += len(data) + 1
        return ref

    def close(self) -> None:
        self.upload.close()

    def discard(self) -> None:
        self.upload.discard()

    def read_back(self):
        """The lines written so far, as a binary file open for reading from the start (it stays readable
        after discard(): a local copy, streamed down from the object)."""
        if not self.upload.done:
            self.upload.close()
        copy = tempfile.TemporaryFile()  # noqa: SIM115 - the caller's Submission closes it
        try:
            for chunk in iter_file(self.rel, 1 << 20):
                copy.write(chunk)
        except BaseException:
            copy.close()
            raise
        copy.seek(0)
        return copy


class FileWriter:
    """A file of the OpenAI surface: write(bytes), close() → ref, discard(), `size`; FileTooLarge past `limit`."""

    def __init__(self, file_id: str, limit: int | None):
        self.rel = f"files/{file_id}"
        self.upload = _Upload(self.rel)
        self.limit = limit

    @property
    def size(self) -> int:
        return self.upload.size

    def write(self, data: bytes) -> None:
        if self.limit is not None and self.upload.size + len(data) > self.limit:
            raise FileTooLarge(self.limit)
        self.upload.write(data)

    def close(self) -> str:
        self.upload.close()
        return f"s3:{self.rel}"

    def discard(self) -> None:
        self.upload.discard()


class ResultGroup(ResultGroupBase):
    """Results written together as one object (`<batch>/results/<token>.jsonl`, a result a line): add()
    answers each result's ref, a byte range of the object, which exists once close() returns. One PUT
    for the group, not one per result: a PUT costs a round trip and money on S3, and an S3 server CPU
    (moto: ~3 ms a PUT); reads of neighbouring ranges coalesce (read_many). The key is the group's own
    (a fresh token), never an item's: a result written by a fenced-out claim lands in an object of its
    own group and never replaces the rescuer's (see storage.write_result). Nothing is sent before
    close(); a group with no result writes nothing. A failed close raises and leaves no object (_Upload),
    so no finish may commit pointing into it."""

    def __init__(self, batch_id: str):
        self.rel = f"{batch_id}/results/{secrets.token_hex(8)}.jsonl"
        self.prefix = f"s3:{self.rel}#"
        self.upload: _Upload | None = None
        self.offset = 0

    def add(self, item_id: str, data: bytes) -> str:
        if self.upload is None:
            self.upload = _Upload(self.rel)
        self.upload.write(data)
        self.upload.write(b"\n")  # a JSONL object an operator can read; the refs never rely on it
        ref = f"{self.prefix}{self.offset}:{len(data)}"
        self.offset += len(data) + 1
        return ref

    def close(self) -> None:
        if self.upload is not None:
            self.upload.close()

    def discard(self) -> None:
        if self.upload is not None:
            self.upload.discard()


# --- deleting and listing (retention, orphan cleanup) ------------------------------------------------


def delete(rel: str) -> None:
    """Best effort: runs once a row's delete has committed; what a dead store keeps is orphan cleanup's."""
    cfg, client = _store()
    try:
        with errors(cfg, "delete", rel):
            client.delete_object(Bucket=cfg.bucket, Key=cfg.prefix + rel)
    except PayloadStoreUnavailable:
        log.warning("s3 payload store: %s not deleted; orphan cleanup removes it", rel)


def delete_keys(rels: list[str]) -> None:
    cfg, client = _store()
    for i in range(0, len(rels), DELETE_PAGE):
        page = [{"Key": cfg.prefix + rel} for rel in rels[i : i + DELETE_PAGE]]
        with errors(cfg, "delete", rels[i]):
            answer = client.delete_objects(Bucket=cfg.bucket, Delete={"Objects": page, "Quiet": True})
        if answer.get("Errors"):
            first = answer["Errors"][0]
            raise PayloadStoreUnavailable(f"delete {first.get('Key')}: {first.get('Code')} {first.get('Message')}")


def objects(rel_prefix: str) -> Iterator[tuple[str, int, object]]:
    """(ref path, size, last modified) of every object under `rel_prefix`, page by page."""
    cfg, client = _store()
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=cfg.bucket, Prefix=cfg.prefix + rel_prefix)
    with errors(cfg, "list", rel_prefix):
        for page in pages:
            for entry in page.get("Contents", ()):
                yield entry["Key"][len(cfg.prefix) :], entry["Size"], entry["LastModified"]


def delete_prefix(rel_prefix: str) -> None:
    """Every object under `rel_prefix` (a batch's inputs and results). Best effort, as delete()."""
    cfg = config()
    read_ahead.forget(f"{cfg.bucket}/{cfg.prefix}{rel_prefix}")
    try:
        page = []
        for rel, _, _ in objects(rel_prefix):
            page.append(rel)
            if len(page) == DELETE_PAGE:
                delete_keys(page)
                page = []
        if page:
            delete_keys(page)
    except PayloadStoreUnavailable:
        log.warning("s3 payload store: %s* not deleted; orphan cleanup removes it", rel_prefix)


def top_level() -> list[str]:
    """The names directly under the prefix (`files`, batch ids), as the dir store's root lists them."""
    cfg, client = _store()
    names = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=cfg.bucket, Prefix=cfg.prefix, Delimiter="/")
    with errors(cfg, "list", cfg.prefix):
        for page in pages:
            names.extend(p["Prefix"][len(cfg.prefix) :].rstrip("/") for p in page.get("CommonPrefixes", ()))
    return names


def uploads() -> Iterator[tuple[str, str, object]]:
    """(ref path, upload id, initiated) of each multipart upload begun and neither completed nor aborted."""
    cfg, client = _store()
    pages = client.get_paginator("list_multipart_uploads").paginate(Bucket=cfg.bucket, Prefix=cfg.prefix)
    with errors(cfg, "list uploads of", cfg.prefix):
        for page in pages:
            for entry in page.get("Uploads", ()):
                yield entry["Key"][len(cfg.prefix) :], entry["UploadId"], entry["Initiated"]


def abort_upload(rel: str, upload_id: str) -> None:
    cfg, client = _store()
    with errors(cfg, "abort upload of", rel):
        client.abort_multipart_upload(Bucket=cfg.bucket, Key=cfg.prefix + rel, UploadId=upload_id)
