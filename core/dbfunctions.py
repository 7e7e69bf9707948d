"""Database expressions the ORM lacks, written once for both backends (PostgreSQL; SQLite in embedded mode)."""

from django.db.models import CharField, Func


class UUIDText(Func):
    """A UUID column as its canonical hyphenated text, which is how usage events store batch ids.

    A plain `Cast(..., CharField())` gives that on PostgreSQL but 32 bare hex digits on SQLite
    (where Django stores UUIDs without hyphens), so a join on it would silently match nothing in
    embedded mode.
    """

    output_field = CharField()
    arity = 1

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="(%(expressions)s)::text", **extra)

    def as_sqlite(self, compiler, connection, **extra):
        parts = " || '-' || ".join(
            f"substr(%(expressions)s, {start}, {length})"
            for start, length in ((1, 8), (9, 4), (13, 4), (17, 4), (21, 12))
        )
        return self.as_sql(compiler, connection, template=f"lower({parts})", **extra)
