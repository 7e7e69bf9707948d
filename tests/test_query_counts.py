"""Statement counts of the hot paths, pinned: a change that adds a query per request, per item or
per listed batch fails here instead of showing up later as a slower benchmark.

The numbers are today's best, pinned exactly: a change that saves a statement
lowers its pin here. Counting statements (not timing them) is exact and immune
to a noisy machine. The live request and the item run count every statement of
the request's own connection (authentication, routing, usage event; claim, run,
finish); a batch list must cost the same for one batch as for five.
"""

import io
import json

import pytest
from django.db import connection, connections
from django.test.utils import CaptureQueriesContext

from batches import dispatch, ingest
from batches.lifecycle import claim as claims
from batches.lifecycle import sql as lsql
from batches.surfaces.native import submit
from batches.surfaces.openai import create as openai_create
from batches.surfaces.openai import validation
from batches.worker import bookkeeper as keeper
from batches.worker import drain as draining
from batches.worker import execute
from core import auth
from devkit.upstream import Reply

pytestmark = pytest.mark.django_db
runs_items = pytest.mark.django_db(transaction=True)

CHAT = "/v1/chat/completions"

# Pinned statement counts (see the module docstring).
# 5 before the catalog cache, 2 with it (key lookup + usage insert); the usage insert alone
# since the relay key's row is cached with the catalog.
LIVE_REQUEST = 1
# Redis round trips of one live request: the key pick (catalog generation, inbound limit, breaker,
# tier limit, provider quota, LRU) and the success settle. 5 before the generation and the provider
# quota moved into the pick.
LIVE_REQUEST_REDIS = 2
# 14 before the catalog cache; 12 with the attempt row; the claim in one statement (-2),
# the finish with its attempt row and usage event in one statement (-4: no BEGIN/COMMIT round trips),
# the relay key's recheck from the catalog cache (-1). The item measured ends its batch: +1 for the webhook
# endpoints of its owner, looked up before the final move (none here, so the move stays one statement); +1 for
# the ended batch's counts kept on its row (once per batch, so the lists never group its items again).
BATCH_ITEM_RUN = 7
# Redis round trips of one batch item: the key pick (which confirms the catalog generation the
# credential and the policy were checked with) and the success settle. 3 while the item read the
# generation first.
BATCH_ITEM_REDIS = 2
# In a drain, per item: the key pick, which carries the previous item's success settle (policies.lua.deferring).
DRAIN_ITEM_REDIS = 1
# The drain's steady state, per item: claim (which also makes the previous finishes' completion check)
# and the finish (made by the worker process's bookkeeper thread, on its own connection: counted too).
# 4 before the drain left the completion check to its next claim, 3 before the relay key's recheck
# came from the catalog cache.
DRAIN_PER_ITEM = 2
# Claiming ahead, the bookkeeper sends an item's finish in front of the next claim, as one query string
# (keeper._run_pair, finishing.HeldFinish): one round trip per item.
DRAIN_PER_ITEM_CLAIMING_AHEAD = 1
# Each one statement less since the relay key's row is cached with the catalog.
OPENAI_LIST_PAGE = 2
OPENAI_RETRIEVE = 2
NATIVE_STATUS = 3
NATIVE_RESULTS = 2
FILES_LIST = 2
FILE_RETRIEVE = 2


def count(fn) -> int:
    with CaptureQueriesContext(connection) as ctx:
        fn()
    return len(ctx.captured_queries)


def bearer(catalog) -> dict:
    return {"Authorization": f"Bearer {catalog.key}"}


def openai_batch(catalog, n=2):
    principal = auth.principal_for_key(catalog.key)
    records = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": CHAT,
            "body": {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(n)
    ]
    body = {"endpoint": CHAT, "completion_window": "24h", "requests": records}
    with ingest.read_submission(io.BytesIO(json.dumps(body).encode()), 10**7, 100) as submission:
        batch = openai_create.create(principal, submission)
    validation.validate(batch.id)
    return batch


def native_batch(catalog, n=3):
    principal = auth.principal_for_key(catalog.key)
    body = {"shape": "openai", "requests": [{"model": "gpt-4o", "messages": []}] * n}
    return submit.submit_native(principal, io.BytesIO(json.dumps(body).encode()))


def redis_round_trips(fn, monkeypatch) -> int:
    """Commands sent to Redis by `fn`'s thread (each is one round trip: the hot paths use no pipelines).
    Another thread of this process (a server thread a test before left finishing its work) is not
    `fn`'s: counting it made the count flaky under load."""
    import threading

    from redis.connection import AbstractConnection

    sent = []
    real = AbstractConnection.send_packed_command
    caller = threading.get_ident()

    def counting(self, command, check_health=True):
        if threading.get_ident() == caller:
            sent.append(command)
        return real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    fn()
    monkeypatch.setattr(AbstractConnection, "send_packed_command", real)
    return len(sent)


def test_one_live_request(client, catalog, monkeypatch):
    body = {"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}

    def call():
        resp = client.post(CHAT, data=body, content_type="application/json", headers=bearer(catalog))
        assert resp.status_code == 200, resp.content

    call()  # warm: first-use caches are not what is pinned
    n = count(call)
    assert n == LIVE_REQUEST
    assert redis_round_trips(call, monkeypatch) == LIVE_REQUEST_REDIS


@runs_items
def test_one_batch_item_run(catalog, fake, monkeypatch):
    native_batch(catalog, n=2)
    execute.run_item(claims.claim("warm"))
    n = count(lambda: execute.run_item(claims.claim("test-runner")))
    assert n == BATCH_ITEM_RUN
    native_batch(catalog, n=1)
    item = claims.claim("test-runner")
    assert redis_round_trips(lambda: execute.run_item(item), monkeypatch) == BATCH_ITEM_REDIS


def count_with_bookkeeper(fn) -> int:
    """`count`, adding the statements of the worker process's bookkeeper thread (its own connection)."""
    thread = keeper.bookkeeper()
    # The thread's own connection object (`connection` is a proxy that each thread resolves to its own).
    ctx = thread.submit(lambda: CaptureQueriesContext(connections["default"]).__enter__()).result()
    try:
        n = count(fn)
    finally:
        thread.submit(lambda: ctx.__exit__(None, None, None)).result()
    return n + len(ctx.captured_queries)


@runs_items
@pytest.mark.parametrize("claim_ahead", [False, True], ids=["own-claims", "claims-ahead"])
def test_the_drain_per_item(catalog, fake, monkeypatch, settings, claim_ahead):

    settings.RELAY_BATCH_HEARTBEAT_SECONDS = 3600  # no beat among the counted statements
    # Claiming ahead moves the claim to the bookkeeper thread; it costs no statement more.
    settings.RELAY_BATCH_CLAIM_AHEAD_MIN_LEFT = 1 if claim_ahead else 0
    monkeypatch.setattr(draining, "CLAIM_AHEAD_MAX_ITEM_S", 3600)
    monkeypatch.setattr(dispatch, "pass_on", lambda: False)  # Redis only; keep no wake-up queued
    monkeypatch.setattr(dispatch, "wake_workers", lambda known_work=False: 0)
    # The bookkeeper's wait for a claim to pair a finish with, long enough for a busy test machine: the
    # slot hands the claim over right after the finish.
    monkeypatch.setattr(keeper, "PAIR_WAIT_S", 0.3)
    batch = native_batch(catalog, n=17)
    draining.drain(max_items=3)  # warm: first-use caches (and both threads' prepared claims) are not pinned
    three = count_with_bookkeeper(lambda: draining.drain(max_items=3))
    six = count_with_bookkeeper(lambda: draining.drain(max_items=6))
    assert (six - three) / 3 == (DRAIN_PER_ITEM_CLAIMING_AHEAD if claim_ahead else DRAIN_PER_ITEM)
    # Redis: one round trip per item, the key pick carrying the previous item's success settle.
    one = redis_round_trips(lambda: draining.drain(max_items=1), monkeypatch)
    two = redis_round_trips(lambda: draining.drain(max_items=2), monkeypatch)
    assert two - one == DRAIN_ITEM_REDIS
    assert draining.drain() == 2  # the last two, then the claim that finds none; the end completes the batch
    batch.refresh_from_db()
    assert batch.status == "completed"


def test_openai_list_is_one_query_per_page_whatever_its_size(client, catalog):
    openai_batch(catalog)
    one = count(lambda: client.get("/v1/batches", headers=bearer(catalog)))
    for _ in range(4):
        openai_batch(catalog)

    def page():
        resp = client.get("/v1/batches", headers=bearer(catalog))
        assert resp.status_code == 200 and len(resp.json()["data"]) == 5

    five = count(page)
    assert five == one == OPENAI_LIST_PAGE


def test_openai_retrieve(client, catalog):
    batch = openai_batch(catalog)
    n = count(lambda: client.get(f"/v1/batches/{batch.public_id}", headers=bearer(catalog)))
    assert n == OPENAI_RETRIEVE


def test_native_status_and_results(client, catalog):
    batch = native_batch(catalog, n=3)

    def status():
        resp = client.get(f"/v1/batches/{batch.id}", headers=bearer(catalog))
        b"".join(resp.streaming_content)

    def results():
        resp = client.get(f"/v1/batches/{batch.id}/results", headers=bearer(catalog))
        b"".join(resp.streaming_content)

    s, r = count(status), count(results)
    assert (s, r) == (NATIVE_STATUS, NATIVE_RESULTS)


def test_files_list_and_retrieve(client, catalog):
    batch = openai_batch(catalog)
    file_id = f"file-{batch.input_file_id.hex}"
    listed = count(lambda: client.get("/v1/files", headers=bearer(catalog)))
    one = count(lambda: client.get(f"/v1/files/{file_id}", headers=bearer(catalog)))
    assert (listed, one) == (FILES_LIST, FILE_RETRIEVE)


def test_the_finish_statement_casts_to_column_types_without_their_lengths():
    """The prepared finish casts its INSERT values (no column gives them a type); a cast to varchar(64)
    would cut a longer value where the column refuses it."""

    types = lsql._types_of("usage_usageevent", ["request_id", "ts", "status", "input_tokens"])
    assert types == ["varchar", "timestamp with time zone", "smallint", "bigint"]


@runs_items
def test_the_finish_statement_is_built_once_per_shape(catalog, fake, monkeypatch):
    """The finish's text (~60 quoted columns and their casts) is built once per shape, not per item:
    items finishing the same way reuse it; a different final state with its error fields is a shape of
    its own, and its values still go through the fields' preparation."""

    from batches.models import Item

    monkeypatch.setattr(lsql, "_finish_shapes", {})
    built = []
    real = lsql.row_inserts
    monkeypatch.setattr(lsql, "row_inserts", lambda *a, **k: built.append(a) or real(*a, **k))
    batch = native_batch(catalog, n=4)
    for _ in range(3):
        execute.run_item(claims.claim("test-runner"))
    assert len(built) == 1 and len(lsql._finish_shapes) == 1
    fake.script("*", [Reply(status=400, body={"error": {"message": "bad"}})])
    execute.run_item(claims.claim("test-runner"))
    assert len(built) == 2 and len(lsql._finish_shapes) == 2
    states = sorted(Item.objects.filter(batch=batch).values_list("state", "error_code"))
    assert states == [("completed", ""), ("completed", ""), ("completed", ""), ("discarded", "upstream_error")]
