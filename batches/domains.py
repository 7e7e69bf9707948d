"""An item's error code as a PostgreSQL domain: `relay_error_code`, varchar(64) whose CHECK lists
batches.outcomes.Code's values (and "", no error yet).

Why a domain and not a table CHECK: PostgreSQL rebuilds every CHECK constraint of a table from its
stored text at every UPDATE of one of its rows (`ExecRelCheck` → `stringToNode`), whichever columns
the UPDATE sets. The list of codes was 7.6 KB of that text, and every item is updated twice (the
claim, the finish): pgbench put it at ~48 µs of PostgreSQL's CPU per UPDATE of an item (decision 0011). A
domain's check is parsed once per connection, and runs only when the column is written (an item's
insert, its finish, a cancel; not the claim or the heartbeat).

The check follows Code: `sync` runs after every `migrate` (batches.apps), and its name carries a digest
of the list, so a code added to Code reaches the database at the next start without a migration of its
own. On other databases (SQLite, embedded) the column carries the same list as a column CHECK.
"""

from __future__ import annotations

import hashlib
import re

from batches.outcomes import Code

DOMAIN = "relay_error_code"


def codes() -> list[str]:
    return ["", *Code.values]


def sql_list(values: list[str]) -> str:
    """The codes as SQL literals. They are identifiers ([a-z_]); anything else is refused, not quoted."""
    for value in values:
        if not re.fullmatch(r"[a-z_]*", value):
            raise ValueError(f"error code {value!r} is not made of [a-z_]")
    return ", ".join(f"'{value}'" for value in values)


def constraint_name(values: list[str]) -> str:
    digest = hashlib.blake2b("\n".join(sorted(values)).encode(), digest_size=6).hexdigest()
    return f"{DOMAIN}_known_{digest}"


def create(connection) -> None:
    """The domain without its check (the migration's first step: a column moved to a domain that has
    constraints is rewritten; one without them is not). `sync` adds the check."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"CREATE DOMAIN {DOMAIN} AS varchar(64)")


def drop(connection) -> None:
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(f"DROP DOMAIN IF EXISTS {DOMAIN}")


def sync(connection, values: list[str] | None = None) -> bool:
    """Make the domain's check list exactly `values` (Code's, by default); True when it changed. The old
    check is dropped and the new one added in one transaction (the add checks every stored item). A
    database without the domain (before its migration) is left alone."""
    if connection.vendor != "postgresql":
        return False
    values = codes() if values is None else values
    name = constraint_name(values)
    with connection.cursor() as cursor:
        cursor.execute("SELECT to_regtype(%s) IS NOT NULL", [DOMAIN])
        if not cursor.fetchone()[0]:
            return False
        cursor.execute("SELECT conname FROM pg_constraint WHERE contypid = to_regtype(%s)", [DOMAIN])
        names = sorted(row[0] for row in cursor.fetchall())
    if names == [name]:
        return False
    from django.db import transaction

    with transaction.atomic(using=connection.alias), connection.cursor() as cursor:
        for old in names:
            cursor.execute(f'ALTER DOMAIN {DOMAIN} DROP CONSTRAINT "{old}"')
        cursor.execute(f'ALTER DOMAIN {DOMAIN} ADD CONSTRAINT "{name}" CHECK (VALUE IN ({sql_list(values)}))')
    return True
