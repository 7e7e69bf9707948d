"""What PostgreSQL says about a scenario's items, and the accounting the report prints.

Read straight from the database (psycopg2, a fresh connection per read, so a PostgreSQL restart costs a
retry, not the drill). Per item: its state, its claim (`attempt`) and the host of that claim (the lease
owner begins with the hostname), its usage events (request_id = the item's id), its finishing attempts
(decision "finish"), and which host's provider call its stored result came from (the fake provider tags
every answer with the caller's address)."""

import json
import logging
import time
from dataclasses import dataclass, field

import psycopg2

from drill import topology as t

log = logging.getLogger(__name__)

FINAL = ("completed", "discarded", "cancelled")
TERMINAL_BATCH = ("completed", "cancelled", "failed", "expired")


@dataclass(frozen=True)
class ItemRow:
    id: str
    batch_id: str
    state: str
    attempt: int
    owner_host: str  # hostname of the claim that holds (or last held) the item: drill-a1 | drill-a2 | ""
    events: int
    finishes: int
    result_peer: str | None  # address of the host whose provider call produced the stored result


@dataclass
class Tally:
    items: int = 0
    final: int = 0
    events: int = 0
    lost: int = 0
    duplicated: int = 0
    notes: list = field(default_factory=list)

    def line(self, name: str, recovered_s: float) -> str:
        return (
            f"scenario {name}: items {self.items}, final {self.final}, usage events {self.events}, "
            f"lost {self.lost}, duplicated {self.duplicated}, recovered in {recovered_s:.1f} s"
        )


def account(
    expected: dict[str, int],
    rows: list[ItemRow],
    api: dict[str, list[str]],
    expected_ids: dict[str, list[str]],
    host_ips: dict[str, str],
) -> Tally:
    """The scenario's tally. `expected`: records submitted per batch; `rows`: the items the database holds;
    `api`: per batch, the ids of the successful results the API handed back; `expected_ids`: the ids sent.

    Lost: a record without a completed item that has its usage event, or without its result in the API's
    answer. Duplicated: an item with more than one usage event or more than one finishing attempt, an
    item whose stored result came from a host other than the claim that finished it (a late write let
    through), and a result the API hands back twice."""
    tally = Tally(items=sum(expected.values()))
    by_batch: dict[str, list[ItemRow]] = {b: [] for b in expected}
    for row in rows:
        by_batch.setdefault(row.batch_id, []).append(row)
    for batch_id, want in expected.items():
        items = by_batch.get(batch_id, [])
        good = 0
        for row in items:
            tally.events += row.events
            if row.state in FINAL:
                tally.final += 1
            if row.state == "completed" and row.events >= 1:
                good += 1
            late = (
                row.state == "completed"
                and row.result_peer is not None
                and host_ips.get(row.owner_host) not in (None, row.result_peer)
            )
            if row.events > 1 or row.finishes > 1 or late:
                tally.duplicated += 1
                tally.notes.append(
                    f"item {row.id}: usage events {row.events}, finishes {row.finishes}, "
                    f"finished by {row.owner_host or '?'}, result from {row.result_peer or '?'}"
                )
        got = api.get(batch_id, [])
        returned = set(got)
        missing = [i for i in expected_ids.get(batch_id, []) if i not in returned]
        twice = len(got) - len(returned)
        tally.duplicated += twice
        lost = max(want - good, len(missing))
        tally.lost += lost
        if lost or twice:
            tally.notes.append(
                f"batch {batch_id}: {want} sent, {good} completed with usage, {len(missing)} missing from "
                f"the results ({', '.join(missing[:5])}{'…' if len(missing) > 5 else ''}), {twice} returned twice"
            )
    return tally


# --- reads -----------------------------------------------------------------------------------------


def connect(topo: t.Topology, timeout: float = 90.0):
    """A new connection, waiting out a restart."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return psycopg2.connect(
                host=t.DB_IP,
                port=t.PG_PORT,
                dbname=t.DB_NAME,
                user=t.DB_USER,
                password=t.DB_PASSWORD,
                connect_timeout=5,
            )
        except psycopg2.OperationalError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def query(topo: t.Topology, sql: str, params=()) -> list[tuple]:
    for tries in range(30):
        conn = connect(topo)
        try:
            with conn, conn.cursor() as cur:
                cur.execute(sql, params)
                return cur.fetchall()
        except psycopg2.OperationalError:
            if tries == 29:
                raise
            time.sleep(1)
        finally:
            conn.close()
    return []


_ITEMS = """
SELECT i.id::text, i.batch_id::text, i.state, i.attempt, split_part(i.lease_owner, ':', 1),
       (SELECT count(*) FROM usage_usageevent u WHERE u.request_id = i.id::text),
       (SELECT count(*) FROM batches_attempt a WHERE a.item_id = i.id AND a.decision = 'finish'),
       p.data
FROM batches_item i
LEFT JOIN batches_payload p ON i.result_ref LIKE 'db:%%' AND p.key = substr(i.result_ref, 4)
WHERE i.batch_id = ANY(%s::uuid[])
"""


def _peer(data) -> str | None:
    if data is None:
        return None
    try:
        return (json.loads(bytes(data)).get("drill") or {}).get("peer")
    except (ValueError, AttributeError):
        return None


def items(topo: t.Topology, batch_ids: list[str]) -> list[ItemRow]:
    return [
        ItemRow(
            id=r[0],
            batch_id=r[1],
            state=r[2],
            attempt=r[3],
            owner_host=r[4],
            events=r[5],
            finishes=r[6],
            result_peer=_peer(r[7]),
        )
        for r in query(topo, _ITEMS, (batch_ids,))
    ]


def progress(topo: t.Topology, batch_ids: list[str]) -> dict:
    """Items by state, and the batches not yet at a terminal status."""
    states = dict(
        query(
            topo,
            "SELECT state, count(*) FROM batches_item WHERE batch_id = ANY(%s::uuid[]) GROUP BY state",
            (batch_ids,),
        )
    )
    open_batches = query(
        topo,
        "SELECT id::text, status FROM batches_batch WHERE id = ANY(%s::uuid[]) AND NOT status = ANY(%s)",
        (batch_ids, list(TERMINAL_BATCH)),
    )
    return {"states": states, "open": open_batches}


def running_on(topo: t.Topology, batch_ids: list[str], hostname: str) -> list[tuple[str, int]]:
    """(item id, claim) of the items a host's claims hold now."""
    return query(
        topo,
        "SELECT id::text, attempt FROM batches_item WHERE batch_id = ANY(%s::uuid[]) AND state = 'running' "
        "AND split_part(lease_owner, ':', 1) = %s",
        (batch_ids, hostname),
    )


def claims_of(topo: t.Topology, item_ids: list[str]) -> dict[str, tuple[str, int, str]]:
    """item id → (state, claim, host of that claim)."""
    rows = query(
        topo,
        "SELECT id::text, state, attempt, split_part(lease_owner, ':', 1) FROM batches_item WHERE id = ANY(%s::uuid[])",
        (item_ids,),
    )
    return {r[0]: (r[1], r[2], r[3]) for r in rows}


_RESULT_ROWS = """
SELECT i.id::text, p.key = substr(i.result_ref, 4), p.data
FROM batches_item i
JOIN batches_payload p ON p.key LIKE i.batch_id::text || '/out/' || i.id::text || '%%'
WHERE i.id = ANY(%s::uuid[])
"""


def late_results(topo: t.Topology, item_ids: list[str], peer: str) -> tuple[int, int]:
    """Of the items' stored results (the `db` store's rows), those produced by the host at `peer`: how many
    the items do not point at (written, then refused by the finish's fence: the item kept its rescuer's
    result) and how many they do. Keys without a per-write suffix are overwritten in place, so a late
    write there shows only as a result from the wrong host (`account` counts it duplicated)."""
    refused = kept = 0
    for _, current, data in query(topo, _RESULT_ROWS, (item_ids,)):
        if _peer(data) != peer:
            continue
        if current:
            kept += 1
        else:
            refused += 1
    return refused, kept
