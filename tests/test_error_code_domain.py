"""An item's error code is a PostgreSQL domain whose check follows batches.outcomes.Code
(batches/domains.py): every code is accepted, anything else is refused by the database, and a change
of the list reaches the database through `sync` (run after every migrate)."""

import pytest
from django.db import IntegrityError, connection, transaction

from batches import domains
from batches.models import Item
from batches.outcomes import Code
from tests.test_claim import native_batch

pytestmark = pytest.mark.django_db


def _store(item_id, code: str) -> None:
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("UPDATE batches_item SET error_code = %s WHERE id = %s", [code, item_id])


def test_every_code_is_stored_and_an_unknown_one_is_refused(catalog):
    item = Item.objects.filter(batch=native_batch(catalog, 1)).get()
    for code in ["", *Code.values]:
        _store(item.pk, code)
    with pytest.raises(IntegrityError, match=domains.DOMAIN):
        _store(item.pk, "not_a_code")
    assert Item.objects.get(pk=item.pk).error_code == Code.values[-1]


def test_the_items_table_has_no_check_of_its_own_on_the_code():
    """The point of the domain: an UPDATE of an item (the claim, the heartbeat) no longer rebuilds a
    check of ~35 codes from its text."""
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'batches_item'::regclass AND contype = 'c'"
            " AND pg_get_constraintdef(oid) LIKE %s",
            ["%upstream_error%"],
        )
        assert cursor.fetchone()[0] == 0
        cursor.execute(
            "SELECT format_type(atttypid, atttypmod) FROM pg_attribute WHERE attrelid = "
            "'batches_item'::regclass AND attname = 'error_code'"
        )
        assert cursor.fetchone()[0] == domains.DOMAIN


def test_sync_follows_the_list_of_codes_and_does_nothing_when_it_matches(catalog):
    item = Item.objects.filter(batch=native_batch(catalog, 1)).get()
    assert domains.sync(connection) is False  # migrate left it in step with Code
    assert domains.sync(connection, [*domains.codes(), "brand_new_code"]) is True
    _store(item.pk, "brand_new_code")
    _store(item.pk, "")
    assert domains.sync(connection) is True
    with pytest.raises(IntegrityError):
        _store(item.pk, "brand_new_code")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_constraint WHERE contypid = to_regtype(%s)", [domains.DOMAIN])
        assert cursor.fetchone()[0] == 1


def test_a_code_that_is_not_an_identifier_never_reaches_the_sql():
    with pytest.raises(ValueError, match="a-z_"):
        domains.sql_list(["ok", "x'); DROP TABLE batches_item; --"])
