"""The item's error code moves from a table CHECK to the PostgreSQL domain relay_error_code
(batches/domains.py says why). The domain is created without its check, so that moving the column to it
rewrites nothing; `sync` then adds the check, which reads every stored item once. SQLite: the table is
rebuilt with the same list as a column CHECK."""

from django.db import migrations

import batches.models
from batches import domains


def create_domain(apps, schema_editor):
    domains.create(schema_editor.connection)


def drop_domain(apps, schema_editor):
    domains.drop(schema_editor.connection)


def add_check(apps, schema_editor):
    domains.sync(schema_editor.connection)


class Migration(migrations.Migration):
    dependencies = [
        ("batches", "0007_drop_redundant_indexes"),
    ]

    operations = [
        migrations.RunPython(create_domain, drop_domain),
        migrations.RemoveConstraint(model_name="item", name="item_error_code_known"),
        migrations.AlterField(
            model_name="item",
            name="error_code",
            field=batches.models.ErrorCodeField(blank=True, default="", max_length=64),
        ),
        migrations.RunPython(add_check, migrations.RunPython.noop),
    ]
