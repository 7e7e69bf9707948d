"""The catalog's generation counter: one Redis integer that every catalog write increments, and the
queryset that makes bulk writes bump it. A leaf (Redis and Django's ORM):
the catalog models (core/models.py, policies/models.py) use its queryset, and core/catalog.py, which
reads those models, registers the cache it drops on every bump (`on_bump`). See core/catalog.py for
the scheme.
"""

import random
from collections.abc import Callable

import redis
from django.db import models, transaction

from core.redis import get_redis

GEN_KEY = "relay:catalog:gen"

# INCR, but a missing counter starts from a random value (see core/catalog.py's docstring).
_BUMP_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[1]) end
return redis.call('INCR', KEYS[1])
"""

# What a bump tells, in this process: core.catalog drops its cache, and the scrubber reads the host keys
# again (core.scrub: its matcher follows the catalog's generation). Both register in the relay app's
# ready(), so this module imports neither (the catalog models import it).
_listeners: list[Callable[[], None]] = []
# A bump whose Redis write failed: retried by this process's next catalog read; meanwhile nothing is
# served from a cache here, and other processes cannot read the counter either.
_pending = False


def seed() -> int:
    return random.randrange(1 << 40, 1 << 52)


def on_bump(listener: Callable[[], None]) -> None:
    """Call `listener` on every bump made in this process (before Redis is told)."""
    _listeners.append(listener)


def bump() -> None:
    """Invalidate every process's cache: now, and again when the transaction commits."""
    _bump_now()
    transaction.on_commit(_bump_now, robust=True)


def bump_pending() -> bool:
    return _pending


def retry_bump() -> None:
    _bump_now()


def _bump_now() -> None:
    global _pending
    for listener in _listeners:
        listener()
    try:
        get_redis().eval(_BUMP_LUA, 1, GEN_KEY, seed())
        _pending = False
    except redis.RedisError:
        _pending = True


class CatalogQuerySet(models.QuerySet):
    """Bulk writes on catalog models bump the generation (signals do not fire for them)."""

    def update(self, **kwargs):
        rows = super().update(**kwargs)
        bump()
        return rows

    def delete(self):
        result = super().delete()
        bump()
        return result

    def bulk_create(self, objs, *args, **kwargs):
        result = super().bulk_create(objs, *args, **kwargs)
        bump()
        return result

    def bulk_update(self, objs, fields, *args, **kwargs):
        rows = super().bulk_update(objs, fields, *args, **kwargs)
        bump()
        return rows

    def _raw_delete(self, using):
        # The collector's fast path (cascades without signals).
        rows = super()._raw_delete(using)
        bump()
        return rows

    _raw_delete.alters_data = True
